"""The fast checkpoint tier: snapshots to node-local memory, persisted to shared storage in the background. The
layout is :mod:`tfelastic.trainer.snapshots`.

The first snapshot of a process is TensorFlow's asynchronous checkpoint
(``CheckpointOptions(experimental_enable_async_checkpoint=True)``): :meth:`TieredCheckpoint.save` holds training
up while TensorFlow copies the variables, and TensorFlow writes the files in its own thread. When the checkpoint's
state is all plain variables (a model, its optimizer, counters), the next ones are *flash snapshots*
(:mod:`tfelastic.trainer.flash`): the variables' bytes written in the training thread into a file the oldest
local snapshot gave up, which costs a fraction of TensorFlow's write (no new memory) and needs no background
work. Either way a sealer thread of ours then seals the snapshot (manifest, flush, rename:
:func:`~tfelastic.trainer.snapshots.seal`) in the local tier and prunes the old ones, and on the chief a persister
thread copies the newest sealed snapshot to the shared tier, at most every ``persist_seconds`` (30 s; and always
the newest at :meth:`TieredCheckpoint.flush`). Every worker saves at the same step (TensorFlow's save may run
collectives) and keeps its own local copy. A ``portable`` save is TensorFlow's format whatever the state (the
custom loop's final save, whose path it hands to the user).

:meth:`TieredCheckpoint.restore` restores the step the coordinator chose (``TFELASTIC_RESTORE_STEP``: the newest
step every member of the generation can restore), from the local tier when this node has it, else from the
shared one. When the agents found no common step (or the store is outside the agent's backup directory, where
they do not look), every worker restores the newest snapshot of the shared tier, which all of them see (an
agreement check after the restore stops workers that did not); without an agent, the newest snapshot of either
tier that restores. A snapshot whose
manifest is complete but whose data does not read back (TensorFlow's checksums: damaged storage) is set aside as
``damaged-...``, so that the next round does not choose it again; any other restore error (a model that no
longer matches the snapshot) is raised as it is. After a restore, this worker's snapshots newer than the step
restored are removed: they belong to an abandoned history, which a later restore must not pick up.

The local tier is bounded: before a snapshot, the room it needs (the newest snapshot's size, with headroom) is
made by removing all but the newest local snapshot; when even that is not enough, or a write runs out of space,
this worker's snapshots go to the shared tier from then on (the chief's; the others keep none), with a warning.

Errors of the background write surface at the next save or at :meth:`TieredCheckpoint.flush`; a failed copy to
the shared tier is logged and retried with the next snapshot, and :meth:`TieredCheckpoint.flush` (a graceful
stop, the end of training) tries the newest once more itself and raises if it still fails.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tfelastic.trainer import flash, snapshots
from tfelastic.trainer.checkpoint import NoRestorableCheckpointError
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.persister import Persister
from tfelastic.trainer.tfkeras import ensure_legacy_keras

ensure_legacy_keras()
import tensorflow as tf  # noqa: E402

log = logging.getLogger(__name__)

LOCAL, SHARED, NONE = "local", "shared", "none"  # where a restore came from
# What a damaged snapshot raises when it is read: a checksum that does not match, a short read.
_DAMAGED_DATA = (tf.errors.DataLossError, tf.errors.OutOfRangeError, IndexError, flash.FlashDamagedError)
# The chief copies a snapshot to the shared tier at most this often: the copy competes with training where the
# CPUs train, and the local tier covers a worker's crash; the shared tier is for a lost node.
PERSIST_SECONDS = 30.0
# The room a local snapshot needs, as a multiple of the newest one's size: TensorFlow's temporary files, a model
# that grew a little. The first snapshot's size is not known: its write shows whether it fits.
LOCAL_HEADROOM = 1.1
_SPARE = "spare-flash.bin"  # a scratch directory's data file, for the next flash snapshot there
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
                 keep_local: int = 2, keep_shared: int = 3, persist_seconds: float = PERSIST_SECONDS) -> None:
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
        self._local_full = False  # the local tier has no room for a snapshot: write as without one
        self._sealing: queue.Queue[tuple[int, str, str] | None] = queue.Queue()
        # The chief copies its local snapshots to the shared tier (without a local tier, it writes there).
        self._persister = Persister(self.local_store, self.shared_store, keep_shared, persist_seconds) \
            if is_chief and self.local_store else None
        self._error: BaseException | None = None
        self._sealer: threading.Thread | None = None
        self.sealed_step: int | None = None  # the newest snapshot complete in this worker's write tier
        self._sealed_in_shared: int | None = None
        self.last_stall = 0.0
        self.last_write_seconds: float | None = None  # save() to sealed: the latest
        self._save_began: dict[int, float] = {}
        self._last_started: int | None = None
        self._written_step: int | None = None  # the newest snapshot whose background work is over
        self._flash: flash.FlashWriter | None = None  # decided at the second save, from the first (TensorFlow's)
        self._reference: str | None = None  # the first snapshot TensorFlow wrote, until the decision
        self._writer_chosen = False
        self._last_flash = False  # the last snapshot started was a flash snapshot

    @property
    def write_store(self) -> str:
        """Where this worker's snapshots go: the local tier; without one, the shared tier on the chief and a
        scratch directory elsewhere (the save must still run on every worker: it may run collectives)."""
        if self.local_store and not self._local_full:
            return self.local_store
        if self.is_chief:
            return self.shared_store
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="tfelastic-scratch-")
        return self._scratch

    def save(self, step: int, portable: bool = False) -> float:
        """Starts a snapshot of ``step``; returns how long training was held up (seconds). A second save of the
        same step (a graceful stop right after a periodic save) does nothing, unless it asks for a ``portable``
        snapshot (TensorFlow's format, for any TensorFlow tool) where the first was a flash snapshot."""
        began = time.monotonic()
        # TensorFlow's write waits for the previous one anyway; the seal after it is short. Then the previous
        # write's error is the sealer's to see (TensorFlow hands it to the first caller), and its size is known.
        self._sealing.join()
        self._raise_background_error()
        if step == self._last_started and not (portable and self._last_flash):
            return 0.0
        self._last_started = step
        self._start_sealer()
        os.makedirs(self.write_store, exist_ok=True)
        if self.write_store == self.local_store:
            self._make_room(self.local_store)
        if self._reference is not None:
            self._choose_writer(self._reference)
        store, building = self._building(step)
        self._save_began[step] = began
        try:
            self._write(store, building, portable)
        except Exception as e:  # TensorFlow raises the previous write's error here, before this write
            shutil.rmtree(building, ignore_errors=True)
            if store != self.local_store or not _out_of_space(e):
                raise
            self._leave_local_tier(f"writing a snapshot ran out of space: {_last_line(e)}")
            store, building = self._building(step)
            self._write(store, building, portable)
        self._last_flash = self._flash is not None and not portable
        self.last_stall = time.monotonic() - began
        self._sealing.put((step, building, store))
        return self.last_stall

    def _write(self, store: str, building: str, portable: bool) -> None:
        """A flash snapshot, synchronously; else TensorFlow's asynchronous write, which TensorFlow finishes in its
        own thread. A worker that keeps no snapshot writes one too: reading a sync-on-read variable is an
        all-reduce, which every worker must join."""
        if self._flash is None or portable:
            self.checkpoint.write(snapshots.checkpoint_prefix(building), options=self._options)
            return
        recycled = self._reusable(store)
        try:
            self._flash.write(building, recycled, in_memory=store in (self.local_store, self._scratch))
        finally:
            if recycled and store == self.local_store:
                shutil.rmtree(os.path.dirname(recycled), ignore_errors=True)

    def _reusable(self, store: str) -> str | None:
        """A data file whose memory the next flash snapshot in ``store`` can take over: the local tier's oldest
        snapshot's, or the scratch directory's spare."""
        if store == self.local_store:
            return snapshots.retire_oldest(store, self._keep_local, protect=self._protected())
        spare = os.path.join(store, _SPARE)
        return spare if store == self._scratch and os.path.exists(spare) else None

    def _choose_writer(self, reference: str) -> None:
        """Flash snapshots from now on, when the checkpoint's state allows (see :mod:`tfelastic.trainer.flash`)."""
        self._reference, self._writer_chosen = None, True
        try:
            self._flash = flash.FlashWriter.from_tensorflow_snapshot(self.checkpoint, reference)
        finally:
            if self._scratch and reference.startswith(self._scratch + os.sep):
                shutil.rmtree(reference, ignore_errors=True)

    def _protected(self) -> tuple[int, ...]:
        """The step the persister copies: the local tier keeps it until then."""
        copying = self._persister.copying if self._persister else None
        return () if copying is None else (copying,)

    def _building(self, step: int) -> tuple[str, str]:
        """The write store now, and a new temporary directory in it for ``step``."""
        store = self.write_store
        os.makedirs(store, exist_ok=True)
        building = snapshots.temporary_dir(store, step)
        os.makedirs(building)
        return store, building

    def _make_room(self, store: str) -> None:
        """Makes room in the local tier for one more snapshot, removing all but its newest one if need be; without
        room, this worker stops using it (see the module docstring)."""
        newest = snapshots.complete_steps(store)
        need = LOCAL_HEADROOM * snapshots.snapshot_size(snapshots.snapshot_dir(store, newest[0])) if newest else 0
        if shutil.disk_usage(store).free >= need:
            return
        if self._flash:
            self._flash.release()  # the mapped files' memory, for the files the prune removes
        snapshots.prune(store, 1, protect=self._protected())
        free = shutil.disk_usage(store).free
        if free < need and self._protected() and self._persister:  # the copy to the shared tier holds one
            self._persister.wait_idle()
            snapshots.prune(store, 1)
            free = shutil.disk_usage(store).free
        if free >= need:
            return
        self._leave_local_tier(f"{free / 2**20:.0f} MiB free, less than the {need / 2**20:.0f} MiB a snapshot needs")

    def _leave_local_tier(self, why: str) -> None:
        if self._local_full:
            return
        self._local_full = True
        log.warning("the local checkpoint tier %s has no room for a snapshot (%s): %s", self.local_store, why,
                    f"snapshots go to the shared tier {self.shared_store} from now on" if self.is_chief else
                    "this worker keeps no snapshot from now on (the chief's go to the shared tier)")

    def wait_sealed(self) -> None:
        """Waits until every snapshot started is sealed (the next save does anyway, first)."""
        self._sealing.join()

    def flush(self) -> None:
        """Waits until every snapshot started is sealed and, on the chief, the newest is in the shared tier."""
        self.checkpoint.sync()
        self._sealing.join()
        if self._persister:
            self._persister.wait_idle()
        self._raise_background_error()
        sealed = self.sealed_step
        if self._last_started is not None and sealed != self._last_started and self.write_store != self._scratch:
            raise RuntimeError(f"snapshot step {self._last_started} was not written to {self.write_store} (see "
                               "TensorFlow's error above): the state at this stop is not saved")
        # The newest was not copied (throttled, or the copy failed): now.
        if self._persister and sealed is not None and self.persisted_step != sealed and \
                not self._persister.copy_now(sealed):
            raise RuntimeError(f"snapshot step {sealed} could not be copied to the shared tier "
                               f"{self.shared_store} (see the warning above); it exists on this node only")

    def close(self) -> None:
        """Flushes, then stops the background threads."""
        try:
            self.flush()
        finally:
            self._sealing.put(None)
            if self._persister:
                self._persister.stop()
            if self._sealer:
                self._sealer.join()
                self._sealer = None
            if self._flash:
                self._flash.release()
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
        candidates = self.candidates(step)
        if not candidates:  # the step is another store's (a job with two), or the scan was stale
            log.warning("the coordinator chose snapshot step %d, which %s does not hold: restoring its newest "
                        "shared snapshot instead", step, self.shared_store)
            return self._restore_newest(shared_only=True)
        result = TierRestore(None, NONE)
        for tier, path in candidates:
            if self._try_restore(path, result):
                return TierRestore(step, tier, path, result.skipped)
        why = "; ".join(f"{p}: {r}" for p, r in result.skipped)
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

    def _start_sealer(self) -> None:
        if self._sealer is None:
            self._sealer = threading.Thread(target=self._seal_loop, name="tfelastic-seal", daemon=True)
            self._sealer.start()

    def _seal_loop(self) -> None:
        while (job := self._sealing.get()) is not None:
            step, building, store = job
            try:
                self.checkpoint.sync()  # TensorFlow's writer thread has finished this snapshot's files
                self._seal(step, building, store)
            except BaseException as e:
                shutil.rmtree(building, ignore_errors=True)
                if store == self.local_store and _out_of_space(e):
                    self._leave_local_tier(f"sealing step {step} ran out of space")  # this snapshot is lost
                    self._written(step)
                elif isinstance(e, snapshots.NothingWritten):  # the next save() or flush() deals with it
                    log.warning("snapshot step %d was not written to %s (TensorFlow's error follows at the next "
                                "save)", step, store)
                    self._written(step)
                else:
                    self._error = e
            finally:
                self._sealing.task_done()
        self._sealing.task_done()

    def _seal(self, step: int, building: str, store: str) -> None:
        first = not self._writer_chosen and self._reference is None
        if store == self._scratch:
            if first and os.path.exists(snapshots.checkpoint_prefix(building) + ".index"):
                self._reference = building  # read at the next save, then removed
            else:
                if os.path.exists(flash.data_file(building)):
                    os.replace(flash.data_file(building), os.path.join(store, _SPARE))
                shutil.rmtree(building, ignore_errors=True)
            self._written(step)
            return
        sealed = snapshots.seal(building, store, step)
        if first and not flash.is_flash(sealed):
            self._reference = sealed
        snapshots.prune(store, self._keep_local if store == self.local_store else self._keep_shared,
                        protect=self._protected())
        self.sealed_step = step
        if store == self.shared_store:
            self._sealed_in_shared = step
        elif self._persister:
            self._persister.offer(step)  # unless throttled: the shared tier gets a newer one later, or at flush()
        self._written(step)

    @property
    def persisted_step(self) -> int | None:
        """The newest snapshot this worker put in the shared tier (the chief's copy, or its own write there)."""
        copied = self._persister.persisted_step if self._persister else None
        steps = [s for s in (copied, self._sealed_in_shared) if s is not None]
        return max(steps) if steps else None

    @property
    def writing(self) -> bool:
        """Whether a snapshot is being written in the background (the copy to the shared tier aside: it comes
        at most every ``persist_seconds`` whatever the interval between snapshots)."""
        return self._last_started is not None and self._written_step != self._last_started

    def _written(self, step: int) -> None:
        self._written_step = step
        began = self._save_began.pop(step, None)
        for older in [s for s in self._save_began if s < step]:  # skipped by the persister: a newer one is done
            del self._save_began[older]
        if began is not None:
            self.last_write_seconds = time.monotonic() - began

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"a snapshot could not be written to {self.write_store}: {error}") from error


def _last_line(error: BaseException) -> str:
    """The line of a TensorFlow error that says what failed (its first lines are the op's context)."""
    return str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__


def _out_of_space(error: BaseException) -> bool:
    """Whether a write failed for want of space (an OSError, or TensorFlow's error that carries its message)."""
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or \
        "No space left on device" in str(error) or "ENOSPC" in str(error)
