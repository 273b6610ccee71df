"""Unit tests of hang detection (:mod:`tfelastic.daemon.worker.stall`) on a fake clock: no sleeps."""

from __future__ import annotations

import pytest
from tfelastic.daemon.worker.stall import GAP_MEMORY_SECONDS, WARMUP_GAPS, StallDetector, StallLimits
from tfelastic.trainer.progress import Phase

from tests.fakes import FakeClock


def detector(timeout: float = 10.0) -> tuple[StallDetector, FakeClock]:
    """A fixed limit (--stall-timeout SECONDS)."""
    clock = FakeClock(1000.0)
    return StallDetector(StallLimits(fixed=timeout), clock), clock


DEFAULTS = StallLimits()


def learning(floor: float = DEFAULTS.floor, allowance: float = 600.0) -> tuple[StallDetector, FakeClock]:
    """The default: a limit learned from the step times."""
    clock = FakeClock(1000.0)
    return StallDetector(StallLimits(floor=floor, allowance=allowance), clock), clock


def train(stall: StallDetector, clock: FakeClock, steps: int, gap: float, start: int = 0) -> int:
    """A worker's fit from its setup report: ``steps`` steps ``gap`` seconds apart; returns the last step."""
    stall.progress(start, Phase.SETUP)
    for step in range(start + 1, start + steps + 1):
        clock.now += gap
        stall.progress(step)
    return start + steps


def silent_until_stalled(stall: StallDetector, clock: FakeClock, tick: float = 0.5, most: float = 10_000.0
                         ) -> float:
    """Moves the clock in ticks until the detector says stalled; returns the silence then."""
    start = clock.now
    while not stall.stalled():
        assert clock.now - start < most, "never stalled"
        clock.now += tick
    return clock.now - start


def test_not_stalled_before_the_first_report_however_long_it_takes() -> None:
    stall, clock = detector()
    assert stall.silent_for() is None
    assert stall.stalled() is False
    clock.now += 1_000_000.0
    assert stall.silent_for() is None
    assert stall.stalled() is False


def test_stalled_only_strictly_after_the_timeout() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress()
    assert stall.silent_for() == 0.0
    assert stall.stalled() is False
    clock.now += 9.5
    assert stall.silent_for() == 9.5
    assert stall.stalled() is False
    clock.now += 0.5  # exactly the timeout: not yet
    assert stall.silent_for() == 10.0
    assert stall.stalled() is False
    clock.now += 0.25
    assert stall.silent_for() == 10.25
    assert stall.stalled() is True


def test_progress_resets_the_silence() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress()
    clock.now += 8.0
    stall.progress()
    clock.now += 8.0  # 16s since the first report, 8s since the last
    assert stall.silent_for() == 8.0
    assert stall.stalled() is False
    clock.now += 4.0
    assert stall.stalled() is True
    stall.progress()  # a stalled trainer that reports again is no longer stalled
    assert stall.silent_for() == 0.0
    assert stall.stalled() is False


def test_reset_forgets_the_last_report() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress()
    clock.now += 20.0
    assert stall.stalled() is True
    stall.reset()  # a new worker starts
    assert stall.silent_for() is None
    assert stall.stalled() is False
    clock.now += 100.0
    assert stall.stalled() is False  # not checked until its first report
    stall.progress()
    clock.now += 10.5
    assert stall.stalled() is True


def test_timeout_zero_disables_hang_detection() -> None:
    stall, clock = detector(timeout=0.0)
    stall.progress()
    clock.now += 1_000_000.0
    assert stall.silent_for() == 1_000_000.0
    assert stall.stalled() is False


def test_a_stall_is_reported_once_per_worker() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress()
    clock.now += 10.5
    assert stall.newly_stalled() == 10.5
    assert stall.newly_stalled() is None
    stall.reset()  # the next worker
    stall.progress()
    clock.now += 11.0
    assert stall.newly_stalled() == 11.0


def test_training_completed_pauses_the_check_until_the_next_report() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress(1, training_done=True)
    clock.now += 1000.0
    assert stall.stalled() is False and stall.newly_stalled() is None
    stall.progress()  # another fit, an evaluation that reports: watched again
    clock.now += 10.5
    assert stall.stalled() is True


def test_a_new_worker_is_not_paused_by_the_last_ones_completion() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress(1, training_done=True)
    stall.reset()
    stall.progress()
    clock.now += 10.5
    assert stall.stalled() is True


# ---------------------------------------------------------------------------------------------- learned limit


