"""What the agent knows of its trainer's progress, and how long its failures took to detect and to recover.

Pure: the trainer's reports and an injected clock in, the progress to report and metrics out.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.rendezvous.api import WorkerProgress
from tfelastic.trainer.progress import Phase, ProgressMessage

Clock = Callable[[], float]
STEPS_WINDOW_SECONDS = 30.0


class ProgressTracker:
    """The current generation's progress: the last report, the checkpoint step it carries forward, steps per
    second over the last 30 s, and whether the coordinator has seen the latest report yet."""

    def __init__(self, clock: Clock, metrics: AgentMetrics, wall_clock: Clock = time.time) -> None:
        self._clock, self._wall_clock = clock, wall_clock
        self._metrics = metrics
        self._recent: deque[tuple[float, int]] = deque()  # (time, step) within the window
        self._latest: ProgressMessage | None = None
        self._latest_at = 0.0
        self._checkpoint_at: float | None = None
        self._sent: ProgressMessage | None = None
        self.done = False  # the trainer reported that training completed
        self._phases = PhaseClock(clock)
        self._done_step: int | None = None  # the step it reported its training done at, while it trains no further

    def new_generation(self) -> None:
        """A new worker starts: nothing it reports has come in yet."""
        self._recent.clear()
        self._latest = self._sent = None
        self._checkpoint_at = None  # until it reports one: the last one may have been another generation's
        self.done = False
        self._phases = PhaseClock(self._clock)
        self._done_step = None

    @property
    def latest(self) -> ProgressMessage | None:
        return self._latest

    def phase(self, message: ProgressMessage) -> None:
        """Every report of the current generation, the ones before its restore too: the time its saves and
        evaluations took (the goodput ledger's checkpoint and other), and whether its training is done (a second
        ``fit`` that trains on ends that)."""
        self._phases.report(message)
        if message.done:
            self._done_step = message.step
        elif self._done_step is not None and message.step > self._done_step:
            self._done_step = None

    def record(self, message: ProgressMessage) -> None:
        now = self._clock()
        self._metrics.progress(message, self._wall_clock())
        self._recent.append((now, message.step))
        while self._recent and now - self._recent[0][0] > STEPS_WINDOW_SECONDS:
            self._recent.popleft()
        if message.checkpoint_step is not None:
            self._metrics.checkpoint(message.checkpoint_step, self._wall_clock())
            self._checkpoint_at = now
        elif self._latest is not None:  # a report without a checkpoint keeps the last one it knows
            message = dataclasses.replace(message, checkpoint_step=self._latest.checkpoint_step)
        self._latest, self._latest_at = message, now

    def reached(self, step: int) -> None:
        """The trainer's step mark: steps it made after its last report. They count as reached when it was last
        heard of (the time after that report stays the fault's), so the next generation's redone steps are exact."""
        if self._latest is not None and step > self._latest.step:
            self._latest = dataclasses.replace(self._latest, step=step)  # its examples and loss: the last known

    def unsent(self) -> bool:
        return self._latest is not None and self._latest is not self._sent

    def for_report(self) -> WorkerProgress | None:
        """The latest progress, on this agent's clock; marks it as sent."""
        latest = self._latest
        if latest is None:
            return None
        self._sent = latest
        return WorkerProgress(
            step=latest.step, examples=latest.examples or 0, loss=latest.loss,
            checkpoint_step=latest.checkpoint_step if latest.checkpoint_step is not None else -1,
            reported_at=self._latest_at, steps_per_second=self.steps_per_second(),
            checkpoint_at=self._checkpoint_at, save_seconds=self._phases.save_seconds,
            other_seconds=self._phases.other_seconds, training_done=self._done_step is not None)

    def steps_per_second(self) -> float:
        """Over the last 30 s of reports; 0 (unknown) until they span a second. Reports are stamped when the
        agent reads them, and a busy loop reads a backlog at once: two reports alone could give any rate."""
        if len(self._recent) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 1.0 else 0.0


class PhaseClock:
    """How long a generation's trainer spent in its saves and evaluations, from the phases it announces: a save
    lasts from its ``save`` report to the next report, or what the next report says it held training up
    (``stall``, the fast tier's own measure); an evaluation from its ``eval`` report to the next one."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.save_seconds = 0.0
        self.other_seconds = 0.0
        self._phase: Phase | None = None
        self._since = 0.0

    def report(self, message: ProgressMessage) -> None:
        now = self._clock()
        if self._phase is Phase.SAVE:
            self.save_seconds += message.stall if message.stall is not None else now - self._since
        elif self._phase is Phase.EVAL:
            self.other_seconds += now - self._since
        elif message.stall is not None:  # a save the trainer did not announce, measured by itself
            self.save_seconds += message.stall
        self._phase, self._since = message.phase, now


class FailureTimes:
    """Feeds the detection, recovery and rendezvous histograms: from this node's worker failing (an exit, a stall)
    to the coordinator's stop order, from a stop order after a failure to the first progress after it, and from a
    Join to the assignment that answers it."""

    def __init__(self, clock: Clock, metrics: AgentMetrics) -> None:
        self._clock, self._metrics = clock, metrics
        self._failed_at: float | None = None
        self._recovering_since: float | None = None
        self._joined_at: float | None = None

    def joined(self) -> None:
        self._joined_at = self._clock()

    def assigned(self) -> None:
        if self._joined_at is not None:
            self._metrics.rendezvous.observe(self._clock() - self._joined_at)
            self._joined_at = None

    def worker_failed(self) -> None:
        self._failed_at = self._clock()

    def stop_ordered(self, after_failure: bool) -> None:
        now = self._clock()
        if after_failure:
            self._recovering_since = now
        if self._failed_at is not None:
            self._metrics.detection.observe(now - self._failed_at)
            self._failed_at = None

    def progressed(self) -> None:
        if self._recovering_since is not None:
            self._metrics.recovery.observe(self._clock() - self._recovering_since)
            self._recovering_since = None


def before_restore(message: ProgressMessage) -> bool:
    """A report of start-up that names no restored step: the library's trainers send one before they restore (the
    tier's restore reports the step it restored, and training reports come after it)."""
    return message.phase is Phase.SETUP and message.restored_step is None and not message.done
