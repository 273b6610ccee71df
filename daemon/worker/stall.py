"""Hang detection: a trainer that stops reporting progress for ``stall_timeout`` seconds is stalled.

TensorFlow notices a dead or stopped peer by itself, but not a trainer whose process is alive and stuck (a
wedged input pipeline, a deadlock in user code): its heartbeat thread keeps running (FACTS 3). Only training
progress tells. A trainer that never reports is not checked, since nothing says how long its steps take.
"""

from __future__ import annotations

from collections.abc import Callable


class StallDetector:
    def __init__(self, timeout_seconds: float, clock: Callable[[], float]) -> None:
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._last_progress: float | None = None

    def reset(self) -> None:
        """A new worker starts: it is not checked until its first report."""
        self._last_progress = None

    def progress(self) -> None:
        self._last_progress = self._clock()

    def silent_for(self) -> float | None:
        """Seconds since the last report, or None if the trainer never reported."""
        if self._last_progress is None:
            return None
        return self._clock() - self._last_progress

    def stalled(self) -> bool:
        silent = self.silent_for()
        return self.timeout_seconds > 0 and silent is not None and silent > self.timeout_seconds
