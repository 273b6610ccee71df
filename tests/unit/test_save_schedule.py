"""When the fast tier saves (trainer/save_schedule.py): a fixed interval, or one adapted to an overhead budget
from the measured stall and step time. Pure: times are passed in."""

from __future__ import annotations

import itertools

import pytest
from tfelastic.trainer.save_schedule import (
    FIRST_INTERVAL,
    MAX_COPY_SECONDS,
    MAX_INTERVAL,
    MIN_COPY_SECONDS,
    SaveSchedule,
)


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
    assert schedule.mean_interference == pytest.approx(0.0, abs=1e-9) and schedule.interval == 20
    assert schedule.mean_copy_cost is None and schedule.copy_seconds == MIN_COPY_SECONDS


def test_the_step_after_a_save_is_charged_to_it() -> None:
    """A flash snapshot writes nothing in the background, but the step after it pays for it (0.5 s steps take
    0.6 s then): 0.1 s of interference and a 1 ms stall at 1 % is a save every 21 steps, not every step."""
    schedule = SaveSchedule()
    schedule.start(0)
    now, last_saved = 0.0, -100
    for step in range(1, 2000):
        now += 0.6 if step == last_saved + 1 else 0.5
        schedule.step_done(now, writing=False)
        if schedule.due(step):
            schedule.adopt(step, schedule.saved(step, stall=0.001, began=now))
            now += 0.001
            last_saved = step
    assert schedule.mean_interference == pytest.approx(0.1)
    assert schedule.interval == 21


def train_with_copies(schedule: SaveSchedule, copy_steps: int, slowdown: float, stall: float = 0.1,
                      steps: int = 20_000) -> list[float]:
    """0.5 s steps; after a save, a copy to the shared tier when ``copy_seconds`` have passed since the last,
    whose ``copy_steps`` steps take ``slowdown`` s more each. Returns when the copies began."""
    schedule.start(0)
    now, copies, copying_until = 0.0, [-1e9], -1
    for step in range(1, steps):
        copying = step <= copying_until
        now += 0.5 + (slowdown if copying else 0.0)
        schedule.step_done(now, writing=False, copying=copying, copy_began=step == copying_until - copy_steps + 1)
        if schedule.due(step):
            schedule.adopt(step, schedule.saved(step, stall=stall, began=now))
            now += stall
            if now - copies[-1] >= schedule.copy_seconds:
                copies.append(now)
                copying_until = step + copy_steps
    return copies[1:]


def test_a_dear_copy_to_the_shared_tier_is_paced_by_half_the_budget_and_the_saves_get_the_rest() -> None:
    """Copies that slow 3 steps by 0.4 s cost 1.2 s each: at half of 1 %, one every 240 s; the saves get the
    other half, so a 0.1 s stall is a save every ceil(0.1 / (0.005 * 0.5)) = 40 steps, not 20."""
    schedule = SaveSchedule()
    copies = train_with_copies(schedule, copy_steps=3, slowdown=0.4)
    assert schedule.mean_copy_cost == pytest.approx(1.2)
    assert schedule.copy_seconds == pytest.approx(240.0)
    assert schedule.interval == 40
    late = [b - a for a, b in itertools.pairwise(copies) if a > 1000]
    assert late and min(late) >= 240.0 and max(late) < 240.0 + 40 * 0.5 + 3 * 0.4 + 1  # the first save due after


def test_a_cheap_copy_keeps_the_floor_and_takes_only_what_it_costs_from_the_saves() -> None:
    """0.03 s per copy every 30 s is 0.1 %; the saves get 0.9 %: ceil(0.1 / (0.009 * 0.5)) = 23 steps."""
    schedule = SaveSchedule()
    train_with_copies(schedule, copy_steps=1, slowdown=0.03)
    assert schedule.copy_seconds == MIN_COPY_SECONDS
    assert schedule.interval == 23


def test_copies_come_at_least_every_max_copy_seconds_however_dear() -> None:
    """5 s per copy would be one every 1000 s at half the budget: a lost node would cost that much; capped."""
    schedule = SaveSchedule()
    train_with_copies(schedule, copy_steps=5, slowdown=1.0, steps=5000)
    assert schedule.mean_copy_cost == pytest.approx(5.0)
    assert schedule.copy_seconds == MAX_COPY_SECONDS
    assert schedule.interval == 40  # the saves keep half the budget


def test_copies_back_to_back_are_charged_each_though_no_quiet_step_ends_them() -> None:
    """Copies to slow storage, 80 steps of 0.5 s each 0.1 s slower (8 s a copy, 48 s long), where the pace allows
    one every 30 s: the next begins as soon as one ends. Its beginning ends the last one's window."""
    schedule = SaveSchedule()
    schedule.start(0)
    now, copy_ends, last_began = 0.0, -1, -1e9
    for step in range(1, 1000):
        began = step > 50 and step > copy_ends and now - last_began >= schedule.copy_seconds
        if began:
            last_began, copy_ends = now, step + 79
        copying = step <= copy_ends
        now += 0.6 if copying else 0.5
        schedule.step_done(now, writing=False, copying=copying, copy_began=began)
        if schedule.due(step):
            schedule.adopt(step, schedule.saved(step, stall=0.01, began=now))
            now += 0.01
    assert schedule.mean_copy_cost == pytest.approx(8.0)
    assert schedule.copy_seconds == MAX_COPY_SECONDS  # 1600 s at half of 1 %: capped
