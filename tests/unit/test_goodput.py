"""The goodput ledger (daemon/rendezvous/goodput.py) over a fake clock: every category, a failover, a job that
restarts, a generation that never trains, and the invariant that the categories add up to the wall time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tfelastic.daemon.rendezvous.goodput import CATEGORIES, ChiefReport, GoodputLedger

from tests.fakes import FakeClock


def ledger(start: float = 100.0) -> tuple[GoodputLedger, FakeClock]:
    clock = FakeClock(start)
    return GoodputLedger(clock), clock


def totals(book: GoodputLedger) -> dict[str, float]:
    return {c: round(v, 6) for c, v in book.now_totals().items() if v}


def started(book: GoodputLedger, step: int) -> None:
    """The chief resumed at ``step`` and its first step ended at once: the start-up ends now."""
    book.reported(ChiefReport(step))
    book.reported(ChiefReport(step + 1))


def trained(book: GoodputLedger, clock: FakeClock, seconds: float, step: int) -> None:
    """Generation 1 of one node formed, started at once, and trained ``seconds`` to ``step``."""
    book.formed(1, ["a"])
    started(book, 0)
    clock.now += seconds
    book.reported(ChiefReport(step))


def trained_then_failed(book: GoodputLedger, clock: FakeClock, furthest: int) -> None:
    """Generation 1 of one node trained 10 s to ``furthest``, failed at once, and generation 2 formed."""
    book.formed(1, ["a"])
    started(book, 0)
    clock.now += 10.0
    book.reported(ChiefReport(furthest))
    book.restarting("worker_exit: a: exit 1", planned=False)
    book.stopped()
    book.formed(2, ["a"])


def test_startup_then_training() -> None:
    book, clock = ledger()
    book.formed(1, ["a", "b"])
    clock.now += 3.0
    book.reported(ChiefReport(0))  # restored (or not): where it resumes
    clock.now += 1.0
    book.reported(ChiefReport(1))  # its first step: start-up was 4 s
    clock.now += 10.0
    book.reported(ChiefReport(100))
    assert totals(book) == {"startup": 4.0, "training": 10.0}
    [line] = book.lines
    assert (line.restored_step, line.startup_seconds, line.steps_redone) == (0, 4.0, 0)
    assert book.goodput() == pytest.approx(10 / 14)


def test_the_first_step_after_the_restore_is_startup_and_the_restore_is_the_resume_point() -> None:
    """Its first step traces, compiles and waits for every worker's first collective: start-up, as the reference
    run's training time leaves it out; the step the restore reported is where the generation resumed."""
    book, clock = ledger()
    trained_then_failed(book, clock, 100)
    clock.now += 2.0
    book.reported(ChiefReport(60))  # the restore's report, before any step
    clock.now += 0.5
    book.reported(ChiefReport(60))  # the setup report: still the start-up
    clock.now += 3.0
    book.reported(ChiefReport(61))  # the first step, 3 s of tracing and waiting
    clock.now += 3.9
    book.reported(ChiefReport(100))  # 39 redone
    assert totals(book) == {"training": 10.0, "startup": 5.5, "redone": 3.9}
    second = book.lines[-1]
    assert (second.restored_step, second.steps_redone, second.startup_seconds) == (60, 40, 5.5)


def test_a_failure_costs_detection_stopping_waiting_startup_and_the_redone_steps() -> None:
    book, clock = ledger()
    book.formed(1, ["a", "b"])
    clock.now += 2.0
    started(book, 0)
    clock.now += 10.0
    book.reported(ChiefReport(100))  # the furthest step: 100
    clock.now += 20.0  # a hang: no report until the verdict
    book.restarting("stalled: b: no progress for 20.0s", planned=False)
    clock.now += 0.3
    book.stopped()
    clock.now += 1.0  # backoff
    book.formed(2, ["a", "b"])
    clock.now += 3.0
    started(book, 60)  # resumed at the checkpoint of step 60
    clock.now += 4.0
    book.reported(ChiefReport(100))  # 40 steps redone (the first one in the start-up)
    clock.now += 1.0
    book.reported(ChiefReport(110))  # 10 new
    assert totals(book) == {"startup": 5.0, "training": 11.0, "detection": 20.0, "stopping": 0.3, "waiting": 1.0,
                            "redone": 4.0}
    first, second = book.lines
    assert first.ended == "stalled: b: no progress for 20.0s"
    assert first.badput() == pytest.approx(2.0 + 20.0 + 0.3 + 1.0)  # its own start-up, and all its end cost
    assert (second.restored_step, second.steps_redone, second.startup_seconds) == (60, 40, 3.0)


