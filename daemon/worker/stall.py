"""Hang detection: a trainer that reports no progress for longer than its limit is stalled (TensorFlow notices a
dead peer, not a live one that is stuck). Pure: reports and an injected clock in, the verdict out.

Invariants: a fixed limit applies to every phase from the first report (``off`` never stalls); the learned limit
(``auto``) is ``factor`` x the longest gap between training reports of the last hour, at least ``floor``, for
trainers that announce their long work (a :class:`~tfelastic.trainer.progress.Phase`), past :data:`WARMUP_GAPS`;
start-up, saves and evaluations get ``allowance`` and are not learned; a worker of a job that reported before is
watched from its launch; after "training completed" the check pauses. docs/instrumentation.md has the phases.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from tfelastic.trainer.progress import Phase

WARMUP_GAPS = 10  # training gaps seen before the learned limit applies
GAP_MEMORY_SECONDS = 3600.0  # the longest gap of the last hour sets the limit (kept per minute)


@dataclass(frozen=True)
class StallTimeout:
    """The ``--stall-timeout`` setting: ``auto`` (None) learns the limit, ``off`` (0) disables hang detection, a
    number of seconds is a fixed limit."""

    seconds: float | None = None
    WORDS: ClassVar[tuple[str, str]] = ("auto", "off")

    @classmethod
    def parse(cls, text: str) -> StallTimeout:
        if text == "auto":
            return cls()
        if text == "off":
            return cls(0.0)
        try:
            return cls(float(text))
        except ValueError:
            raise ValueError(f"{text!r} is neither 'auto' nor a number of seconds (or 'off')") from None

    def __str__(self) -> str:
        return "auto" if self.seconds is None else "off" if self.seconds == 0 else f"{self.seconds:g}"

    def limits(self, floor: float, allowance: float) -> StallLimits:
        return StallLimits(self.seconds, floor=floor, allowance=allowance)


STALL_AUTO = StallTimeout()


@dataclass(frozen=True)
class StallLimits:
    fixed: float | None = None  # a fixed limit (--stall-timeout SECONDS; 0 off); None learns it
    floor: float = 5.0  # half the silence after which TensorFlow's coordination service declares a peer dead
    allowance: float = 300.0
    factor: float = 8.0  # 1.6x the slowest of steps that vary 5x, should the warm-up see only the fastest


class StallDetector:
    def __init__(self, limits: StallLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._gaps = _GapMemory(clock)  # training gaps, kept across generations
        self._ever_reported = False
        self._phase_aware = False  # the job's trainers announce long work (a phase other than train)
        self._reset_state()

    def _reset_state(self) -> None:
        self._last_report: float | None = None
        self._phase = Phase.SETUP
        self._last_step: int | None = None
        self._steps = 0  # reports of this worker that advanced the step
        self._paused = self._reported = False

    def reset(self) -> None:
        """A new worker starts. If the job's trainers report, its start-up is watched from now."""
        self._reset_state()
        if self._ever_reported and self.limits.fixed is None:
            self._last_report = self._clock()

    def progress(self, step: int = 0, phase: Phase = Phase.TRAIN, *, training_done: bool = False) -> None:
        """A report; ``training_done`` pauses the check until the next one."""
        now = self._clock()
        if self._last_step is not None and step >= self._last_step:
            # A silence in training ends: it is learned if the last report was a training one (after setup, a save
            # or an evaluation the gap holds them). The new report may announce a save: the gap up to it is still
            # training (with saves every few steps, most gaps end that way). A report of the step already reported
            # ends one too: a trainer with two reporters (its own and the instrumentation's) may send one on each
            # side of its slow part, and the limit is for the silence, not for the step.
            if self._phase is Phase.TRAIN and self._last_report is not None:
                self._gaps.add(now - self._last_report, step_made=step > self._last_step)
            if step > self._last_step and phase is not Phase.SETUP:  # a restore's jump is not a step made
                self._steps += 1
        # A worker's first report comes before its first step, which traces and compiles: still setup.
        self._phase = Phase.SETUP if phase is Phase.TRAIN and self._last_step is None else phase
        self._last_step = step if self._last_step is None else max(step, self._last_step)
        self._last_report, self._paused, self._ever_reported = now, training_done, True
        self._phase_aware = self._phase_aware or phase is not Phase.TRAIN

    def _learned(self) -> bool:
        """Whether the learned limit applies now: a trainer that announces its long work, training, past this
        worker's first two steps (the second may trace again), and enough gaps seen."""
        return (self._phase_aware and self._phase is Phase.TRAIN and self._steps >= 2
                and self._gaps.count >= WARMUP_GAPS)

    def limit(self) -> float:
        """The silence that makes a stall now (0: never)."""
        limits = self.limits
        if limits.fixed is not None:
            return limits.fixed
        if not self._learned():
            return limits.allowance
        return max(limits.floor, limits.factor * self._gaps.longest())

    def explain(self) -> str:
        """Where the limit comes from, for the stall's report."""
        limits, limit = self.limits, self.limit()
        if limits.fixed is not None:
            return f"stall_timeout={limits.fixed:g}s"
        if not self._learned():
            what = (self._phase.value if self._phase is not Phase.TRAIN else
                    "warm-up" if self._phase_aware else "no-phase")
            return f"{what} allowance {limit:g}s"
        return (f"learned limit {limit:.1f}s: {limits.factor:g} x the longest step gap "
                f"{self._gaps.longest():.2f}s, floor {limits.floor:g}s")

    def limit_in_force(self) -> float:
        """The limit that applies now, 0 while nothing is watched (no report yet, or training completed)."""
        return 0.0 if self._last_report is None or self._paused else self.limit()

    def silent_for(self) -> float | None:
        """Seconds since the last report (or the watched launch); None if not watched."""
        if self._last_report is None:
            return None
        return self._clock() - self._last_report

    def stalled(self) -> bool:
        silent, limit = self.silent_for(), self.limit()
        return limit > 0 and not self._paused and silent is not None and silent > limit

    def newly_stalled(self) -> float | None:
        """The silence, the first time it makes a stall (one report per worker); None otherwise."""
        if self._reported or not self.stalled():
            return None
        self._reported = True
        return self.silent_for()


class _GapMemory:
    """The longest training gap of the last hour, kept as one maximum per minute (bounded whatever the rate)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._minutes: deque[tuple[int, float]] = deque()  # (minute, longest gap in it)
        self.count = 0  # gaps seen that ended with a step made (the warm-up counts steps, however many reporters)

    def add(self, gap: float, *, step_made: bool = True) -> None:
        minute = int(self._clock() // 60)
        if self._minutes and self._minutes[-1][0] == minute:
            self._minutes[-1] = (minute, max(self._minutes[-1][1], gap))
        else:
            self._minutes.append((minute, gap))
        oldest = minute - int(GAP_MEMORY_SECONDS // 60)
        while self._minutes and self._minutes[0][0] <= oldest:
            self._minutes.popleft()
        self.count += step_made

    def longest(self) -> float:
        return max((gap for _, gap in self._minutes), default=0.0)
