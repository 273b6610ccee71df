"""When to take the next snapshot: every ``save_every`` steps when the user says so, otherwise as often as an
overhead budget allows. Pure: the clock readings come in as arguments.

The adaptive interval is ``ceil(cost / (save_budget * step_seconds))`` steps, between 1 and ``maximum``: a
save's cost is its stall plus its *interference*, what the steps during its background write and the step after
it took beyond a quiet step (:meth:`SaveSchedule.step_done` sees every step). The chief's copies to the shared
tier are charged the same way: they come every :attr:`SaveSchedule.copy_seconds`, as often as half the budget
allows but at least every ``MAX_COPY_SECONDS``, and the saves get the rest. The first three saves are not
measured (they allocate). A save never waits for the previous write. The workers adopt the chief's interval
(:meth:`SaveSchedule.adopt`). docs/trainer.md has the measurements behind the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BUDGET = 0.01  # 1 % of training time
FIRST_INTERVAL = 10  # steps before the first save, and between the first two (nothing measured yet)
MAX_INTERVAL = 1000
WARMUP_SAVES = 3  # saves whose stall is not representative (see above)
MIN_COPY_SECONDS = 30.0  # between two copies to the shared tier, however cheap they are
# The most a lost node costs beyond its last copy, however dear copies are: the budget gives way to it.
MAX_COPY_SECONDS = 300.0
COPY_SHARE = 0.5  # the most of the budget the copies may take when they cost something
_SMOOTHING = 0.3  # weight of the newest measurement in the moving averages


@dataclass
class _Average:
    value: float | None = None

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else (1 - _SMOOTHING) * self.value + _SMOOTHING * sample
        return self.value


@dataclass
class _Window:
    """The steps that ran beside some background work, until the next quiet step closes it."""
    seconds: float = 0.0
    steps: int = 0

    def add(self, duration: float) -> None:
        self.seconds, self.steps = self.seconds + duration, self.steps + 1

    def close(self, quiet_step: float | None, into: _Average | None) -> None:
        """Charges what these steps took beyond ``quiet_step`` each ``into`` the average (None: not measured)."""
        if self.steps and quiet_step is not None and into is not None:
            into.add(max(self.seconds - self.steps * quiet_step, 0.0))
        self.seconds, self.steps = 0.0, 0


class SaveSchedule:
    def __init__(self, every: int | None = None, *, budget: float = DEFAULT_BUDGET, first: int = FIRST_INTERVAL,
                 maximum: int = MAX_INTERVAL, copy_floor: float = MIN_COPY_SECONDS) -> None:
        if every is not None and every < 1:
            raise ValueError(f"save_every={every} must be a positive number of steps (or None: adaptive)")
        if not 0 < budget < 1:
            raise ValueError(f"overhead budget {budget!r} must be a fraction between 0 and 1, e.g. 0.01 for 1 %")
        self.fixed = every
        self.budget = budget
        self.maximum = maximum
        self.copy_floor = copy_floor
        self.interval = every or first
        self.next_step: int | None = None  # set by start()
        self._stall = _Average()
        self._step_seconds = _Average()
        self._write_seconds = _Average()
        self._quiet_step = _Average()  # a step's time with no write under way
        self._interference = _Average()  # what the steps during a write took beyond quiet steps, per save
        self._copy_cost = _Average()  # the same for a copy to the shared tier, per copy
        self._after_save = _Window()  # the steps of the write under way, and the step after a save
        self._beside_copy = _Window()
        self._just_saved = False
        self._step_ended: float | None = None
        self._saves = 0
        self._last_save: tuple[int, float] | None = None  # (step, time the save returned)
        self._last_write: float | None = None

    def start(self, step: int) -> None:
        """Training starts (or resumes) at ``step``. A fixed schedule keeps to multiples of ``every``."""
        if self.fixed:
            self.next_step = (step // self.fixed + 1) * self.fixed
        else:
            self.next_step = step + self.interval
        self._last_save = None

    def step_done(self, now: float, writing: bool, copying: bool = False, copy_began: bool = False) -> None:
        """A training step ended at ``now``; ``writing``: a snapshot was being written in the background;
        ``copying``: a copy to the shared tier ran beside it (a step beside both is charged to the copy);
        ``copy_began``: a copy began in it (one right after another is a cost of its own, with no quiet step
        between them to end the first's)."""
        if self._step_ended is not None:
            duration = max(now - self._step_ended, 0.0)
            if copy_began:
                self._charge(self._beside_copy, self._copy_cost)
            if copying:
                self._beside_copy.add(duration)
            elif writing or self._just_saved:
                self._after_save.add(duration)
            else:
                self._charge(self._after_save, self._interference)
                self._charge(self._beside_copy, self._copy_cost)
                self._quiet_step.add(duration)
        self._just_saved = False
        self._step_ended = now

    def due(self, step: int) -> bool:
        return self.next_step is not None and step >= self.next_step

    def saved(self, step: int, stall: float, began: float, write_seconds: float | None = None) -> int:
        """A save at ``step`` began at ``began`` and held training up for ``stall`` seconds; ``write_seconds``:
        how long the latest finished snapshot took to be written in the background (None: none yet). Returns the
        interval this worker proposes next (the caller may have the workers agree, then :meth:`adopt` it)."""
        # The previous save's window ends here even without a quiet step (at an interval of 1 there is none).
        self._charge(self._after_save, self._interference)
        self._saves += 1
        if write_seconds is not None and write_seconds != self._last_write:
            self._last_write = write_seconds
            self._write_seconds.add(max(write_seconds, 0.0))
        if self._last_save is not None and step > self._last_save[0]:
            previous_step, previous_end = self._last_save
            self._step_seconds.add(max(began - previous_end, 0.0) / (step - previous_step))
        if self._saves > WARMUP_SAVES:
            self._stall.add(max(stall, 0.0))
        self._last_save = (step, began + stall)
        self._step_ended = began + stall  # the stall is not a step's time
        self._just_saved = True
        return self.fixed or self._proposal()

    def adopt(self, step: int, interval: int) -> None:
        """The interval every worker agreed on, after a save at ``step``."""
        self.interval = self.fixed or max(1, min(int(interval), self.maximum))
        self.next_step = step + self.interval

    def _charge(self, window: _Window, into: _Average) -> None:
        """Closes ``window``, charging ``into`` once the quiet steps are measured."""
        window.close(self._quiet_step.value, into if self._measured else None)

    @property
    def _measured(self) -> bool:
        """Whether the work beside the steps is measured yet: not during the warm-up saves."""
        return self._saves > WARMUP_SAVES

    @property
    def mean_stall(self) -> float | None:
        return self._stall.value

    @property
    def mean_interference(self) -> float | None:
        return self._interference.value

    @property
    def mean_copy_cost(self) -> float | None:
        return self._copy_cost.value

    @property
    def copy_seconds(self) -> float:
        """The fewest seconds between two copies to the shared tier: ``copy_floor``, or longer when a copy costs
        more than half the budget at that pace, up to ``MAX_COPY_SECONDS``."""
        cost = self._copy_cost.value
        if not cost:
            return self.copy_floor
        paced = cost / (self.budget * COPY_SHARE)
        return max(self.copy_floor, min(paced, MAX_COPY_SECONDS))

    def _save_budget(self) -> float:
        """The budget left to the saves: what the copies at their pace do not take, at least half of it."""
        cost = self._copy_cost.value
        if not cost:
            return self.budget
        return max(self.budget - cost / self.copy_seconds, self.budget * (1 - COPY_SHARE))

    def _proposal(self) -> int:
        stall, step = self._stall.value, self._step_seconds.value
        if stall is None or step is None:
            return self.interval
        if step <= 0:
            return self.maximum
        step = self._quiet_step.value or step
        cost = stall + (self._interference.value or 0.0)
        budgeted = math.ceil(cost / (self._save_budget() * step) - 1e-9)  # 20.000000000000004 steps are 20
        write = self._write_seconds.value
        unqueued = math.ceil(write / step) + 1 if write is not None else 1
        return max(1, min(max(budgeted, unqueued), self.maximum))
