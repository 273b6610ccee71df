"""Unit tests of hang detection (:mod:`tfelastic.daemon.worker.stall`) on a fake clock: no sleeps."""

from __future__ import annotations

from tfelastic.daemon.worker.stall import StallDetector

from tests.fakes import FakeClock


def detector(timeout: float = 10.0) -> tuple[StallDetector, FakeClock]:
    clock = FakeClock(1000.0)
    return StallDetector(timeout, clock), clock


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
    stall.progress(training_done=True)
    clock.now += 1000.0
    assert stall.stalled() is False and stall.newly_stalled() is None
    stall.progress()  # another fit, an evaluation that reports: watched again
    clock.now += 10.5
    assert stall.stalled() is True


def test_a_new_worker_is_not_paused_by_the_last_ones_completion() -> None:
    stall, clock = detector(timeout=10.0)
    stall.progress(training_done=True)
    stall.reset()
    stall.progress()
    clock.now += 10.5
    assert stall.stalled() is True
