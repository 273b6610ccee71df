"""Hang detection: a trainer that stops reporting progress for ``stall_timeout`` seconds is stalled.

TensorFlow notices a dead or stopped peer by itself, but not a trainer whose process is alive and stuck (a
wedged input pipeline, a deadlock in user code): its heartbeat thread keeps running (FACTS 3). Only training
progress tells. A trainer that never reports is not checked, since nothing says how long its steps take.

Once the trainer reports that training completed, the check pauses until its next report: evaluation, export
and teardown usually report nothing, and a restart there would redo them, or, where BackupAndRestore deleted its
backup on success (tf_keras' default), the whole training. A trainer that reports during them (ProgressCallback
in evaluate, TrainLoop.report_alive, another fit) is watched again.
"""

from __future__ import annotations

from collections.abc import Callable


class StallDetector:
    def __init__(self, timeout_seconds: float, clock: Callable[[], float]) -> None:
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._last_progress: float | None = None
        self._paused = False
        self._reported = False

    def reset(self) -> None:
        """A new worker starts: it is not checked until its first report."""
        self._last_progress = None
        self._paused = self._reported = False

    def progress(self, *, training_done: bool = False) -> None:
        """A report; ``training_done`` pauses the check until the next one."""
        self._last_progress = self._clock()
        self._paused = training_done

    def silent_for(self) -> float | None:
        """Seconds since the last report, or None if the trainer never reported."""
        if self._last_progress is None:
            return None
        return self._clock() - self._last_progress

    def stalled(self) -> bool:
        silent = self.silent_for()
        return (self.timeout_seconds > 0 and not self._paused and silent is not None
                and silent > self.timeout_seconds)

    def newly_stalled(self) -> float | None:
        """The silence, the first time it makes a stall (one report per worker); None otherwise."""
        if self._reported or not self.stalled():
            return None
        self._reported = True
        return self.silent_for()
