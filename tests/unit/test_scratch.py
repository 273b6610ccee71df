"""A trainer's scratch directories: the ones dead processes left (a SIGKILL skips the removal at exit) are removed
when the next one is made, and nothing of a live process, another host's or namespace's, another kind's, another
user's or a made-up name's is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tfelastic.trainer import scratch


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def make(parent: Path, kind: str, pid: int | str, host: str | None = None) -> Path:
    path = parent / f"tfelastic-{kind}-{host or scratch.host_id()}-{pid}-abc123"
    path.mkdir()
    (path / "flash.bin").write_bytes(b"x" * 4096)
    return path


def test_a_new_directory_removes_what_dead_processes_left_and_nothing_else(tmp_path: Path) -> None:
    dead = dead_pid()
    orphan = make(tmp_path, "scratch", dead)
    live = make(tmp_path, "scratch", os.getpid())
    other_kind = make(tmp_path, "export", dead)
    elsewhere = make(tmp_path, "scratch", dead, host="0123456789ab")  # another host, boot or PID namespace
    impossible = make(tmp_path, "scratch", "99999999999999999999")  # no process has it: not an orphan's
    unrelated = tmp_path / f"scratch-{dead}-x"
    unrelated.mkdir()

    made = Path(scratch.process_temp_dir("scratch", str(tmp_path)))

    assert not orphan.exists()
    assert all(p.exists() for p in (live, other_kind, elsewhere, impossible, unrelated))
    assert made.is_dir() and made.name.startswith(f"tfelastic-scratch-{scratch.host_id()}-{os.getpid()}-")


def test_files_links_and_other_users_directories_are_left_alone(tmp_path: Path) -> None:
    dead = dead_pid()
    impostor = tmp_path / f"tfelastic-scratch-{scratch.host_id()}-{dead}-file"
    impostor.write_text("not a directory")
    target = tmp_path / "precious"
    target.mkdir()
    link = tmp_path / f"tfelastic-scratch-{scratch.host_id()}-{dead}-link"
    link.symlink_to(target)
    others = make(tmp_path, "scratch", dead)
    if os.geteuid() == 0:
        os.chown(others, 65534, 65534)
    assert scratch.remove_orphans("scratch", str(tmp_path)) == ([] if os.geteuid() == 0 else [str(others)])
    assert impostor.exists() and link.is_symlink() and target.is_dir()


def test_a_missing_parent_has_no_orphans(tmp_path: Path) -> None:
    assert scratch.remove_orphans("scratch", str(tmp_path / "absent")) == []


def test_the_host_id_differs_between_pid_namespaces() -> None:
    if os.geteuid() != 0:
        pytest.skip("a PID namespace of its own needs root")
    inside = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                             "from tfelastic.trainer import scratch; print(scratch.host_id())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert len(inside) == 12 and inside != scratch.host_id()


def test_the_directory_is_removed_when_its_process_exits(tmp_path: Path) -> None:
    made = subprocess.run([sys.executable, "-c", "from tfelastic.trainer import scratch; "
                           f"print(scratch.process_temp_dir('restore', {str(tmp_path)!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert made.startswith(str(tmp_path)) and not os.path.exists(made)
