"""A checkpoint write cut off by SIGKILL never leaves a checkpoint that cannot be restored: the previous one is
used (issue 3 §4). Real TensorFlow saves of 64 MiB, killed at random times, six times over one directory."""

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


def test_kills_during_saves_always_leave_the_last_completed_checkpoint_restorable(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    rng = random.Random(7)
    last_saved = 0
    torn = 0
    out = tmp_path / "writer.log"
    for attempt in range(7):  # the seventh start only checks what the sixth kill left
        with open(out, "w") as log:
            writer = subprocess.Popen([*WRITER, str(directory)], stdout=log, stderr=subprocess.STDOUT,
                                      env=worker_env())
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