def test_the_chiefs_last_report_read_before_the_fault_dates_it() -> None:
    """Its agent forwards reports at its heartbeats: the decision followed a report 0.4 s older than the last one
    it had read. That report, sent after the decision, moves those 0.4 s from detection back to training."""
    book, clock = ledger()
    trained(book, clock, 10.0, 100)
    clock.now += 2.0  # the fault came 0.4 s after that report; its verdict 1.6 s later
    book.restarting("worker_exit: b: exit 1", planned=False)
    clock.now += 0.1
    book.reached(ChiefReport(108, at=clock.now - 1.7))  # read 0.4 s after the report of step 100
    assert totals(book) == {"training": 10.4, "detection": 1.6, "stopping": 0.1}
    assert book.furthest_step == 108
    assert book.lines[-1].seconds["detection"] == pytest.approx(1.6)


def test_a_second_late_report_dates_the_rest_and_a_new_generation_takes_none() -> None:
    book, clock = ledger()
    trained(book, clock, 10.0, 100)
    clock.now += 2.0
    book.restarting("worker_exit: b: exit 1", planned=False)
    book.reached(ChiefReport(104, at=clock.now - 1.8))  # a heartbeat in flight: 0.2 s
    book.reached(ChiefReport(108, at=clock.now - 1.6))  # the report sent with the stop: 0.2 s more
    assert totals(book) == {"training": 10.4, "detection": 1.6}
    book.stopped()
    book.formed(2, ["a"])
    book.reached(ChiefReport(120, at=clock.now))  # too late for generation 1; nothing for generation 2
    assert totals(book) == {"training": 10.4, "detection": 1.6} and book.furthest_step == 120


def test_a_planned_restart_or_a_report_without_new_steps_moves_nothing() -> None:
    for planned, step in ((True, 108), (False, 100)):
        book, clock = ledger()
        trained(book, clock, 10.0, 100)
        clock.now += 2.0
        book.restarting("r", planned=planned)
        book.reached(ChiefReport(step, at=clock.now - 1.0))
        assert totals(book) == ({"training": 12.0} if planned else {"training": 10.0, "detection": 2.0})


def test_a_report_that_crosses_the_furthest_step_is_split_by_steps() -> None:
    book, clock = ledger()
    trained_then_failed(book, clock, 100)
    started(book, 89)
    clock.now += 4.0
    book.reported(ChiefReport(130))  # 10 steps redone, 30 new: a quarter of the 4 s redone
    assert totals(book) == {"training": 13.0, "redone": 1.0}


def test_checkpoint_stalls_and_evaluation_are_their_own() -> None:
    book, clock = ledger()
    book.formed(1, ["a"])
    started(book, 0)
    clock.now += 10.0
    book.reported(ChiefReport(100, save_seconds=0.5, other_seconds=2.0))
    assert totals(book) == {"training": 7.5, "checkpoint": 0.5, "other": 2.0}


def test_a_planned_restart_is_not_detection() -> None:
    book, clock = ledger()
    trained(book, clock, 5.0, 50)
    clock.now += 1.0
    book.restarting("scale_up: 1 node(s) waiting to join", planned=True)
    clock.now += 2.0  # the trainers checkpoint and stop
    book.stopped()
    assert totals(book) == {"training": 6.0, "stopping": 2.0}


def test_a_generation_that_never_trains_is_all_startup_then_its_end() -> None:
    book, clock = ledger()
    book.formed(1, ["a", "b"])
    clock.now += 6.0  # the trainer dies while importing TensorFlow
    book.restarting("worker_exit: a: exit 1", planned=False)
    clock.now += 0.2
    book.stopped()
    assert totals(book) == {"startup": 6.0, "stopping": 0.2}
    assert book.lines[0].restored_step is None and book.lines[0].startup_seconds is None
    assert book.goodput() == 0.0


def test_the_end_closes_the_ledger() -> None:
    book, clock = ledger()
    book.formed(1, ["a"])
    started(book, 0)
    clock.now += 5.0
    book.finished("succeeded: every trainer of generation 1 exited 0")
    clock.now += 100.0  # nothing counts after the end
    assert totals(book) == {"training": 5.0}
    assert book.lines[0].ended == "succeeded: every trainer of generation 1 exited 0"