def test_fast_steps_are_caught_at_the_floor_once_warmed_up() -> None:
    stall, clock = learning()
    train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.3)
    assert stall.limit() == 5.0  # 8 x 0.3 s is under the floor
    assert stall.explain() == "learned limit 5.0s: 8 x the longest step gap 0.30s, floor 5s"
    assert silent_until_stalled(stall, clock) == 5.5


def test_steps_under_a_second_are_caught_within_eight_seconds() -> None:
    stall, clock = learning()
    train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.99)
    assert stall.limit() == pytest.approx(7.92)
    assert silent_until_stalled(stall, clock, tick=0.25) == 8.0


def test_steps_that_vary_five_fold_are_no_stall_even_if_the_warm_up_saw_only_the_fastest() -> None:
    stall, clock = learning()
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=1.0)
    assert stall.limit() == 8.0
    for _ in range(50):
        clock.now += 5.0  # a step five times the usual one
        assert not stall.stalled()
        stall.progress(step := step + 1)
    assert stall.limit() == 40.0


def test_a_silence_between_two_reports_of_one_step_is_learned_too() -> None:
    """A trainer with two reporters (its own callback's, then the instrumentation's) whose slow part comes between
    them: the silence to learn lies between two reports of the same step, and the warm-up still counts steps."""
    stall, clock = learning()
    stall.progress(0, Phase.SETUP)
    for step in range(1, WARMUP_GAPS + 3):
        clock.now += 0.03  # the step's computation
        stall.progress(step)  # its own report
        if step == WARMUP_GAPS:
            assert stall.explain().startswith("warm-up")  # nine gaps between steps so far, if eighteen silences
        clock.now += 0.9  # its slow part, then the instrumentation's report of the same step
        stall.progress(step)
    assert stall.limit() == pytest.approx(7.2)  # 8 x 0.9 s: not 8 x 0.03 s, which the floor would have hidden


def test_slow_steps_learn_eight_times_their_longest_gap() -> None:
    stall, clock = learning()
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=3.0)
    assert stall.limit() == pytest.approx(24.0)
    clock.now += 5.0  # one slower step raises it
    stall.progress(step + 1)
    assert stall.limit() == pytest.approx(40.0)
    assert silent_until_stalled(stall, clock) == 40.5


def test_during_the_warm_up_the_allowance_applies() -> None:
    stall, clock = learning(allowance=600.0)
    stall.progress(0, Phase.SETUP)
    assert stall.limit() == 600.0 and stall.explain() == "setup allowance 600s"
    train(stall, clock, steps=WARMUP_GAPS - 1, gap=0.2)  # one gap short
    assert stall.limit() == 600.0 and stall.explain() == "warm-up allowance 600s"
    assert silent_until_stalled(stall, clock, tick=10.0) == 610.0


def test_the_first_two_steps_of_a_worker_get_the_allowance_and_their_gaps_are_not_the_first_learned() -> None:
    stall, clock = learning()
    stall.progress(0)  # a custom loop's first report, before its first step: setup
    assert stall.explain() == "setup allowance 600s"
    stall.progress(0, Phase.SETUP)  # it announces its restore: a trainer that announces long work
    clock.now += 100.0  # the first step traces
    stall.progress(1)
    assert stall.limit() == 600.0  # the second may trace again
    for step in range(2, WARMUP_GAPS + 3):
        clock.now += 0.5
        stall.progress(step)
    assert stall.limit() == 5.0  # the 100 s of tracing was not learned


def test_a_save_gets_the_allowance_and_the_gap_after_it_is_not_learned() -> None:
    stall, clock = learning()
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    stall.progress(step, Phase.SAVE)
    assert stall.limit() == 600.0 and stall.explain() == "save allowance 600s"
    clock.now += 300.0  # a long save
    assert not stall.stalled()
    stall.progress(step)  # the save's end (the report that carries the checkpoint), at the same step
    assert stall.limit() == 5.0  # training again: the learned limit, at once
    clock.now += 0.5
    stall.progress(step + 1)
    assert stall.limit() == 5.0  # the 300 s were not learned


def test_evaluation_gets_the_allowance_until_training_reports_again() -> None:
    stall, clock = learning(allowance=100.0)
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    stall.progress(step, Phase.EVAL)
    clock.now += 90.0
    stall.progress(step, Phase.EVAL)  # evaluation batches
    assert silent_until_stalled(stall, clock) == 100.5
    stall.progress(step + 1)
    assert stall.limit() == 5.0


