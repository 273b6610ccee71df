"""The fast checkpoint tier: snapshots of a checkpoint in node-local memory, copied to shared storage in the
background. The layout is :mod:`~tfelastic.trainer.snapshots`, one snapshot's write
:mod:`~tfelastic.trainer.tier_writer`, the restore :mod:`~tfelastic.trainer.tier_restore`.

Each save picks its :class:`Tier` once: the local tier; without one (or once it is full), the shared tier on the
chief and a scratch directory on the other workers, which keep nothing but must still write (a save may run
collectives). The training thread writes, the :class:`~tfelastic.trainer.sealer.Sealer` seals and prunes, and on
the chief the :class:`~tfelastic.trainer.persister.Persister` copies the newest sealed snapshot to the shared tier
at most every ``persist_seconds`` (or as :meth:`TieredCheckpoint.pace_copies` says); :meth:`TieredCheckpoint.flush`
copies the newest itself.

Invariants: every worker saves at the same step; the local tier keeps a snapshot until the persister has copied
it; a worker whose local tier has no room (before a write, or a write ran out of space) leaves it for good, with a
warning; an error of the background work is raised at the next save or at :meth:`TieredCheckpoint.flush`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from tfelastic.trainer import flash, snapshots
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.persister import Persister
from tfelastic.trainer.save_schedule import MIN_COPY_SECONDS
from tfelastic.trainer.scratch import process_temp_dir
from tfelastic.trainer.sealer import Sealer
from tfelastic.trainer.tier_restore import LOCAL, SHARED, TierRestore, TierRestorer
from tfelastic.trainer.tier_writer import SnapshotWriter

log = logging.getLogger(__name__)

# The chief copies a snapshot to the shared tier at most this often: the copy competes with training where the
# CPUs train, and the local tier covers a worker's crash; the shared tier is for a lost node.
PERSIST_SECONDS = MIN_COPY_SECONDS
# The room a local snapshot needs, as a multiple of the newest one's size: TensorFlow's temporary files, a model
# that grew a little. The first snapshot's size is not known: its write shows whether it fits.
LOCAL_HEADROOM = 1.1
SCRATCH = "scratch"  # a worker without a tier of its own: it writes each snapshot, and keeps none
_SPARE = "spare-flash.bin"  # a scratch directory's data file, for the next flash snapshot there
_CAUSE_CHARS = 500  # of the error a survivor saw, in its snapshot's mark


@dataclass(frozen=True)
class Tier:
    """Where one save writes: ``kind`` LOCAL, SHARED or SCRATCH, the ``store`` directory, and how many snapshots
    it ``keep``s there (0 for scratch)."""
    kind: str
    store: str
    keep: int


@dataclass(frozen=True)
class _SealJob:
    step: int
    building: str  # the snapshot's temporary directory
    tier: Tier


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
        node_dir = _private_or_none(environment.local_checkpoint_dir)
        self.local_store = os.path.join(node_dir, name) if node_dir else None
        self._managed = environment.managed
        self._wanted = environment.restore_step
        self._keep_local, self._keep_shared = keep_local, keep_shared
        self._writer = SnapshotWriter(checkpoint, mapped_files=keep_local)
        self._scratch: str | None = None  # the SCRATCH tier's directory, made when first needed
        self._local_full = False  # the local tier has no room for a snapshot: write as without one
        self._sealer: Sealer[_SealJob] = Sealer(self._seal_job)
        # The chief copies its local snapshots to the shared tier (without a local tier, it writes there).
        self._persister = Persister(self.local_store, self.shared_store, keep_shared, persist_seconds) \
            if is_chief and self.local_store else None
        self.persist_seconds = persist_seconds  # the fewest seconds between two copies, whatever pace_copies says
        self._copies_seen = 0  # the persister's count of copies begun, at the last copy_beside_step()
        self.sealed_step: int | None = None  # the newest snapshot complete in this worker's write tier
        self._sealed_in_shared: int | None = None
        self.last_write_seconds: float | None = None  # save() to sealed: the latest
        self._save_began: dict[int, float] = {}
        self._last_started: int | None = None
        self._written_step: int | None = None  # the newest snapshot whose background work is over

    def _tier(self) -> Tier:
        """Where the next snapshot goes (see the module docstring)."""
        if self.local_store and not self._local_full:
            return Tier(LOCAL, self.local_store, self._keep_local)
        if self.is_chief:
            return Tier(SHARED, self.shared_store, self._keep_shared)
        if self._scratch is None:
            self._scratch = process_temp_dir("scratch")  # close() may not come (an exception, a stop, a kill)
        return Tier(SCRATCH, self._scratch, 0)

    @property
    def write_store(self) -> str:
        """The directory this worker's next snapshot goes to."""
        return self._tier().store

    def save(self, step: int, portable: bool = False) -> float:
        """Starts a snapshot of ``step``; returns how long training was held up (seconds). A second save of the
        same step (a graceful stop right after a periodic save) does nothing, unless it asks for a ``portable``
        snapshot (TensorFlow's format, for any TensorFlow tool) where the first was a flash snapshot."""
        began = time.monotonic()
        # TensorFlow's write waits for the previous one anyway; the seal after it is short. Then the previous
        # write's error is the sealer's to see (TensorFlow hands it to the first caller), and its size is known.
        self._sealer.wait()
        self._raise_background_error()
        if step == self._last_started and not (portable and self._writer.last_was_flash):
            return 0.0
        if step == self._last_started and self._persister:
            self._persister.forget(step)  # the shared tier gets the portable one at the next flush
        self._last_started = step
        tier = self._tier()
        os.makedirs(tier.store, exist_ok=True)
        if tier.kind == LOCAL and not self._make_room(tier.store):
            tier = self._tier()
        self._writer.choose(self._scratch)
        building = self._building(tier, step)
        self._save_began[step] = began
        try:
            self._write(tier, building, portable)
        except Exception as e:  # TensorFlow raises the previous write's error here, before this write
            shutil.rmtree(building, ignore_errors=True)
            if tier.kind != LOCAL or not _out_of_space(e):
                raise
            self._leave_local_tier(f"writing a snapshot ran out of space: {_last_line(e)}")
            tier = self._tier()
            building = self._building(tier, step)
            self._write(tier, building, portable)
        self._sealer.submit(_SealJob(step, building, tier))
        return time.monotonic() - began

    def save_for_survivors(self, step: int, *, task: str, cause: str) -> str | None:
        """After a peer's failure: the state this worker holds, at ``step``, written to the shared tier and sealed
        there before returning (the process is about to end), marked as the survivors' (``task``: this worker,
        ``cause``: the error it saw). Returns the snapshot's path; None when the shared tier has that step already.
        Runs no collective and creates no variable (SnapshotWriter.write_now): a sync-on-read variable, whose read
        is an all-reduce, makes it fail, and the next generation restores the newest snapshot."""
        if step in snapshots.complete_steps(self.shared_store):
            return None
        os.makedirs(self.shared_store, exist_ok=True)
        building = self._building(Tier(SHARED, self.shared_store, self._keep_shared), step)
        try:
            with open(os.path.join(building, snapshots.SURVIVORS_MARK), "w", encoding="utf-8") as out:
                json.dump({"step": step, "task": task, "cause": cause[:_CAUSE_CHARS]}, out)
            self.checkpoint.sync()  # an asynchronous write under way finishes first (it may share files' memory)
            self._writer.write_now(building)
            if os.path.isdir(snapshots.snapshot_dir(self.shared_store, step)):  # another survivor sealed it
                shutil.rmtree(building, ignore_errors=True)
                return None
            # The other writer (ranks 0 and 1 both write) may seal the same state meanwhile: its copy stays.
            return snapshots.seal(building, self.shared_store, step, replace=False)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise

    def _write(self, tier: Tier, building: str, portable: bool) -> None:
        """A flash snapshot, synchronously; else TensorFlow's asynchronous write, which TensorFlow finishes in its
        own thread. A worker that keeps no snapshot writes one too: reading a sync-on-read variable is an
        all-reduce, which every worker must join."""
        if not self._writer.flash or portable:
            self._writer.write(building, portable)
            return
        recycled = self._reusable(tier)
        try:
            self._writer.write(building, portable, recycled, keep_mapped=tier.kind != SHARED)
        finally:
            if recycled and tier.kind == LOCAL:
                shutil.rmtree(os.path.dirname(recycled), ignore_errors=True)

    def _reusable(self, tier: Tier) -> str | None:
        """A data file whose memory the next flash snapshot in ``tier`` can take over: the local tier's oldest
        snapshot's, or the scratch directory's spare."""
        if tier.kind == LOCAL:
            return snapshots.retire_oldest(tier.store, tier.keep, protect=self._protected())
        spare = os.path.join(tier.store, _SPARE)
        return spare if tier.kind == SCRATCH and os.path.exists(spare) else None

    def _protected(self) -> tuple[int, ...]:
        """The step the persister copies: the local tier keeps it until then."""
        return self._persister.pinned() if self._persister else ()

    @staticmethod
    def _building(tier: Tier, step: int) -> str:
        """A new temporary directory in ``tier`` for ``step``."""
        os.makedirs(tier.store, exist_ok=True)
        building = snapshots.temporary_dir(tier.store, step)
        os.makedirs(building)
        return building

    def _make_room(self, store: str) -> bool:
        """Makes room in the local tier for one more snapshot, removing all but its newest one if need be; without
        room, this worker stops using it (returns False: see the module docstring)."""
        newest = snapshots.complete_steps(store)
        need = LOCAL_HEADROOM * snapshots.snapshot_size(snapshots.snapshot_dir(store, newest[0])) if newest else 0
        if shutil.disk_usage(store).free >= need:
            return True
        self._writer.release()  # the mapped files' memory, for the files the prune removes
        protected = self._protected()  # read once: a copy that ends in between must still be waited for
        snapshots.prune(store, 1, protect=protected)
        free = shutil.disk_usage(store).free
        if free < need and protected and self._persister:  # the copy to the shared tier holds one
            self._persister.wait_idle()
            snapshots.prune(store, 1)
            free = shutil.disk_usage(store).free
        if free >= need:
            return True
        self._leave_local_tier(f"{free / 2**20:.0f} MiB free, less than the {need / 2**20:.0f} MiB a snapshot needs")
        return False

    def _leave_local_tier(self, why: str) -> None:
        if self._local_full:
            return
        self._local_full = True
        log.warning("the local checkpoint tier %s has no room for a snapshot (%s): %s", self.local_store, why,
                    f"snapshots go to the shared tier {self.shared_store} from now on" if self.is_chief else
                    "this worker keeps no snapshot from now on (the chief's go to the shared tier)")

    def wait_sealed(self) -> None:
        """Waits until every snapshot started is sealed (the next save does anyway, first)."""
        self._sealer.wait()

    def flush(self) -> None:
        """Waits until every snapshot started is sealed and, on the chief, the newest is in the shared tier."""
        self.checkpoint.sync()
        self._sealer.wait()
        if self._persister:
            self._persister.wait_idle()
        self._raise_background_error()
        sealed = self.sealed_step
        if self._last_started is not None and sealed != self._last_started and self._tier().kind != SCRATCH:
            raise RuntimeError(f"snapshot step {self._last_started} was not written to {self.write_store} (see "
                               "the error above): the state at this stop is not saved")
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
            self._sealer.stop()
            if self._persister:
                self._persister.stop()
            self._writer.release()
            if self._scratch:
                shutil.rmtree(self._scratch, ignore_errors=True)

    def restore(self) -> TierRestore:
        """Restores the coordinator's step (:mod:`tfelastic.trainer.tier_restore`). Raises
        :class:`~tfelastic.trainer.checkpoint.NoRestorableCheckpointError` when the chosen step, or every
        snapshot without an agent, fails to restore."""
        return TierRestorer(self.checkpoint, self.local_store, self.shared_store, is_chief=self.is_chief,
                            write_store=self.write_store, managed=self._managed, wanted=self._wanted).restore()

    def _seal_job(self, job: _SealJob) -> None:
        """In the sealer's thread: seals ``job``'s snapshot once TensorFlow has written it; the errors the next
        save can deal with are logged here, the others raised for :meth:`_raise_background_error`."""
        try:
            self.checkpoint.sync()  # TensorFlow's writer thread has finished this snapshot's files
            self._seal(job)
        except BaseException as e:
            shutil.rmtree(job.building, ignore_errors=True)
            if job.tier.kind == LOCAL and _out_of_space(e):
                self._leave_local_tier(f"sealing step {job.step} ran out of space")  # this snapshot is lost
                self._written(job.step)
            elif isinstance(e, snapshots.NothingWritten):  # the next save() or flush() deals with it
                log.warning("snapshot step %d was not written to %s (TensorFlow's error follows at the next "
                            "save)", job.step, job.tier.store)
                self._written(job.step)
            else:
                raise

    def _seal(self, job: _SealJob) -> None:
        step, building, tier = job.step, job.building, job.tier
        if tier.kind == SCRATCH:
            if not self._writer.complete(building):  # else read at the next save, then removed
                if os.path.exists(flash.data_file(building)):
                    os.replace(flash.data_file(building), os.path.join(tier.store, _SPARE))
                shutil.rmtree(building, ignore_errors=True)
            self._written(step)
            return
        self._writer.complete(snapshots.seal(building, tier.store, step, private=tier.kind == LOCAL))
        snapshots.prune(tier.store, tier.keep, protect=self._protected())
        self.sealed_step = step
        if tier.kind == SHARED:
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
    def copying_step(self) -> int | None:
        """The snapshot being copied to the shared tier in the background now (the chief's), if any."""
        return self._persister.copying if self._persister else None

    @property
    def copies_begun(self) -> int:
        """How many copies to the shared tier have begun (a copy can begin and end within one step)."""
        return self._persister.copies_begun if self._persister else 0

    def copy_beside_step(self) -> tuple[bool, bool]:
        """Whether a copy to the shared tier ran beside the step that just ended (one under way now, or one begun
        since the last call), and whether one began in it. Call it once per step."""
        begun = self.copies_begun
        began, self._copies_seen = begun != self._copies_seen, begun
        return began or self.copying_step is not None, began

    def pace_copies(self, seconds: float) -> None:
        """Copies to the shared tier at most every ``seconds``, never more often than ``persist_seconds``."""
        if self._persister:
            self._persister.interval = max(self.persist_seconds, seconds)

    @property
    def last_save_step(self) -> int | None:
        """The step of the newest snapshot begun."""
        return self._last_started

    @property
    def writing(self) -> bool:
        """Whether a snapshot is being written in the background (the copy to the shared tier aside: see
        :meth:`copy_beside_step`)."""
        return self._last_started is not None and self._written_step != self._last_started

    def _written(self, step: int) -> None:
        self._written_step = step
        began = self._save_began.pop(step, None)
        for older in [s for s in self._save_began if s < step]:  # saves whose write raised: never sealed
            del self._save_began[older]
        if began is not None:
            self.last_write_seconds = time.monotonic() - began

    def _raise_background_error(self) -> None:
        error = self._sealer.take_error()
        if error is not None:
            raise RuntimeError(f"a snapshot could not be written to {self.write_store}: {error}") from error


def _private_or_none(node_dir: str | None) -> str | None:
    """The local tier's directory of this node (the agent made it), once made sure it is this user's own, mode
    0700; None (no local tier, with a warning) when it is another user's or a link."""
    if not node_dir:
        return None
    try:
        snapshots.make_private_dirs(node_dir, node_dir)
    except snapshots.UnsafeTierError as e:
        log.warning("the local checkpoint tier is off: %s, so another user could read or replace the snapshots "
                    "there; snapshots go to the shared tier (the chief's; the other workers keep none)", e)
        return None
    return node_dir


def _last_line(error: BaseException) -> str:
    """The line of a TensorFlow error that says what failed (its first lines are the op's context)."""
    return str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__


def _out_of_space(error: BaseException) -> bool:
    """Whether a write failed for want of space (an OSError, or TensorFlow's error that carries its message)."""
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or \
        "No space left on device" in str(error) or "ENOSPC" in str(error)
