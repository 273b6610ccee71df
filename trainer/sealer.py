"""The fast tier's sealer (:mod:`tfelastic.trainer.tiered`): a thread of its own that finishes the snapshots the
training thread started, one at a time, in the order they were submitted. No TensorFlow here.

Invariant: an error a job raises is kept, not lost and not raised in the sealer's thread: the training thread takes
it with :meth:`Sealer.take_error` (at its next save or flush) and the jobs after it still run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")


class Sealer(Generic[Job]):
    """Runs ``seal(job)`` for every job submitted, in a daemon thread started by the first one."""

    def __init__(self, seal: Callable[[Job], None], name: str = "tfelastic-seal") -> None:
        self._seal, self._name = seal, name
        self._jobs: queue.Queue[Job | None] = queue.Queue()  # None: stop
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def wait(self) -> None:
        """Until every job submitted has run."""
        self._jobs.join()

    def take_error(self) -> BaseException | None:
        """The error of a job since the last call (the latest, if several failed), once."""
        error, self._error = self._error, None
        return error

    def stop(self) -> None:
        """Runs the jobs submitted, then ends the thread."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._seal(job)
            except BaseException as e:  # the training thread's to raise
                self._error = e
            finally:
                self._jobs.task_done()
        self._jobs.task_done()
