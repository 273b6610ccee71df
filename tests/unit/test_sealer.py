"""The fast tier's sealer thread (trainer/sealer.py): jobs run in order in a thread of their own, and a job's
error is handed to the caller once, without stopping the jobs after it."""

from __future__ import annotations

import threading

from tfelastic.trainer.sealer import Sealer


def test_jobs_run_in_order_in_the_sealers_thread_and_wait_returns_once_all_ran() -> None:
    ran: list[tuple[int, str]] = []
    gate = threading.Event()

    def seal(job: int) -> None:
        gate.wait(10)
        ran.append((job, threading.current_thread().name))

    sealer: Sealer[int] = Sealer(seal)
    for job in (1, 2, 3):
        sealer.submit(job)
    assert ran == []  # the caller is not held up by the jobs
    gate.set()
    sealer.wait()
    assert ran == [(1, "tfelastic-seal"), (2, "tfelastic-seal"), (3, "tfelastic-seal")]
    sealer.stop()


def test_an_error_is_handed_over_once_and_the_next_jobs_still_run() -> None:
    ran: list[int] = []

    def seal(job: int) -> None:
        if job == 2:
            raise OSError(f"job {job} failed")
        ran.append(job)

    sealer: Sealer[int] = Sealer(seal)
    assert sealer.take_error() is None
    for job in (1, 2, 3):
        sealer.submit(job)
    sealer.wait()
    error = sealer.take_error()
    assert isinstance(error, OSError) and str(error) == "job 2 failed"
    assert sealer.take_error() is None
    assert ran == [1, 3]
    sealer.stop()


def test_stop_runs_the_jobs_submitted_then_ends_the_thread_and_a_later_job_starts_a_new_one() -> None:
    ran: list[int] = []
    sealer: Sealer[int] = Sealer(ran.append)
    sealer.stop()  # never started: nothing to stop
    sealer.submit(1)
    sealer.stop()
    assert ran == [1]
    assert not [t for t in threading.enumerate() if t.name == "tfelastic-seal"]
    sealer.submit(2)
    sealer.wait()
    assert ran == [1, 2]
    sealer.stop()
