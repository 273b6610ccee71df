"""The on-disk layout of the fast checkpoint tier: pure file operations, no TensorFlow, so that the agent can read
it too.

A *store* is a directory of snapshots, one per step: ``STORE/step-000000000120/``, holding TensorFlow's
checkpoint files (``ckpt.index``, ``ckpt.data-*``) or a flash snapshot's (:mod:`tfelastic.trainer.flash`), and
``MANIFEST.json`` (the step and every file's size). The node-local tier's stores are under
``LOCAL_ROOT/JOB/NODE/`` (:func:`local_store_root`; the default root is one per user, :data:`LOCAL_ROOT_DEFAULT`),
the shared tier's under the backup directory.

Invariants: a snapshot is complete when its directory has that name and its manifest agrees with the files on
disk; it is built under a temporary name and renamed into place once its files are flushed, so a kill at any
moment leaves either a complete snapshot or one that :func:`complete_steps` ignores. Every level of the local
tier, root to node, is a directory (not a link) of this user's own with mode 0700 (:func:`make_private_dirs`), and
its snapshot files are 0600: the weights are for this user only, and no other user can swap a directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import re
import shutil
import stat
import uuid
from collections.abc import Iterable


def default_local_root(shm: str = "/dev/shm") -> str:
    """The local tier's default root: one per user (``/dev/shm/tfelastic-UID``), so that a root another user
    made first never stands in the way (every level must be this user's own: :func:`make_private_dirs`)."""
    return os.path.join(shm, f"tfelastic-{os.geteuid()}")


LOCAL_ROOT_DEFAULT = default_local_root()
MANIFEST = "MANIFEST.json"
CHECKPOINT_PREFIX = "ckpt"  # TensorFlow's files inside a snapshot: ckpt.index, ckpt.data-00000-of-00001
FLASH_DATA, FLASH_LAYOUT = "flash.bin", "flash.json"  # or a flash snapshot's (tfelastic.trainer.flash)
_SNAPSHOT = re.compile(r"^step-(\d{12})$")
_TEMPORARY = ".partial-"
# In a snapshot the survivors of a peer's failure wrote (the state they held): which worker wrote it, and why.
SURVIVORS_MARK = "SURVIVORS.json"
DAMAGED_PREFIX = "damaged-"  # a snapshot that did not restore, kept for an operator; no scan counts it
MAX_REPORTED = 16  # the newest steps an agent reports per tier: enough to find a common one


class SnapshotError(RuntimeError):
    """A snapshot could not be written or copied; the message names the path."""


class NothingWritten(SnapshotError):
    """The checkpoint's writer left no index: its write failed (TensorFlow raises why at its next write)."""


class UnsafeTierError(SnapshotError):
    """A level of the local tier is not this user's own directory: another user could read or swap the
    snapshots. The message names the level and its owner."""


def local_store_root(root: str, job: str, node_id: str) -> str:
    """This node's local tier of ``job``: one directory per node, so that agents sharing a host keep apart."""
    return os.path.join(root, _safe(job), _safe(node_id))


def snapshot_name(step: int) -> str:
    return f"step-{step:012d}"


def snapshot_dir(store: str, step: int) -> str:
    return os.path.join(store, snapshot_name(step))


def checkpoint_prefix(snapshot: str) -> str:
    """The prefix TensorFlow reads and writes inside a snapshot directory."""
    return os.path.join(snapshot, CHECKPOINT_PREFIX)


def temporary_dir(store: str, step: int) -> str:
    """Where a snapshot of ``step`` is built before it is renamed into place (unique: two writers never meet)."""
    return os.path.join(store, f"{_TEMPORARY}{snapshot_name(step)}-{uuid.uuid4().hex[:8]}")


def seal(building: str, store: str, step: int, private: bool = False, replace: bool = True) -> str:
    """Writes the manifest of the files in ``building``, flushes them (``private``: the local tier's, made mode
    0600 and the directory 0700 first), and renames the directory to the step's snapshot. Returns the snapshot's
    path. An older snapshot of the same step is replaced; with ``replace=False`` (two writers of the same state)
    it is kept, and ``building`` is removed."""
    files = {name: os.path.getsize(os.path.join(building, name)) for name in sorted(os.listdir(building))
             if name != MANIFEST}
    if not any(name.endswith(".index") or name == FLASH_LAYOUT for name in files):
        raise NothingWritten(f"{building} holds neither a checkpoint index nor a flash layout: nothing to seal for "
                             f"step {step}")
    manifest = os.path.join(building, MANIFEST)
    with open(manifest, "w", encoding="utf-8") as out:
        json.dump({"step": step, "files": files}, out)
    if private:
        os.chmod(building, 0o700)
    for name in [*files, MANIFEST]:
        if private:
            os.chmod(os.path.join(building, name), 0o600)
        _fsync_file(os.path.join(building, name))
    final = snapshot_dir(store, step)
    if os.path.isdir(final):
        if not replace:
            shutil.rmtree(building, ignore_errors=True)
            return final
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(building, final)
    except OSError:  # another writer's rename came between (ENOTEMPTY, EEXIST): its copy of the state stays
        if replace or not os.path.isdir(final):
            raise
        shutil.rmtree(building, ignore_errors=True)
        return final
    _fsync_dir(store)
    return final


def retire_oldest(store: str, keep: int, protect: Iterable[int] = ()) -> str | None:
    """When ``store`` holds ``keep`` complete snapshots (and at least two), takes its oldest apart, so that a new
    flash snapshot can reuse its data file's memory: the snapshot is renamed to a temporary name (no longer
    complete, at once) and the path of its data file there is returned; the caller removes that directory. None
    when there is nothing to reuse."""
    steps = complete_steps(store)
    if len(steps) < max(keep, 2) or steps[-1] in set(protect):
        return None
    oldest = snapshot_dir(store, steps[-1])
    if not os.path.isfile(os.path.join(oldest, FLASH_DATA)):
        return None
    retired = temporary_dir(store, steps[-1])
    os.rename(oldest, retired)
    return os.path.join(retired, FLASH_DATA)


def copy_snapshot(snapshot: str, store: str) -> str:
    """Copies a complete snapshot into ``store`` (another tier) under a temporary name and renames it into place
    with a fresh manifest. Returns the copy's path."""
    step = snapshot_step(snapshot)
    if step is None or not is_complete(snapshot):
        raise SnapshotError(f"{snapshot} is not a complete snapshot; it cannot be copied")
    os.makedirs(store, exist_ok=True)
    building = temporary_dir(store, step)
    os.makedirs(building)
    try:
        for name in os.listdir(snapshot):
            if name != MANIFEST:
                shutil.copyfile(os.path.join(snapshot, name), os.path.join(building, name))
        return seal(building, store, step)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise


def is_survivors(snapshot: str) -> bool:
    """Whether the survivors of a peer's failure wrote ``snapshot`` (TieredCheckpoint.save_for_survivors)."""
    return os.path.exists(os.path.join(snapshot, SURVIVORS_MARK))


def snapshot_step(path: str) -> int | None:
    match = _SNAPSHOT.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def is_complete(snapshot: str) -> bool:
    """Whether the manifest names the snapshot's step and every file it lists has the recorded size."""
    return _check(snapshot) is True


def _check(snapshot: str) -> bool | None:
    """True: complete; False: incomplete (a file missing or of another size, a manifest missing or wrong);
    None: unknown (the storage failed to answer: a network file system's transient error)."""
    try:
        with open(os.path.join(snapshot, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest["step"] != snapshot_step(snapshot) or not isinstance(files, dict) or not files:
            return False
        return all(os.path.getsize(os.path.join(snapshot, name)) == size for name, size in files.items())
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False
    except OSError:
        return None


def snapshot_size(snapshot: str) -> int:
    """The bytes of a snapshot's files, from its manifest (0 when it cannot be read)."""
    try:
        with open(os.path.join(snapshot, MANIFEST), encoding="utf-8") as f:
            return sum(int(size) for size in json.load(f)["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def complete_steps(store: str) -> list[int]:
    """The steps of the complete snapshots in ``store``, newest first ([] when it does not exist)."""
    try:
        names = os.listdir(store)
    except OSError:
        return []
    steps = [snapshot_step(name) for name in names]
    return sorted((s for s in steps if s is not None and is_complete(snapshot_dir(store, s))), reverse=True)


def stores(tier_root: str) -> list[str]:
    """The stores directly under a tier's root (``fit``, ``loop``, ...)."""
    try:
        entries = sorted(os.scandir(tier_root), key=lambda e: e.name)
    except OSError:
        return []
    return [e.path for e in entries if e.is_dir(follow_symlinks=False)]


def restorable_steps(tier_roots: Iterable[str], limit: int = MAX_REPORTED) -> list[int]:
    """The newest ``limit`` steps of complete snapshots in any store under any of ``tier_roots``, newest first.
    A job keeps one store name per training run (``fit_callbacks`` and ``TrainLoop`` each have their own)."""
    found: set[int] = set()
    for root in tier_roots:
        for store in stores(root):
            found.update(complete_steps(store)[:limit])
    return sorted(found, reverse=True)[:limit]


def prune(store: str, keep: int, protect: Iterable[int] = ()) -> None:
    """Keeps the ``keep`` newest complete snapshots of ``store`` and those of ``protect`` (one being copied);
    removes older and incomplete ones. Not the temporary directories (one may be a snapshot being written: see
    :func:`remove_temporaries`), and nothing the storage failed to describe."""
    try:
        names = os.listdir(store)
    except OSError:
        return
    kept = set(complete_steps(store)[:keep]) | set(protect)
    for name in names:
        step = snapshot_step(name)
        if step is not None and step not in kept and _check(os.path.join(store, name)) is not None:
            shutil.rmtree(os.path.join(store, name), ignore_errors=True)


def remove_newer(store: str, step: int | None) -> list[int]:
    """Removes the snapshots of ``store`` newer than ``step`` (all, for None): after a restore of an older step
    they are another history, which a later restore must not pick up. Returns the steps removed."""
    try:
        names = os.listdir(store)
    except OSError:
        return []
    removed = []
    for name in names:
        found = snapshot_step(name)
        if found is not None and (step is None or found > step) and _check(os.path.join(store, name)) is not None:
            shutil.rmtree(os.path.join(store, name), ignore_errors=True)
            removed.append(found)
    return sorted(removed)


def set_aside(snapshot: str) -> str | None:
    """Renames a snapshot that did not restore to ``damaged-...`` in its store (no scan counts it; nothing
    removes it: it is there for an operator). Returns the new path, or None when the rename failed."""
    store = os.path.dirname(os.path.normpath(snapshot))
    target = os.path.join(store, f"{DAMAGED_PREFIX}{os.path.basename(os.path.normpath(snapshot))}-"
                                 f"{uuid.uuid4().hex[:8]}")
    try:
        os.rename(snapshot, target)
    except OSError:
        return None
    return target


def remove_temporaries(store: str) -> None:
    """Removes building directories a killed writer left behind, and snapshots set aside as damaged (the store's
    writer calls it before it writes, when no other writer can be active)."""
    try:
        names = os.listdir(store)
    except OSError:
        return
    for name in names:
        if name.startswith(_TEMPORARY):
            shutil.rmtree(os.path.join(store, name), ignore_errors=True)


def make_private_dirs(root: str, path: str) -> None:
    """Creates ``path`` and the levels from ``root`` down to it, mode 0700 (``root``'s parents as they come), or
    checks those that exist: each must be a directory, not a symbolic link, owned by this user; it is made mode
    0700. Raises :class:`UnsafeTierError` naming the first level that is not. Each level is opened without
    following a link and checked and changed through that descriptor: nothing can be swapped in between."""
    root, path = os.path.normpath(root), os.path.normpath(path)
    below = os.path.relpath(path, root)  # the levels under root: JOB/NODE, or none
    os.makedirs(os.path.dirname(root), exist_ok=True)
    level = root
    _private_dir(level)
    for part in [] if below == os.curdir else below.split(os.sep):
        level = os.path.join(level, part)
        _private_dir(level)


def _private_dir(path: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):  # which one: the kernel's choice
            raise UnsafeTierError(f"{path} is a symbolic link") from e
        raise  # not a directory, or not this user's to open: it cannot be written
    try:
        status = os.fstat(fd)
        if status.st_uid != os.geteuid():
            raise UnsafeTierError(f"{path} is owned by {_user(status.st_uid)}, not by this user "
                                  f"({_user(os.geteuid())})")
        if stat.S_IMODE(status.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _safe(part: str) -> str:
    """A job or node id as one path component."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", part)
    return cleaned if cleaned not in ("", ".", "..") else "_"


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not sync directories; the rename is still atomic
    finally:
        os.close(fd)