def test_a_new_worker_of_a_reporting_job_is_watched_from_its_launch_and_keeps_the_learned_gaps() -> None:
    stall, clock = learning(allowance=300.0)
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    stall.reset()  # the next generation's worker starts
    assert stall.silent_for() == 0.0 and stall.explain() == "setup allowance 300s"
    clock.now += 250.0
    stall.progress(step, Phase.SETUP)  # restored
    clock.now += 30.0
    stall.progress(step + 1)
    clock.now += 0.5
    stall.progress(step + 2)
    assert stall.limit() == 5.0  # no new warm-up: the same job steps as fast


def test_a_hang_in_start_up_is_caught_after_the_allowance() -> None:
    stall, clock = learning(allowance=300.0)
    train(stall, clock, steps=3, gap=0.5)
    stall.reset()
    assert silent_until_stalled(stall, clock, tick=1.0) == 301.0


def test_a_job_that_never_reported_is_not_watched_from_launch() -> None:
    stall, clock = learning()
    stall.reset()
    clock.now += 1_000_000.0
    assert stall.silent_for() is None and not stall.stalled()


def test_a_fixed_timeout_does_not_watch_the_start_up() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress(1)
    stall.reset()
    clock.now += 1000.0
    assert not stall.stalled()


def test_a_long_gap_is_remembered_for_an_hour_then_forgotten() -> None:
    stall, clock = learning()
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    clock.now += 8.0  # one slow step (a GC, a slow batch, a periodic callback)
    stall.progress(step := step + 1)
    assert stall.limit() == 64.0
    for _ in range(int(GAP_MEMORY_SECONDS / 60) - 2):  # 58 minutes of half-second steps: still remembered
        for _ in range(120):
            clock.now += 0.5
            stall.progress(step := step + 1)
    assert stall.limit() == 64.0
    for _ in range(240):
        clock.now += 0.5
        stall.progress(step := step + 1)
    assert stall.limit() == 5.0


def test_a_trainer_that_announces_no_phase_keeps_the_allowance() -> None:
    """A custom loop that calls report(step) around saves it does not announce: its gaps cannot be trusted."""
    stall, clock = learning(allowance=300.0)
    for step in range(1, WARMUP_GAPS + 20):
        clock.now += 0.5
        stall.progress(step)
    assert stall.limit() == 300.0 and stall.explain() == "no-phase allowance 300s"
    stall.progress(WARMUP_GAPS + 20, Phase.SAVE)  # once it announces one, its steps are learned
    stall.progress(WARMUP_GAPS + 20)
    assert stall.limit() == 5.0


def test_a_restores_jump_to_the_restored_step_is_not_a_step_made() -> None:
    stall, clock = learning()
    train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    stall.reset()
    stall.progress(0, Phase.SETUP)  # TrainLoop.restore: before the restore
    stall.progress(500, Phase.SETUP)  # TrainLoop.run: the restored step
    clock.now += 30.0
    stall.progress(501)  # the first step
    assert stall.limit() == 600.0  # the second step still gets the allowance
    clock.now += 0.5
    stall.progress(502)
    assert stall.limit() == 5.0


def test_training_completed_pauses_the_learned_check_too() -> None:
    stall, clock = learning()
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    stall.progress(step, training_done=True)
    clock.now += 10_000.0
    assert not stall.stalled()


def test_a_step_that_goes_back_does_not_count_as_progress_of_the_step() -> None:
    stall, clock = learning()
    step = train(stall, clock, steps=WARMUP_GAPS + 3, gap=0.5)
    clock.now += 5.0
    stall.progress(step - 3)  # a report from a stale view: still a sign of life, but no gap learned
    assert stall.limit() == 5.0
    assert stall.silent_for() == 0.0


def test_with_a_save_every_few_steps_the_gaps_between_saves_are_learned() -> None:
    """Reports come at most every 0.1 s: with fast steps and a save every 10 of them, each report either
    announces a save or ends one, and the training between two saves is what is learned."""
    stall, clock = learning()
    stall.progress(0, Phase.SETUP)
    for save in range(1, WARMUP_GAPS + 3):
        clock.now += 0.4  # ten steps
        stall.progress(10 * save, Phase.SAVE)
        clock.now += 3.0  # the save
        stall.progress(10 * save)  # the report that carries the checkpoint, at the same step
    assert stall.limit() == 5.0 and stall.explain().endswith("longest step gap 0.40s, floor 5s")
    assert silent_until_stalled(stall, clock) == 5.5
