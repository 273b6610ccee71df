"""Temporary directories a trainer process owns (a worker's scratch snapshots, a flash restore's TensorFlow
checkpoint, an export on a worker that is not the chief). They can be as large as the model, and a SIGKILL skips
the removal at exit: so each is named after the process that made it, and making one removes those that processes
since dead left in the same place.

A name is ``tfelastic-<kind>-<pid namespace>-<pid>-<random>``: a directory of a process in another PID namespace
(another container sharing the temporary directory) is never taken for a dead one's.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import tempfile

log = logging.getLogger(__name__)


def process_temp_dir(kind: str, parent: str | None = None) -> str:
    """A new directory for this process's ``kind`` of scratch files under ``parent`` (default: the temporary
    directory), removed when the process exits; the ones dead processes left there are removed first."""
    parent = parent or tempfile.gettempdir()
    remove_orphans(kind, parent)
    path = tempfile.mkdtemp(prefix=f"{_prefix(kind)}{_pid_namespace()}-{os.getpid()}-", dir=parent)
    atexit.register(shutil.rmtree, path, True)
    return path


def remove_orphans(kind: str, parent: str) -> list[str]:
    """Removes ``kind``'s directories under ``parent`` whose process, in this PID namespace, is gone and that
    this user owns; returns them."""
    pattern = re.compile(rf"^{re.escape(_prefix(kind))}{_pid_namespace()}-(\d+)-")
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        found = pattern.match(name)
        if not found or _alive(int(found.group(1))):
            continue
        path = os.path.join(parent, name)
        try:
            status = os.lstat(path)
        except FileNotFoundError:  # its own process's exit, or another new one's sweep, came first
            continue
        if stat.S_ISDIR(status.st_mode) and status.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d scratch director%s that dead processes left: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def _prefix(kind: str) -> str:
    return f"tfelastic-{kind}-"


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: one namespace as far as we can tell
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
