"""When the fast tier saves (trainer/save_schedule.py): a fixed interval, or one adapted to an overhead budget
from the measured stall and step time. Pure: times are passed in."""

from __future__ import annotations

import itertools

import pytest
from tfelastic.trainer.save_schedule import FIRST_INTERVAL, MAX_INTERVAL, SaveSchedule


def run(schedule: SaveSchedule, steps: int, step_seconds: float, stall: float, start: int = 0) -> list[int]:
    """Trains ``steps`` steps of ``step_seconds``, saving when due with ``stall``; returns the steps saved."""
    now, saved = 100.0, []
    schedule.start(start)
    for step in range(start + 1, start + steps + 1):
        now += step_seconds
        if schedule.due(step):
            schedule.adopt(step, schedule.saved(step, stall, now))
            now += stall
            saved.append(step)
    return saved


def test_a_fixed_interval_saves_at_its_multiples_also_after_a_restore() -> None:
    assert run(SaveSchedule(25), 100, 0.5, 2.0) == [25, 50, 75, 100]
    assert run(SaveSchedule(25), 60, 0.5, 2.0, start=37) == [50, 75]


def test_the_adaptive_interval_spends_the_budget_on_the_measured_stall() -> None:
    # 0.5 s steps, 0.1 s stall, 1 %: ceil(0.1 / (0.01 * 0.5)) = 20 steps.
    saved = run(SaveSchedule(budget=0.01), 200, 0.5, 0.1)
    assert saved[:4] == [FIRST_INTERVAL * n for n in (1, 2, 3, 4)]  # warm-up: nothing measured yet
    gaps = {b - a for a, b in itertools.pairwise(saved[3:])}
    assert gaps == {20}


@pytest.mark.parametrize(("stall", "step_seconds", "interval"), [
    (0.001, 1.0, 1),  # nearly free: every step
    (0.05, 0.5, 10),
    (1.0, 0.1, MAX_INTERVAL),  # a stall of 10 steps at 1 %: capped
])
def test_the_interval_is_clamped(stall: float, step_seconds: float, interval: int) -> None:
    schedule = SaveSchedule()
    run(schedule, 20_000, step_seconds, stall)
    assert schedule.interval == interval


def test_the_warm_up_saves_do_not_count_their_stall() -> None:
    schedule = SaveSchedule()
    schedule.start(0)
    assert schedule.saved(10, stall=30.0, began=10.0) == FIRST_INTERVAL  # TensorFlow's: allocates its copies
    schedule.adopt(10, FIRST_INTERVAL)
    assert schedule.saved(20, stall=5.0, began=50.0) == FIRST_INTERVAL  # a flash snapshot into a new file
    schedule.adopt(20, FIRST_INTERVAL)
    assert schedule.saved(30, stall=1.0, began=95.0) == FIRST_INTERVAL  # and another
    assert schedule.mean_stall is None
    schedule.adopt(30, FIRST_INTERVAL)
    assert schedule.saved(40, stall=0.02, began=141.0) == 1  # 4.5 s steps: 0.02 s is 0.4 %
    assert schedule.mean_stall == 0.02


def test_workers_adopt_the_agreed_interval_even_when_they_proposed_another() -> None:
    schedule = SaveSchedule()
    schedule.start(0)
    schedule.adopt(10, 37)
    assert (schedule.interval, schedule.next_step) == (37, 47)
    schedule.adopt(47, 10**9)
    assert schedule.interval == MAX_INTERVAL


@pytest.mark.parametrize(("every", "budget", "message"), [
    (0, 0.01, "save_every=0 must be a positive number of steps"),
    (None, 0.0, "overhead budget 0.0 must be a fraction between 0 and 1"),
    (None, 5, "overhead budget 5 must be a fraction"),
])
def test_bad_settings_name_the_value(every: int | None, budget: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SaveSchedule(every, budget=budget)


def test_saves_come_no_sooner_than_the_background_write_allows() -> None:
    """A stall of 1 ms would allow a save every step at 1 %; a 2.4 s write of 0.5 s steps needs 5 steps, and
    one more, so that a save never waits for the previous write."""
    schedule = SaveSchedule()
    schedule.start(0)
    now = 0.0
    for step in (10, 20, 30, 40):
        now += 5.0
        schedule.adopt(step, schedule.saved(step, stall=0.001, began=now, write_seconds=2.4 + step * 1e-9))
        now += 0.001
    assert schedule.interval == 6
    now += 3.0
    assert schedule.saved(46, stall=0.001, began=now, write_seconds=None) == 6  # nothing new: the average holds


def test_the_interference_of_a_background_write_is_charged_to_the_budget() -> None:
    """Steps of 0.5 s take 0.7 s while a snapshot is written (the 2 steps after a save): 0.4 s of interference
    per save, and a stall of 1 ms. At 1 %: ceil(0.401 / (0.01 * 0.5)) = 81 steps, where the stall alone would
    allow a save every 3 steps (the write's 2, and one)."""
    schedule = SaveSchedule()
    schedule.start(0)
    now, last_saved = 0.0, -100
    for step in range(1, 2000):
        writing = step - last_saved <= 2
        now += 0.7 if writing else 0.5
        schedule.step_done(now, writing=writing)
        if schedule.due(step):
            schedule.adopt(step, schedule.saved(step, stall=0.001, began=now, write_seconds=1.4))
            now += 0.001
            last_saved = step
    assert schedule.mean_interference == pytest.approx(0.4)
    assert schedule.interval == 81


def test_without_interference_the_stall_alone_decides() -> None:
    schedule = SaveSchedule()
    schedule.start(0)
    now = 0.0
    for step in range(1, 200):
        now += 0.5
        schedule.step_done(now, writing=False)
        if schedule.due(step):
            schedule.adopt(step, schedule.saved(step, stall=0.1, began=now))
            now += 0.1
    assert schedule.mean_interference is None and schedule.interval == 20
