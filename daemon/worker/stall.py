"""Hang detection: a trainer that reports no progress for longer than its limit is stalled.

TensorFlow notices a dead or stopped peer by itself, but not a trainer whose process is alive and stuck (a
wedged input pipeline, a deadlock in user code): its heartbeat thread keeps running (FACTS 3). Only training
progress tells.

The limit is learned by default (``--stall-timeout auto``). A report names what the trainer does now (a
:class:`~tfelastic.trainer.progress.Phase`):

* ``train``, between two training steps: once :data:`WARMUP_GAPS` gaps between two training reports have
  been seen, and the worker is past its first two steps, the limit is ``factor`` (10) times the longest gap of
  the last :data:`GAPS_KEPT`, and never below ``floor`` (20 s). A job whose steps take under a second is caught
  in about 20 s. Gaps are learned across the agent's generations: a relaunched worker of the same job steps
  as fast. (Reports come at most every 0.1 s, so a gap is a step or a few.)
* ``setup`` (start-up, restore, building the model, a new epoch's input pipeline), the first two training
  steps (tracing, compiling), the warm-up, ``save`` (a checkpoint) and ``eval`` (evaluation, prediction):
  ``allowance`` (600 s) from the report. A gap that follows one of them is not learned: it holds the long work.
* A worker of a job whose earlier workers reported is in ``setup`` from its launch: a hang in start-up (the
  collective's first handshake, a restore) is caught too. A trainer that never reported is not checked,
  since nothing says how long its steps take or whether it reports at all.

``--stall-timeout SECONDS`` is a fixed limit for every phase instead (start-up excepted, as before: the clock
starts at the first report); ``0`` turns hang detection off.

Once the trainer reports that training completed, the check pauses until its next report: evaluation, export
and teardown usually report nothing, and a restart there would redo them, or, where BackupAndRestore deleted its
backup on success (tf_keras' default), the whole training. A trainer that reports during them (ProgressCallback
in evaluate, TrainLoop.report_alive, another fit) is watched again.

Pure: the reports and an injected clock in, the verdict out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tfelastic.trainer.progress import Phase

WARMUP_GAPS = 10  # steady training gaps seen before the learned limit applies
GAPS_KEPT = 1000  # the longest of the last this many gaps sets the limit


@dataclass(frozen=True)
class StallLimits:
    fixed: float | None = None  # a fixed limit (--stall-timeout SECONDS; 0 off); None learns it
    floor: float = 20.0
    allowance: float = 600.0
    factor: float = 10.0


class StallDetector:
    def __init__(self, limits: StallLimits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self._clock = clock
        self._gaps: deque[float] = deque(maxlen=GAPS_KEPT)  # steady training gaps, kept across generations
        self._ever_reported = False
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
        if self._last_step is not None and step > self._last_step:
            # Steps were made since the last report. Its gap is learned only if that report was a training one:
            # after setup, a save or an evaluation the gap holds them. The new report may announce a save: the
            # gap up to it is still training (with saves every few steps, most gaps end that way).
            if self._phase is Phase.TRAIN and self._last_report is not None:
                self._gaps.append(now - self._last_report)
            self._steps += 1
        # A worker's first report comes before its first step, which traces and compiles: still setup.
        self._phase = Phase.SETUP if phase is Phase.TRAIN and self._last_step is None else phase
        self._last_step = step if self._last_step is None else max(step, self._last_step)
        self._last_report, self._paused, self._ever_reported = now, training_done, True

    def _learned(self) -> bool:
        """Whether the learned limit applies now: training, past this worker's first two steps (the second may
        trace again), and enough gaps seen."""
        return self._phase is Phase.TRAIN and self._steps >= 2 and len(self._gaps) >= WARMUP_GAPS

    def limit(self) -> float:
        """The silence that makes a stall now (0: never)."""
        limits = self.limits
        if limits.fixed is not None:
            return limits.fixed
        if not self._learned():
            return limits.allowance
        return max(limits.floor, limits.factor * max(self._gaps))

    def explain(self) -> str:
        """Where the limit comes from, for the stall's report."""
        limits, limit = self.limits, self.limit()
        if limits.fixed is not None:
            return f"stall_timeout={limits.fixed:g}s"
        if not self._learned():
            what = self._phase.value if self._phase is not Phase.TRAIN else "warm-up"
            return f"{what} allowance {limit:g}s"
        return (f"learned limit {limit:.1f}s: {limits.factor:g} x the longest step gap {max(self._gaps):.2f}s, "
                f"floor {limits.floor:g}s")

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
