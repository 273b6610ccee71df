"""The fast checkpoint tier's read side (:mod:`tfelastic.trainer.tiered` writes): which snapshot a worker
restores, from which tier, and what happens to the others.

:meth:`TierRestorer.restore` restores the coordinator's step (``TFELASTIC_RESTORE_STEP``) from the local tier
when this node has it, else from the shared one; a survivors' snapshot (:mod:`~tfelastic.trainer.survivors`) newer
than that step in the shared tier comes first (a store the agents do not scan). Without a common step (or for a
store the agents do not scan) every worker restores the newest shared snapshot; without an agent, the newest of
either tier that restores.

Invariants: a snapshot whose data does not read back (damaged storage) is set aside as ``damaged-...`` and the
next copy is tried in the same restore; any other restore error (a model that no longer matches) is raised as it
is; after a restore, this worker's snapshots newer than the step restored are removed (an abandoned history).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tfelastic.trainer import flash, snapshots
from tfelastic.trainer._tf import tf
from tfelastic.trainer.checkpoint import NoRestorableCheckpointError

log = logging.getLogger(__name__)

# Where a restore came from: the survivors of a peer's failure (their snapshot, in the shared tier), this node's
# memory, the shared tier's periodic copies, nothing.
SURVIVORS, LOCAL, SHARED, NONE = "survivors", "local", "shared", "none"
# What a damaged snapshot raises when it is read: a checksum that does not match, a short read.
_DAMAGED_DATA = (tf.errors.DataLossError, tf.errors.OutOfRangeError, IndexError, flash.FlashDamagedError)
# The coordinator's step is for the process's first restore: a second fit() in the same process continues from
# the snapshots the first one saved, as tf_keras's BackupAndRestore would.
_chosen_step_used = False


@dataclass
class TierRestore:
    step: int | None  # None: nothing restored, the state is as initialised
    tier: str  # LOCAL, SHARED or NONE
    path: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of snapshots that did not restore


class TierRestorer:
    """Restores ``checkpoint`` from ``local_store`` (None: no local tier) and ``shared_store``; ``write_store``:
    where this worker writes (a damaged snapshot there is its own to set aside); ``wanted``: the coordinator's
    step; ``managed``: an agent runs the worker."""

    def __init__(self, checkpoint: Any, local_store: str | None, shared_store: str, *, is_chief: bool,
                 write_store: str, managed: bool, wanted: int | None) -> None:
        self.checkpoint = checkpoint
        self.local_store, self.shared_store, self.write_store = local_store, shared_store, write_store
        self.is_chief = is_chief
        self._managed, self._wanted = managed, wanted

    def restore(self) -> TierRestore:
        """Restores the coordinator's step (see the module docstring). Raises
        :class:`~tfelastic.trainer.checkpoint.NoRestorableCheckpointError` when the chosen step, or every
        snapshot without an agent, fails to restore."""
        for store in (self.local_store, self.shared_store if self.is_chief else None):
            if store:
                snapshots.remove_temporaries(store)
        global _chosen_step_used
        first, _chosen_step_used = not _chosen_step_used, True
        if first and self._wanted is not None:
            result = self._restore_chosen(self._wanted)
        else:
            result = self._restore_newest(shared_only=self._managed and first)
        self._forget_newer(result.step)
        return result

    def candidates(self, step: int | None = None) -> list[tuple[str, str]]:
        """(tier, snapshot) pairs to try, newest step first, the local tier before the shared one."""
        found: list[tuple[int, int, str, str]] = []
        for order, (tier, store) in enumerate(((LOCAL, self.local_store), (SHARED, self.shared_store))):
            if store:
                found += [(s, -order, tier, snapshots.snapshot_dir(store, s)) for s in snapshots.complete_steps(store)
                          if step is None or s == step]
        return [(tier, path) for _, _, tier, path in sorted(found, reverse=True)]

    def _restore_chosen(self, step: int) -> TierRestore:
        survivors = self._restore_survivors_newer_than(step)
        if survivors is not None:
            return survivors
        candidates = self.candidates(step)
        if not candidates:  # the step is another store's (a job with two), or the scan was stale
            log.warning("the coordinator chose snapshot step %d, which %s does not hold: restoring its newest "
                        "shared snapshot instead", step, self.shared_store)
            return self._restore_newest(shared_only=True)
        result = TierRestore(None, NONE)
        for tier, path in candidates:
            if self._try_restore(path, result):
                return TierRestore(step, _source(tier, path), path, result.skipped)
        why = "; ".join(f"{p}: {r}" for p, r in result.skipped)
        raise NoRestorableCheckpointError(
            f"snapshot step {step}, which the coordinator chose, does not restore here ({why}). A damaged snapshot "
            "is set aside, so the next generation chooses an older step")

    def _restore_survivors_newer_than(self, step: int) -> TierRestore | None:
        """The survivors' snapshot of a peer's failure in the shared tier, when it is newer than the coordinator's
        step: a store the agents do not scan (a backup dir of the trainer's own) was not counted in that choice,
        and every worker sees the same shared tier. None when there is none, or none restores."""
        result = TierRestore(None, NONE)
        for newer in snapshots.complete_steps(self.shared_store):
            path = snapshots.snapshot_dir(self.shared_store, newer)
            if newer <= step or not snapshots.is_survivors(path):
                continue
            log.info("the shared tier %s holds the survivors' step %d, newer than step %d, which the coordinator "
                     "chose without it: restoring it", self.shared_store, newer, step)
            if self._try_restore(path, result):
                return TierRestore(newer, SURVIVORS, path, result.skipped)
        return None

    def _restore_newest(self, shared_only: bool) -> TierRestore:
        result = TierRestore(None, NONE)
        candidates = self.candidates()
        if shared_only and any(tier == LOCAL for tier, _ in candidates):
            log.warning("the agents found no snapshot step that every member can restore; this worker's local "
                        "snapshots are not used (the workers restore the newest one in %s)", self.shared_store)
        for tier, path in candidates:
            if shared_only and tier == LOCAL:
                continue
            if self._try_restore(path, result):
                step = snapshots.snapshot_step(path)
                return TierRestore(step, _source(tier, path), path, result.skipped)
        if result.skipped:
            raise NoRestorableCheckpointError(
                "no snapshot restores: " + "; ".join(f"{p}: {r}" for p, r in result.skipped)
                + ". Fix the storage, or move the directories away to start from scratch")
        return result

    def _try_restore(self, path: str, result: TierRestore) -> bool:
        """Restores ``path``; False when its data is damaged (it is set aside); any other error is raised."""
        try:
            if flash.is_flash(path):
                flash.restore(self.checkpoint, path)
            else:
                self.checkpoint.restore(snapshots.checkpoint_prefix(path)).expect_partial()
            return True
        except Exception as e:
            if not isinstance(e, _DAMAGED_DATA) and snapshots.is_complete(path):
                raise  # not the storage: a model that no longer matches the snapshot, an out-of-memory error
            if not flash.is_flash(path):
                _drop_pending_restores(self.checkpoint, snapshots.checkpoint_prefix(path))
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            result.skipped.append((path, reason))
            mine = path.startswith(self.write_store + os.sep) or self.is_chief
            moved = snapshots.set_aside(path) if mine else None
            log.warning("snapshot %s does not restore (%s)%s", path, reason,
                        f"; set aside as {moved}" if moved else "")
            return False

    def _forget_newer(self, restored: int | None) -> None:
        """Removes this worker's snapshots newer than the step restored (see the module docstring)."""
        # Nothing restored: the shared tier is left alone (a shared file system that failed to list it must not
        # cost the job its history); the local tier is this worker's own.
        stores = [self.local_store] + ([self.shared_store] if self.is_chief and restored is not None else [])
        for store in stores:
            if store is None:
                continue
            removed = snapshots.remove_newer(store, restored)
            if removed:
                log.info("removed snapshots newer than the step restored (%s) from %s: steps %s",
                         "none" if restored is None else restored, store, ", ".join(map(str, removed)))


def _source(tier: str, path: str) -> str:
    """Where a restore of ``path``, found in ``tier``, came from (the module's constants)."""
    return SURVIVORS if tier == SHARED and snapshots.is_survivors(path) else tier


def _drop_pending_restores(checkpoint: Any, prefix: str) -> None:
    """Drops what a failed ``checkpoint.restore(prefix)`` left pending. TensorFlow keeps, on the objects it restored
    into, a restore for each object of the snapshot that does not exist yet (the checkpoint's save counter, an
    optimizer's slots before its first step) and runs every one it kept when that object is created, the newest
    restore's first: it would read ``prefix`` after the snapshot was set aside. These are TensorFlow's private
    attributes; what this TensorFlow lacks is left alone."""
    def reads_prefix(position: Any) -> bool:
        return getattr(getattr(position, "checkpoint", None), "save_path_string", None) == prefix

    for trackable in tf.train.TrackableView(checkpoint).descendants():
        pending = getattr(trackable, "_deferred_dependencies", None)  # a child's name -> its positions
        if isinstance(pending, dict):
            for name in list(pending):
                pending[name] = [position for position in pending[name] if not reads_prefix(position)]
                if not pending[name]:
                    del pending[name]
