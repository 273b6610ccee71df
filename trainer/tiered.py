"""The fast checkpoint tier: asynchronous snapshots to node-local memory, persisted to shared storage in the
background. The layout is :mod:`tfelastic.trainer.snapshots`.

:meth:`TieredCheckpoint.save` holds training up only while TensorFlow copies the variables to host memory
(``CheckpointOptions(experimental_enable_async_checkpoint=True)``; it also waits for the previous snapshot's
write, if that is still going). TensorFlow writes the files in its own thread; then a sealer thread of ours seals
the snapshot (manifest, flush, rename: :func:`~tfelastic.trainer.snapshots.seal`) in the local tier and prunes
the old ones, and on the chief a persister thread copies the newest sealed snapshot to the shared tier. Every
worker saves at the same step (saving may run collectives) and keeps its own local copy.

:meth:`TieredCheckpoint.restore` restores the step the coordinator chose (``TFELASTIC_RESTORE_STEP``: the newest
step every member of the generation can restore), from the local tier when this node has it, else from the
shared one. When the agents found no common step (or the store is outside the agent's backup directory, where
they do not look), every worker restores the newest snapshot of the shared tier, which all of them see (an
agreement check after the restore stops workers that did not); without an agent, the newest snapshot of either
tier that restores. A snapshot whose
manifest is complete but which does not restore (damaged storage) is set aside, so that the next round does not
choose it again.

Errors of the background write surface at the next save or at :meth:`TieredCheckpoint.flush`; a failed copy to
the shared tier is logged and retried with the next snapshot.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tfelastic.trainer import snapshots
from tfelastic.trainer.checkpoint import NoRestorableCheckpointError
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.tfkeras import ensure_legacy_keras

ensure_legacy_keras()
import tensorflow as tf  # noqa: E402

log = logging.getLogger(__name__)

LOCAL, SHARED, NONE = "local", "shared", "none"  # where a restore came from
# The coordinator's step is for the process's first restore: a second fit() in the same process continues from
# the snapshots the first one saved, as tf_keras's BackupAndRestore would.
_chosen_step_used = False


@dataclass
class TierRestore:
    step: int | None  # None: nothing restored, the state is as initialised
    tier: str  # LOCAL, SHARED or NONE
    path: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of snapshots that did not restore


class TieredCheckpoint:
    """Snapshots of ``checkpoint`` in the shared tier's store ``shared_store`` and in the local tier's store of
    the same name (see the module docstring)."""

    def __init__(self, checkpoint: Any, shared_store: str, *, is_chief: bool, env: TrainerEnvironment | None = None,
                 keep_local: int = 2, keep_shared: int = 3) -> None:
        if keep_local < 1 or keep_shared < 2:
            raise ValueError(f"keep_local={keep_local} must be at least 1 and keep_shared={keep_shared} at least 2 "
                             "(one to fall back to when the newest is damaged)")
        environment = env or TrainerEnvironment.from_env()
        self.checkpoint = checkpoint
        self.is_chief = is_chief
        self.shared_store = os.path.abspath(shared_store)
        name = os.path.basename(os.path.normpath(self.shared_store))
        self.local_store = (os.path.join(environment.local_checkpoint_dir, name)
                            if environment.local_checkpoint_dir else None)
        self._managed = environment.managed
        self._wanted = environment.restore_step
        self._keep_local, self._keep_shared = keep_local, keep_shared
        self._options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
        self._scratch: str | None = None  # a non-chief without a local tier writes here, and keeps nothing
        self._sealing: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self._persisting = threading.Condition()
        self._to_persist: int | None = None  # the newest sealed step the persister has not copied yet
        self._busy_persisting = False
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self.sealed_step: int | None = None  # the newest snapshot complete in this worker's write tier
        self.persisted_step: int | None = None  # the newest the chief copied to the shared tier
        self.last_stall = 0.0
        self.last_write_seconds: float | None = None  # save() to sealed (and persisted, on the chief): the latest
        self._save_began: dict[int, float] = {}

    @property
    def write_store(self) -> str:
        """Where this worker's snapshots go: the local tier; without one, the shared tier on the chief and a
        scratch directory elsewhere (the save must still run on every worker: it may run collectives)."""
        if self.local_store:
            return self.local_store
        if self.is_chief:
            return self.shared_store
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="tfelastic-scratch-")
        return self._scratch

    def save(self, step: int) -> float:
        """Starts a snapshot of ``step``; returns how long training was held up (seconds)."""
        self._raise_background_error()
        self._start_threads()
        store = self.write_store
        os.makedirs(store, exist_ok=True)
        building = snapshots.temporary_dir(store, step)
        os.makedirs(building)
        began = time.monotonic()
        self._save_began[step] = began
        self.checkpoint.write(snapshots.checkpoint_prefix(building), options=self._options)
        self.last_stall = time.monotonic() - began
        self._sealing.put((step, building))
        return self.last_stall

    def flush(self) -> None:
        """Waits until every snapshot started is sealed and, on the chief, the newest is in the shared tier."""
        self.checkpoint.sync()
        self._sealing.join()
        with self._persisting:
            self._persisting.wait_for(lambda: self._to_persist is None and not self._busy_persisting)
        self._raise_background_error()

    def close(self) -> None:
        """Flushes, then stops the background threads."""
        try:
            self.flush()
        finally:
            self._sealing.put(None)
            with self._persisting:
                self._to_persist = -1
                self._persisting.notify_all()
            for thread in self._threads:
                thread.join()
            self._threads = []
            if self._scratch:
                shutil.rmtree(self._scratch, ignore_errors=True)

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
            return self._restore_chosen(self._wanted)
        return self._restore_newest(shared_only=self._managed and first)

    def candidates(self, step: int | None = None) -> list[tuple[str, str]]:
        """(tier, snapshot) pairs to try, newest step first, the local tier before the shared one."""
        found: list[tuple[int, int, str, str]] = []
        for order, (tier, store) in enumerate(((LOCAL, self.local_store), (SHARED, self.shared_store))):
            if store:
                found += [(s, -order, tier, snapshots.snapshot_dir(store, s)) for s in snapshots.complete_steps(store)
                          if step is None or s == step]
        return [(tier, path) for _, _, tier, path in sorted(found, reverse=True)]

    def _restore_chosen(self, step: int) -> TierRestore:
        result = TierRestore(None, NONE)
        for tier, path in self.candidates(step):
            if self._try_restore(path, result):
                return TierRestore(step, tier, path, result.skipped)
        why = "; ".join(f"{p}: {r}" for p, r in result.skipped) or "this worker has no complete snapshot of it"
        raise NoRestorableCheckpointError(
            f"snapshot step {step}, which the coordinator chose, does not restore here ({why}). A damaged snapshot "
            "is set aside, so the next generation chooses an older step")

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
                return TierRestore(step, tier, path, result.skipped)
        if result.skipped:
            raise NoRestorableCheckpointError(
                "no snapshot restores: " + "; ".join(f"{p}: {r}" for p, r in result.skipped)
                + ". Fix the storage, or move the directories away to start from scratch")
        return result

    def _try_restore(self, path: str, result: TierRestore) -> bool:
        try:
            self.checkpoint.restore(snapshots.checkpoint_prefix(path)).expect_partial()
            return True
        except Exception as e:  # a damaged file surfaces as OpError, ValueError or IndexError
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("snapshot %s does not restore (%s); setting it aside", path, reason)
            result.skipped.append((path, reason))
            _set_aside(path)
            return False

    def _start_threads(self) -> None:
        if self._threads:
            return
        self._threads = [threading.Thread(target=self._seal_loop, name="tfelastic-seal", daemon=True)]
        if self._persister():
            self._threads.append(threading.Thread(target=self._persist_loop, name="tfelastic-persist", daemon=True))
        for thread in self._threads:
            thread.start()

    def _seal_loop(self) -> None:
        while (job := self._sealing.get()) is not None:
            step, building = job
            try:
                self.checkpoint.sync()  # TensorFlow's writer thread has finished this snapshot's files
                self._seal(step, building)
            except BaseException as e:
                self._error = e
                shutil.rmtree(building, ignore_errors=True)
            finally:
                self._sealing.task_done()
        self._sealing.task_done()

    def _seal(self, step: int, building: str) -> None:
        store = self.write_store
        if store == self._scratch:
            shutil.rmtree(building, ignore_errors=True)
            return
        snapshots.seal(building, store, step)
        snapshots.prune(store, self._keep_local if store == self.local_store else self._keep_shared)
        self.sealed_step = step
        if store == self.shared_store:
            self.persisted_step = step
        if not self._persister():
            self._written(step)
        else:
            with self._persisting:
                self._to_persist = step
                self._persisting.notify_all()

    def _persist_loop(self) -> None:
        while True:
            with self._persisting:
                self._persisting.wait_for(lambda: self._to_persist is not None)
                step, self._to_persist = self._to_persist, None
                self._busy_persisting = step != -1
            if step == -1:
                return
            try:
                assert step is not None and self.local_store is not None
                self._persist(step, self.local_store)
            finally:
                with self._persisting:
                    self._busy_persisting = False
                    self._persisting.notify_all()

    def _persist(self, step: int, local_store: str) -> None:
        source = snapshots.snapshot_dir(local_store, step)
        try:
            snapshots.copy_snapshot(source, self.shared_store)
            snapshots.prune(self.shared_store, self._keep_shared)
            self.persisted_step = step
            self._written(step)
        except (OSError, snapshots.SnapshotError) as e:
            if os.path.isdir(source):  # not merely pruned by a newer snapshot meanwhile
                log.warning("could not copy snapshot %s to the shared tier %s (%s); the next snapshot tries "
                            "again", source, self.shared_store, e)

    def _persister(self) -> bool:
        """Whether this worker copies its snapshots to the shared tier (the chief, when it has a local tier)."""
        return self.is_chief and self.local_store is not None

    def _written(self, step: int) -> None:
        began = self._save_began.pop(step, None)
        for older in [s for s in self._save_began if s < step]:  # skipped by the persister: a newer one is done
            del self._save_began[older]
        if began is not None:
            self.last_write_seconds = time.monotonic() - began

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"a snapshot could not be written to {self.write_store}: {error}") from error


def _set_aside(snapshot: str) -> None:
    """Renames a damaged snapshot to a temporary name, which no scan counts and the next prune removes."""
    store = os.path.dirname(os.path.normpath(snapshot))
    step = snapshots.snapshot_step(snapshot)
    try:
        os.rename(snapshot, snapshots.temporary_dir(store, step if step is not None else 0))
    except OSError as e:
        log.warning("could not set aside %s (%s)", snapshot, e)