def test_after_the_chief_reports_its_training_done_the_time_to_its_exit_is_other() -> None:
    """Evaluation, export and the teardown of the input pipeline come after the last step: not training, though
    the chief's step is still the furthest (a 100 s teardown was booked as training before)."""
    book, clock = ledger()
    trained(book, clock, 10.0, 100)
    clock.now += 0.5
    book.reported(ChiefReport(101, done=True))  # its last step, then fit returned
    clock.now += 30.0  # tf.data's iterator is destroyed: no report
    book.reported(ChiefReport(101, save_seconds=1.0, done=True))  # a final save is still a save
    clock.now += 4.0
    book.reported(ChiefReport(101, save_seconds=1.0, other_seconds=3.0, done=True))  # an announced evaluation
    clock.now += 20.0  # the export, the exit
    book.finished("succeeded: every trainer of generation 1 exited 0")
    assert totals(book) == {"training": 10.5, "checkpoint": 1.0, "other": 53.0}


def test_a_second_fit_trains_again_after_the_first_ones_end() -> None:
    """Fine-tuning after a first fit: the gap between the two is other, the second fit's steps training."""
    book, clock = ledger()
    trained(book, clock, 10.0, 100)
    book.reported(ChiefReport(100, done=True))
    clock.now += 5.0
    book.reported(ChiefReport(101))  # the second fit's first step
    clock.now += 10.0
    book.reported(ChiefReport(200))
    assert totals(book) == {"training": 20.0, "other": 5.0}


def test_a_generation_resumed_at_the_end_ends_its_start_up_when_its_training_is_done() -> None:
    book, clock = ledger()
    trained(book, clock, 10.0, 100)
    book.restarting("worker_exit: a: exit 1", planned=False)
    book.stopped()
    book.formed(2, ["a"])
    clock.now += 5.0
    book.reported(ChiefReport(100))  # restored at the end
    clock.now += 1.0
    book.reported(ChiefReport(100, done=True))  # fit trained no step
    clock.now += 2.0
    book.finished("succeeded")
    assert totals(book) == {"training": 10.0, "startup": 6.0, "other": 2.0}
    assert book.lines[1].startup_seconds == 6.0 and book.lines[1].restored_step == 100


def test_a_failure_after_the_training_is_detection_from_the_last_report_and_a_successor_keeps_other() -> None:
    book, clock = ledger()
    trained(book, clock, 10.0, 100)
    book.reported(ChiefReport(100, done=True))
    clock.now += 3.0
    book.reported(ChiefReport(100, other_seconds=3.0, done=True))  # evaluating
    exported = book.export(wall_offset=0.0)
    successor = GoodputLedger(clock)
    successor.take_over(exported, 0.0)
    clock.now += 2.0  # the evaluation hangs
    assert totals(successor) == {"training": 10.0, "other": 5.0}
    successor.reported(ChiefReport(100, other_seconds=3.0, done=True))
    clock.now += 20.0
    successor.restarting("hang: a", planned=False)
    assert totals(successor) == {"training": 10.0, "other": 5.0, "detection": 20.0}


def test_nothing_counts_before_the_first_formation() -> None:
    book, clock = ledger()
    clock.now += 30.0  # the first round's last call
    book.reported(ChiefReport(5))
    book.restarting("x", planned=False)
    assert book.now_totals() == dict.fromkeys(CATEGORIES, 0.0) and book.goodput() is None


def test_a_successor_continues_the_ledger_and_its_open_interval() -> None:
    """etcd: the leader writes the ledger with the state; its successor (another clock) takes it over, and the
    time since the open interval started is counted, though nobody could write during the failover."""
    book, clock = ledger()
    book.formed(1, ["a", "b"])
    clock.now += 2.0
    started(book, 0)
    clock.now += 8.0
    book.reported(ChiefReport(80))
    exported = book.export(wall_offset=1_000_000.0)  # written at the last change of the job's state
    successor_clock = FakeClock(5.0)  # another process: another monotonic clock
    successor = GoodputLedger(successor_clock)
    successor_wall_offset = 1_000_000.0 + clock.now - successor_clock.now + 3.0  # 3 s later
    successor.take_over(exported, successor_wall_offset)
    assert totals(successor) == {"startup": 2.0, "training": 11.0}  # the 3 s of the failover: still training
    successor_clock.now += 1.0
    successor.reported(ChiefReport(120))
    assert totals(successor) == {"startup": 2.0, "training": 12.0}
    assert successor.lines[0].members == ("a", "b") and successor.lines[0].restored_step == 0


