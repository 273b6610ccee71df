"""The chief's copies of its local snapshots to the shared tier (:mod:`tfelastic.trainer.tiered`), in a thread of
its own, at most every ``interval`` seconds (the save schedule paces it by its cost): the copy competes with
training where the CPUs train, and the local tier covers a worker's crash; the shared tier is for a lost node. Pure
file operations, no TensorFlow.

A copy that fails is logged; the next snapshot offered tries again, and :meth:`Persister.copy_now` (a flush)
copies the newest itself.
"""

from __future__ import annotations

import logging
import threading
import time

from tfelastic.trainer import snapshots

log = logging.getLogger(__name__)

_STOP = -1


class Persister:
    """Copies snapshots of ``local_store`` to ``shared_store``, keeping its ``keep`` newest."""

    def __init__(self, local_store: str, shared_store: str, keep: int, interval: float) -> None:
        self.local_store, self.shared_store = local_store, shared_store
        self._keep = keep
        self.interval = interval
        self._last_taken = -float("inf")  # when the last copy was taken on
        self._changed = threading.Condition()
        self._waiting: int | None = None  # the newest step offered and not taken on yet (_STOP: stop)
        self._busy = False
        self.copying: int | None = None  # the step being copied: the local tier must keep it until then
        self.copies_begun = 0  # a copy short enough to begin and end within one step is still seen by its count
        self.persisted_step: int | None = None  # the newest complete in the shared tier
        self._thread: threading.Thread | None = None

    def offer(self, step: int) -> bool:
        """A snapshot of ``step`` was sealed in the local tier: copies it in the background unless a copy was
        taken on less than ``interval`` seconds ago (then returns False)."""
        if time.monotonic() - self._last_taken < self.interval:
            return False
        self._last_taken = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tfelastic-persist", daemon=True)
            self._thread.start()
        with self._changed:
            self._waiting = step
            self._changed.notify_all()
        return True

    def pinned(self) -> tuple[int, ...]:
        """The steps offered or being copied: the local tier must keep them until the copy is done."""
        with self._changed:
            return tuple(s for s in (self._waiting, self.copying) if s is not None and s != _STOP)

    def forget(self, step: int) -> None:
        """The local snapshot of ``step`` is being replaced (a portable save of it): the shared tier's copy of
        it no longer counts, so that a flush copies the new one."""
        self.wait_idle()
        if self.persisted_step == step:
            self.persisted_step = None

    def wait_idle(self) -> None:
        """Until no copy is waiting or under way."""
        with self._changed:
            self._changed.wait_for(lambda: self._waiting is None and not self._busy)

    def copy_now(self, step: int) -> bool:
        """Copies ``step`` in the calling thread (once idle); whether the shared tier has it now."""
        self.wait_idle()
        if self.persisted_step != step:
            self._copy(step)
        return self.persisted_step == step

    def stop(self) -> None:
        if self._thread is None:
            return
        with self._changed:
            self._waiting = _STOP
            self._changed.notify_all()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting is not None)
                step, self._waiting = self._waiting, None
                if step == _STOP:
                    return
                assert step is not None
                self._busy, self.copying = True, step  # before the lock is released: the writer's reuse sees it
                self.copies_begun += 1
            try:
                self._copy(step)
            finally:
                with self._changed:
                    self._busy, self.copying = False, None
                    self._changed.notify_all()

    def _copy(self, step: int) -> None:
        source = snapshots.snapshot_dir(self.local_store, step)
        try:
            snapshots.copy_snapshot(source, self.shared_store)
            snapshots.prune(self.shared_store, self._keep)
            self.persisted_step = step
        except (OSError, snapshots.SnapshotError) as e:
            log.warning("could not copy snapshot %s to the shared tier %s (%s); the next snapshot tries again",
                        source, self.shared_store, e)
