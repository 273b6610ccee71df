"""A trainer's scratch directories: the ones dead processes left (a SIGKILL skips the removal at exit) are removed
when the next one is made, and nothing of a live process, another namespace's or another kind's is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tfelastic.trainer import scratch


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def make(parent: Path, kind: str, pid: int, namespace: int | None = None) -> Path:
    namespace = scratch._pid_namespace() if namespace is None else namespace
    path = parent / f"tfelastic-{kind}-{namespace}-{pid}-abc123"
    path.mkdir()
    (path / "flash.bin").write_bytes(b"x" * 4096)
    return path


def test_a_new_directory_removes_what_dead_processes_left_and_nothing_else(tmp_path: Path) -> None:
    dead = dead_pid()
    orphan = make(tmp_path, "scratch", dead)
    live = make(tmp_path, "scratch", os.getpid())
    other_kind = make(tmp_path, "export", dead)
    other_namespace = make(tmp_path, "scratch", dead, namespace=scratch._pid_namespace() + 1)
    unrelated = tmp_path / f"scratch-{dead}-x"
    unrelated.mkdir()

    made = Path(scratch.process_temp_dir("scratch", str(tmp_path)))

    assert not orphan.exists()
    assert all(p.exists() for p in (live, other_kind, other_namespace, unrelated))
    assert made.is_dir() and made.name.startswith(f"tfelastic-scratch-{scratch._pid_namespace()}-{os.getpid()}-")


def test_a_file_with_an_orphans_name_is_left_alone(tmp_path: Path) -> None:
    """Only directories are scratch directories."""
    impostor = tmp_path / f"tfelastic-scratch-{scratch._pid_namespace()}-{dead_pid()}-abc"
    impostor.write_text("not ours")
    assert scratch.remove_orphans("scratch", str(tmp_path)) == []
    assert impostor.exists()


def test_a_missing_parent_has_no_orphans(tmp_path: Path) -> None:
    assert scratch.remove_orphans("scratch", str(tmp_path / "absent")) == []


def test_the_directory_is_removed_when_its_process_exits(tmp_path: Path) -> None:
    made = subprocess.run([sys.executable, "-c", "from tfelastic.trainer import scratch; "
                           f"print(scratch.process_temp_dir('restore', {str(tmp_path)!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert made.startswith(str(tmp_path)) and not os.path.exists(made)
