"""The job's restarts: how many and why, the failure budget's sliding window, and the delay before the next
generation after failures in a row. Pure: an injected clock, no I/O.

Backoff: the first failure after a healthy run restarts at once (recovery takes tens of milliseconds of control
plane). A second failure in a row waits ``restart_backoff`` seconds before the next generation forms, and each
further one twice as long, up to ``restart_backoff_max``, so that a transient fault (a full filesystem, a flapping
link) has time to pass before the budget is spent. A healthy generation resets it: one whose trainers made
training progress (a step beyond the first they reported), or that ran for ``HEALTHY_RUN_SECONDS``. Planned
restarts (scale-up, leave, an operator's restart) neither wait nor count.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from tfelastic.daemon.rendezvous.api import JobSpec, RendezvousSettings, RestartReason
from tfelastic.daemon.rendezvous.durable import DurableState

HEALTHY_RUN_SECONDS = 60.0
MAX_WARNINGS = 5  # the most recent, for status

log = logging.getLogger("tfelastic.coordinator")


class RestartBook:
    def __init__(self, settings: RendezvousSettings, clock: Callable[[], float]) -> None:
        self._settings, self._clock = settings, clock
        self.total = 0
        self.by_reason: Counter[str] = Counter()
        self._held: str | None = None  # the reason of the last restart while its count waits (settled)
        self._failures: deque[float] = deque()  # times of failures inside the restart window
        self.failed_in_a_row = 0  # failed generations since the last healthy run
        self._formed_at: float | None = None  # when the current generation formed
        self._first_step: int | None = None  # the first step a trainer of the current generation reported
        self._progressed = False  # a trainer of the current generation reported a later step
        self.not_before: float | None = None  # the next generation forms no earlier than this
        self.resumes = ResumeWatch()

    def budget_exhausted(self, reason: RestartReason, spec: JobSpec) -> bool:
        """Counts a failure in the sliding window; True when it is one more than ``max_restarts`` allows."""
        if not reason.counts_against_budget:
            return False
        now = self._clock()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > spec.restart_window_seconds:
            self._failures.popleft()
        return len(self._failures) > spec.max_restarts

    @property
    def failures_in_window(self) -> int:
        return len(self._failures)

    def settled(self, reason: str) -> None:
        """The reason of the restart whose count was held (``restarted(..., held=True)``) is known: counted now.
        Counts by reason only ever grow: they are Prometheus counters (tfelastic_cluster_restarts_total)."""
        if self._held is not None:
            self._held = None
            self.by_reason[reason] += 1

    def restarted(self, reason: RestartReason, *, held: bool = False) -> float:
        """Records a restart; returns how long the next generation must wait (0: at once). ``held``: its count by
        reason waits for :meth:`settled` (a survivor's report, whose root cause may still come:
        rendezvous/blame.py); the total and the budget count it now."""
        if held:
            self._held = reason.value
        else:
            self.by_reason[reason.value] += 1
        self.total += 1
        now = self._clock()
        # A healthy generation resets the count however it ends: a scale-up after it must not leave the failures
        # before it counted "in a row" with the next one.
        if self._progressed or (self._formed_at is not None and now - self._formed_at >= HEALTHY_RUN_SECONDS):
            self.failed_in_a_row = 0
        if not reason.counts_against_budget:
            return 0.0
        self.failed_in_a_row += 1
        delay = self.backoff(self.failed_in_a_row)
        self.not_before = now + delay if delay > 0 else None
        return delay

    def backoff(self, failures_in_a_row: int) -> float:
        if failures_in_a_row <= 1:
            return 0.0
        base, cap = self._settings.restart_backoff_seconds, self._settings.restart_backoff_max_seconds
        return min(cap, base * (1 << min(failures_in_a_row - 2, 32)))

    def may_form(self, now: float) -> bool:
        return self.not_before is None or now >= self.not_before

    def formed(self) -> None:
        self._formed_at = self._clock()
        self.not_before = None
        self._first_step, self._progressed = None, False

    def progress(self, generation: int, step: int, checkpoint_step: int) -> None:
        """A member of the current generation reported ``step`` (and its last checkpoint, -1 for none)."""
        if self._first_step is None:
            self._first_step = step
            self.resumes.resumed(generation, step, after_restart=self.total > 0)
        elif step > self._first_step:
            self._progressed = True
        self.resumes.reached(step, checkpoint_step)

    def export(self, wall_offset: float) -> dict[str, Any]:
        """What a new coordinator needs to continue the count, the budget and the backoff; failure times as
        wall-clock seconds (``wall_offset``: wall clock minus this clock)."""
        r = self.resumes
        return {"restarts_total": self.total, "restarts_by_reason": dict(self._counted_by_reason()),
                "failures": tuple(t + wall_offset for t in self._failures), "failed_in_a_row": self.failed_in_a_row,
                "reached_step": r.reached_step, "checkpoint_step": r.checkpoint_step,
                "steps_redone": r.steps_redone, "steps_lost": r.steps_lost, "warnings": tuple(r.warnings)}

    def _counted_by_reason(self) -> Counter[str]:
        """For etcd: a successor knows nothing of a held count's root cause, so it counts as first reported."""
        return self.by_reason + Counter([self._held] if self._held is not None else [])

    def take_over(self, recorded: DurableState, wall_offset: float) -> None:
        self.total = recorded.restarts_total
        self.by_reason = Counter(recorded.restarts_by_reason)
        # A failure cannot lie in the future: one that seems to (another machine's clock ahead, a hand-edited
        # state) counts from now, instead of holding a slot of the budget until its time comes.
        now = self._clock()
        self._failures = deque(sorted(min(t - wall_offset, now) for t in recorded.failures))
        self.failed_in_a_row = recorded.failed_in_a_row
        r = self.resumes
        r.reached_step, r.checkpoint_step = recorded.reached_step, recorded.checkpoint_step
        r.steps_redone, r.steps_lost = recorded.steps_redone, recorded.steps_lost
        r.warnings.extend(recorded.warnings)

    def continue_from(self, restart_count: int) -> None:
        """A restarted coordinator continues the count that the agents report."""
        self.total = max(self.total, restart_count)


class ResumeWatch:
    """Where each generation resumed, against what the job had reached: the steps redone after a restart (at most
    the save interval, when checkpoints work), and the steps lost below the last checkpoint the job had saved (a
    backup deleted or torn: training silently starts over). A loss is a warning in the log and in status."""

    def __init__(self) -> None:
        self.reached_step = -1  # the furthest step any trainer reported
        self.checkpoint_step = -1  # the newest checkpoint any trainer reported
        self.steps_redone = 0
        self.steps_lost = 0
        self.warnings: deque[str] = deque(maxlen=MAX_WARNINGS)

    def resumed(self, generation: int, step: int, *, after_restart: bool) -> None:
        if not after_restart or self.reached_step < 0:
            return
        self.steps_redone += max(0, self.reached_step - step)
        if step < self.checkpoint_step:
            lost = self.checkpoint_step - step
            self.steps_lost += lost
            warning = (f"generation {generation} resumed at step {step}, below the checkpoint of step "
                       f"{self.checkpoint_step} the job had saved: {lost} steps lost (was the backup deleted or "
                       "damaged?)")
            self.warnings.append(warning)
            log.warning("%s", warning)

    def reached(self, step: int, checkpoint_step: int) -> None:
        self.reached_step = max(self.reached_step, step)
        self.checkpoint_step = max(self.checkpoint_step, checkpoint_step)
