"""A checkpoint write cut off by SIGKILL never leaves a checkpoint that cannot be restored: the previous one is
used. Real TensorFlow saves of 64 MiB, killed at random times, six times over one directory."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import ROOT, wait_for
from tests.conftest import Reaper
from tests.workers import worker_env

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

WRITER = [sys.executable, str(ROOT / "tests" / "trainers" / "checkpoint_writer.py")]


def unfinished_save(directory: Path, last_saved: int) -> bool:
    """Whether the kill left files of a save that did not complete (a temp dir, or files of a later step)."""
    for path in directory.iterdir():
        if path.name.endswith("_temp") or "_temp" in path.name:
            return True
        match = re.match(r"ckpt-(\d+)\.", path.name)
        if match and int(match.group(1)) > last_saved:
            return True
    return False


def wait_saved(log: Path, step: int) -> None:
    wait_for(lambda: f"saved {step}\n" in log.read_text(), 120, f"step {step} saved")


def test_kills_during_saves_always_leave_the_last_completed_checkpoint_restorable(tmp_path: Path,
                                                                                 reaper: Reaper) -> None:
    directory = tmp_path / "ckpt"
    rng = random.Random(7)
    last_saved = 0
    torn = 0
    out = tmp_path / "writer.log"
    for attempt in range(7):  # the seventh start only checks what the sixth kill left
        with open(out, "w") as log:
            writer = reaper.popen([*WRITER, str(directory)], stdout=log, stderr=subprocess.STDOUT, env=worker_env())
        restored = wait_for(lambda: re.search(r"^restored (\d+) (.*)$", out.read_text(), re.M), 120, "restore")
        step, values = int(restored.group(1)), restored.group(2).split()
        assert step >= last_saved, f"restored {step}, but the save of step {last_saved} had completed"
        assert values == [f"{step:g}"] or (step == 0 and values == ["0"]), f"inconsistent restore: {restored[0]}"
        if attempt == 6:
            writer.kill()
            writer.wait()
            break
        first = step + 2
        wait_saved(out, first)
        time.sleep(rng.uniform(0.0, 0.5))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        last_saved = max(int(s) for s in re.findall(r"^saved (\d+)$", out.read_text(), re.M))
        torn += unfinished_save(directory, last_saved)
    assert torn >= 1, "no kill landed inside a save: the test did not test anything"


SNAPSHOT_WRITER = [sys.executable, str(ROOT / "tests" / "trainers" / "snapshot_writer.py")]


def last_number(pattern: str, text: str) -> int:
    return max((int(n) for n in re.findall(pattern, text, re.M)), default=0)


def test_kills_during_fast_tier_snapshots_never_restore_a_torn_one(tmp_path: Path, reaper: Reaper) -> None:
    """The same with the fast tier: asynchronous snapshots into a local directory (the tier's /dev/shm in
    production) and the background copy to the shared one, killed at random times. A restore takes the newest
    complete snapshot of either tier, never one the kill cut off, and never goes behind a snapshot that was
    reported complete."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    rng = random.Random(11)
    sealed = persisted = 0
    torn = 0
    tiers: set[str] = set()
    out = tmp_path / "writer.log"
    env = worker_env() | {"TFELASTIC_LOCAL_CHECKPOINT_DIR": str(local)}
    for attempt in range(7):  # the seventh start only checks what the sixth kill left
        with open(out, "w") as log:
            writer = reaper.popen([*SNAPSHOT_WRITER, str(shared)], stdout=log, stderr=subprocess.STDOUT, env=env)
        restored = wait_for(lambda: re.search(r"^restored (\d+) (\w+) (.*)$", out.read_text(), re.M), 120,
                            "restore")
        step, tier, values = int(restored.group(1)), restored.group(2), restored.group(3).split()
        assert step >= max(sealed, persisted), f"restored {step}, but step {max(sealed, persisted)} was complete"
        assert values == [f"{step:g}"] or (step == 0 and values == ["0"]), f"inconsistent restore: {restored[0]}"
        tiers.add(tier)
        if attempt == 6:
            writer.kill()
            writer.wait()
            break
        sealed_line = f"sealed {step + 3}\n"
        wait_for(lambda: sealed_line in out.read_text(), 120, sealed_line)  # noqa: B023 - waited for at once
        time.sleep(rng.uniform(0.0, 0.5))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        text = out.read_text()
        sealed, persisted = last_number(r"^sealed (\d+)$", text), last_number(r"^persisted (\d+)$", text)
        torn += any(p.name.startswith(".partial-") for d in (local / "shared", shared) if d.is_dir()
                    for p in d.iterdir())
    assert torn >= 1, "no kill landed inside a snapshot's write or copy: the test did not test anything"
    assert tiers >= {"local"}, tiers
