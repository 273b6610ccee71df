"""When to build the next generation's standby interpreter (pure). A standby imports TensorFlow, which competes for
the CPU with a trainer's own start-up and first steps (they trace and compile). On a node with cores to spare it is
due at the launch (and built at a lower priority: worker/warm.py, StandbyPolicy). Otherwise it is due
:data:`AFTER_PROGRESS_SECONDS` after the trainer's first progress report, or :data:`AFTER_LAUNCH_SECONDS` after
the launch of a trainer that does not report, and a generation that fails before then relaunches cold.
"""

from __future__ import annotations

from collections.abc import Callable

AFTER_PROGRESS_SECONDS = 10.0
AFTER_LAUNCH_SECONDS = 40.0


class StandbySchedule:
    def __init__(self, clock: Callable[[], float], at_launch: bool = False) -> None:
        self._clock, self._at_launch = clock, at_launch
        self._generation: int | None = None
        self._due_at = 0.0
        self._progressed = False

    def launched(self, generation: int) -> None:
        self._generation, self._progressed = generation, False
        self._due_at = self._clock() + (0.0 if self._at_launch else AFTER_LAUNCH_SECONDS)

    def progressed(self, generation: int) -> None:
        if generation == self._generation and not self._progressed:
            self._progressed = True
            self._due_at = min(self._due_at, self._clock() + AFTER_PROGRESS_SECONDS)

    def cancel(self) -> None:
        self._generation = None

    def due(self) -> int | None:
        """The generation whose standby to build now (once), else None."""
        if self._generation is None or self._clock() < self._due_at:
            return None
        generation, self._generation = self._generation, None
        return generation
