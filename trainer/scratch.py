"""Temporary directories a trainer process owns (a worker's scratch snapshots, a flash restore's TensorFlow
checkpoint, an export on a worker that is not the chief). They can be as large as the model, and a SIGKILL skips
the removal at exit: so each is named after the process that made it, and making one removes those that processes
since dead left in the same place.

A name is ``tfelastic-<kind>-<host>-<pid>-<random>``, where ``<host>`` tells this boot of this host and this PID
namespace from any other: a directory of a process elsewhere (another container, or another host where the
temporary directory is shared) is never taken for a dead one's. A directory is removed only when it is a directory
(not a link) that this user owns, named for a process that does not exist.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
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
    path = tempfile.mkdtemp(prefix=f"{_prefix(kind)}{host_id()}-{os.getpid()}-", dir=parent)
    atexit.register(shutil.rmtree, path, True)
    return path


def remove_orphans(kind: str, parent: str) -> list[str]:
    """Removes ``kind``'s directories under ``parent`` that this user owns, made on this host, boot and PID
    namespace by a process that is gone; returns them."""
    pattern = re.compile(rf"^{re.escape(_prefix(kind))}{host_id()}-(\d{{1,10}})-")
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        found = pattern.match(name)
        path = os.path.join(parent, name)
        if found and _ours(path) and not _alive(int(found.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d scratch director%s that dead processes left: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


@functools.cache
def host_id() -> str:
    """This boot of this host, and this PID namespace: 12 hex digits."""
    identity = _read("/proc/sys/kernel/random/boot_id") or os.uname().nodename
    with contextlib.suppress(OSError):  # no /proc: one namespace as far as we can tell
        identity += f"/{os.stat('/proc/self/ns/pid').st_ino}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _prefix(kind: str) -> str:
    return f"tfelastic-{kind}-"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def _ours(path: str) -> bool:
    try:
        status = os.lstat(path)
    except FileNotFoundError:  # its own process's exit, or another new one's sweep, came first
        return False
    return stat.S_ISDIR(status.st_mode) and status.st_uid == os.geteuid()


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts); a number no process can have counts too, so
    that a name made up to look like an orphan's is left alone."""
    if not 0 < pid < 2**22:  # the kernel's PID_MAX_LIMIT
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