EVENTS = st.lists(st.tuples(st.sampled_from(["formed", "report", "done", "restart", "planned", "late", "stopped",
                                             "finished"]),
                            st.floats(0.0, 50.0), st.integers(0, 500), st.floats(0.0, 3.0)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_the_categories_always_add_up_to_the_wall_time(events: list[tuple[str, float, int, float]]) -> None:
    book, clock = ledger(0.0)
    started: float | None = None
    ended: float | None = None
    generation, save = 0, 0.0
    for kind, wait, step, saved in events:
        clock.now += wait
        if kind == "formed" and ended is None:
            generation += 1
            started = clock.now if started is None else started
            book.formed(generation, ["a"])
            save = 0.0
        elif kind in ("report", "done"):
            save += saved
            book.reported(ChiefReport(step, save_seconds=save, other_seconds=saved / 2, done=kind == "done"))
        elif kind in ("restart", "planned"):
            book.restarting("r", planned=kind == "planned")
        elif kind == "late":  # the chief's last report, read ``saved`` seconds ago, after the decision
            book.reached(ChiefReport(step, save_seconds=save, at=clock.now - saved))
        elif kind == "stopped":
            book.stopped()
        elif kind == "finished" and started is not None and ended is None:
            book.finished("done")
            ended = clock.now
    wall = 0.0 if started is None else (ended if ended is not None else clock.now) - started
    assert sum(book.now_totals().values()) == pytest.approx(wall, abs=1e-6)
    assert sum(sum(line.seconds.values()) for line in book.lines_now()) == pytest.approx(wall, abs=1e-6)
    assert all(v >= 0 for v in book.now_totals().values())
    assert all(v >= 0 for line in book.lines_now() for v in line.seconds.values())


# --------------------------------------------------------------------------------- in the coordinator


def test_the_coordinator_keeps_the_ledger_of_its_job() -> None:
    """Formation, the chief's reports (not the others'), a stall restart, the old workers gone, a backoff-free
    re-formation, the end: each second where it belongs, and the timeline's lines."""
    from tfelastic.daemon.rendezvous.api import JobState, RestartReason, WorkerProgress

    from tests.unit.test_rendezvous_state import at, rejoin_all, running

    clock = FakeClock(0.0)
    rv = running(clock, ["a", "b"])  # formed at 1.0, after the last call of a first formation
    formed = clock.now
    at(clock, rv, formed + 3.0)
    rv.progress("a", 1, WorkerProgress(step=0, reported_at=clock.now))  # the chief: where it resumed
    rv.progress("b", 1, WorkerProgress(step=1, reported_at=clock.now))  # not the chief: not counted
    rv.progress("a", 1, WorkerProgress(step=1, reported_at=clock.now))  # its first step: start-up ends
    at(clock, rv, formed + 13.0)
    rv.progress("a", 1, WorkerProgress(step=100, save_seconds=1.0, reported_at=clock.now))
    at(clock, rv, formed + 23.0)  # silent: a hang
    rv.worker_failed("b", 1, RestartReason.STALLED, "no progress for 10.0s")
    at(clock, rv, formed + 23.5)
    rejoin_all(rv, "a", "b")  # every old worker gone; the next generation forms at once
    at(clock, rv, formed + 26.5)
    rv.progress("a", 2, WorkerProgress(step=89, reported_at=clock.now))
    rv.progress("a", 2, WorkerProgress(step=90, reported_at=clock.now))
    at(clock, rv, formed + 27.5)
    rv.progress("a", 2, WorkerProgress(step=110, reported_at=clock.now))  # 10 redone, 10 new
    rv.worker_succeeded("a", 2)
    rv.worker_succeeded("b", 2)
    assert rv.state is JobState.SUCCEEDED
    at(clock, rv, formed + 100.0)  # nothing counts after the end
    goodput = rv.status().goodput
    assert goodput is not None
    assert {c: round(s, 6) for c, s in goodput.seconds.items() if s} == {
        "startup": 6.0, "training": 9.5, "checkpoint": 1.0, "detection": 10.0, "stopping": 0.5, "redone": 0.5}
    first, second = goodput.generations
    assert (first.ended, first.restored_step, first.startup_seconds) == ("stalled: b: no progress for 10.0s", 0, 3.0)
    assert (second.restored_step, second.steps_redone, second.ended) == (
        89, 11, "succeeded: every trainer of generation 2 exited 0")


def test_the_ledger_goes_to_the_durable_state_and_a_successor_continues_it() -> None:
    from tfelastic.daemon.rendezvous.api import JobState, WorkerProgress
    from tfelastic.daemon.rendezvous.state import Rendezvous

    from tests.unit.test_rendezvous_state import SETTINGS, at, running

    clock = FakeClock(0.0)
    rv = running(clock, ["a", "b"])
    at(clock, rv, clock.now + 2.0)
    rv.progress("a", 1, WorkerProgress(step=0, reported_at=clock.now))
    rv.progress("a", 1, WorkerProgress(step=1, reported_at=clock.now))
    at(clock, rv, clock.now + 8.0)
    rv.progress("a", 1, WorkerProgress(step=80, reported_at=clock.now))
    recorded = rv.durable(wall_offset=1_700_000_000.0)
    assert recorded.goodput is not None and recorded.goodput["activity"] == "training"
    successor_clock = FakeClock(clock.now + 1.0)
    successor = Rendezvous(SETTINGS, successor_clock)
    successor.take_over(recorded, 1_700_000_000.0, grace=2.0)
    assert successor.state is JobState.RUNNING
    goodput = successor.status().goodput
    assert goodput is not None and round(goodput.seconds["training"], 6) == 9.0
    assert round(goodput.seconds["startup"], 6) == 2.0


def test_the_chiefs_last_steps_reported_after_the_restart_decision_count_as_reached() -> None:
    """Its agent sends what the trainer reported since the last heartbeat when it is told to stop: the next
    generation's steps below it are redone."""
    from tfelastic.daemon.rendezvous.api import RestartReason, WorkerProgress

    from tests.unit.test_rendezvous_state import at, rejoin_all, running

    clock = FakeClock(0.0)
    rv = running(clock, ["a", "b"])
    at(clock, rv, clock.now + 1.0)
    rv.progress("a", 1, WorkerProgress(step=0, reported_at=clock.now))
    at(clock, rv, clock.now + 5.0)
    rv.progress("a", 1, WorkerProgress(step=100, reported_at=clock.now))
    rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "exit 1")
    rv.progress("a", 1, WorkerProgress(step=108, reported_at=clock.now))  # the flush at the stop order
    rv.progress("b", 1, WorkerProgress(step=109, reported_at=clock.now))  # not the chief: not the ledger's mark
    rejoin_all(rv, "a", "b")
    rv.progress("a", 2, WorkerProgress(step=100, reported_at=clock.now))
    goodput = rv.status().goodput
    assert goodput is not None and goodput.generations[-1].steps_redone == 8
    assert rv.status().steps_redone == 9  # status's count: any member's furthest


def test_the_chiefs_end_of_training_reaches_the_ledger_through_the_wire() -> None:
    """The agent's report says the trainer finished training; the coordinator books what follows as other."""
    from tfelastic.daemon.rendezvous import convert
    from tfelastic.daemon.rendezvous.api import JobState, WorkerProgress

    from tests.unit.test_rendezvous_state import at, running

    def wired(progress: WorkerProgress) -> WorkerProgress:
        return convert.progress_from_proto(convert.progress_to_proto(progress, clock.now), clock.now)

    clock = FakeClock(0.0)
    rv = running(clock, ["a", "b"])
    start = clock.now
    rv.progress("a", 1, wired(WorkerProgress(step=0, reported_at=clock.now)))
    rv.progress("a", 1, wired(WorkerProgress(step=1, reported_at=clock.now)))
    at(clock, rv, start + 10.0)
    rv.progress("a", 1, wired(WorkerProgress(step=100, reported_at=clock.now, training_done=True)))
    at(clock, rv, start + 50.0)  # the evaluation, the exit
    rv.worker_succeeded("a", 1)
    rv.worker_succeeded("b", 1)
    assert rv.state is JobState.SUCCEEDED
    goodput = rv.status().goodput
    assert goodput is not None
    assert {c: round(s, 6) for c, s in goodput.seconds.items() if s} == {"training": 10.0, "other": 40.0}


def test_each_line_keeps_the_furthest_step_its_chief_reported() -> None:
    book, clock = ledger()
    trained(book, clock, 10.0, 40)
    book.restarting("worker_exit: a: killed", planned=False)
    book.reached(ChiefReport(45, at=clock.now))  # read before the fault, heard after the decision
    book.formed(2, ["a"])
    assert book.lines[-1].reached_step is None
    started(book, 30)
    assert [line.reached_step for line in book.lines] == [45, 31]
    assert [g.reached_step for g in book.view(0.0).generations] == [45, 31]
