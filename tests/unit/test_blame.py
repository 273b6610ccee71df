"""Whose failure a restart is recorded as when a survivor's report of a peer's failure came first
(:mod:`tfelastic.daemon.rendezvous.blame` inside the rendezvous state machine). Pure logic over a fake clock."""

from __future__ import annotations

from tfelastic.daemon.rendezvous.api import FailureCause, JobState, RestartReason
from tfelastic.daemon.rendezvous.state import Rendezvous

from tests.fakes import FakeClock
from tests.unit.test_quarantine import COOLDOWN, IDS, rejoin_each
from tests.unit.test_rendezvous_state import at, running, stops

PEER = "trainer saw a peer fail (not its own fault): exited with code 1: UnavailableError: Collective ops is aborted"
KILLED = "trainer was killed by SIGKILL"


def peer_first(clock: FakeClock, now: float = 10.0) -> Rendezvous:
    """A 2:3 job on a, b, c whose survivor a reports a peer's failure first: the generation stops at once."""
    rv = running(clock, IDS)
    at(clock, rv, now)
    sends = rv.worker_failed("a", rv.generation, RestartReason.WORKER_EXIT, PEER, FailureCause.PEER_FAILURE)
    assert sends == stops(rv.generation, IDS, RestartReason.WORKER_EXIT)  # no delay waiting for the root cause
    # Counted in the total and the budget now; by reason once the record is final (counters never go down).
    assert (rv.restarts_total, rv.status().restarts_by_reason) == (1, {})
    return rv


def test_the_dead_workers_report_after_a_survivors_replaces_it_in_the_restarts_record() -> None:
    clock = FakeClock()
    rv = peer_first(clock)
    assert rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, KILLED, FailureCause.SIGNAL) == []  # stopping already
    assert rv.reason == f"worker_exit: c: {KILLED}"
    assert rv.goodput.lines[-1].ended == f"worker_exit: c: {KILLED}"
    assert rv.status().restarts_by_reason == {"worker_exit": 1} and rv.restarts_total == 1


def test_a_lost_node_after_a_survivors_report_is_the_restarts_cause_and_its_count_moves() -> None:
    clock = FakeClock()
    rv = peer_first(clock)
    assert rv.disconnect("c") == []
    assert rv.reason == "node_lost: c: its session closed"
    assert rv.goodput.lines[-1].ended == "node_lost: c: its session closed"
    assert rv.status().restarts_by_reason == {"node_lost": 1} and rv.restarts_total == 1


def test_a_peers_failure_is_never_a_strike_and_the_root_cause_is() -> None:
    """quarantine_after=2: c, the root cause twice, is set aside; a, which reported first twice, is not."""
    clock = FakeClock()
    rv = peer_first(clock)
    rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, KILLED, FailureCause.SIGNAL)
    rejoin_each(rv, IDS)
    assert (rv.state, rv.generation) == (JobState.RUNNING, 2)
    at(clock, rv, 20.0)
    rv.worker_failed("a", 2, RestartReason.WORKER_EXIT, PEER, FailureCause.PEER_FAILURE)
    assert rv.reason == f"worker_exit: a: {PEER}"  # no strike, no quarantine: a's record so far
    rv.worker_failed("c", 2, RestartReason.WORKER_EXIT, KILLED, FailureCause.SIGNAL)
    assert rv.reason == f"worker_exit: c: {KILLED}; c quarantined for {COOLDOWN:g}s"
    assert not rv.quarantine.is_held("a") and rv.quarantine.is_held("c")


def test_without_a_root_cause_the_survivors_report_stays_and_a_later_generation_is_not_rewritten() -> None:
    clock = FakeClock()
    rv = peer_first(clock)
    rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, PEER, FailureCause.PEER_FAILURE)  # another survivor
    assert rv.reason == f"worker_exit: a: {PEER}"
    assert rv.durable(0.0).restarts_by_reason == {"worker_exit": 1}  # a successor counts it as first reported
    rejoin_each(rv, IDS)
    assert rv.status().restarts_by_reason == {"worker_exit": 1}  # final at the next generation
    assert rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, KILLED, FailureCause.SIGNAL) == []  # stale
    assert rv.goodput.lines[0].ended == f"worker_exit: a: {PEER}" and not rv.goodput.lines[1].ended
    assert not rv.quarantine.is_held("a")


def test_a_failure_of_its_own_first_is_the_restarts_cause_whatever_follows() -> None:
    clock = FakeClock()
    rv = running(clock, IDS)
    at(clock, rv, 10.0)
    rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, KILLED, FailureCause.SIGNAL)
    rv.worker_failed("a", 1, RestartReason.STALLED, "no progress for 20.0s", FailureCause.HANG)
    assert rv.reason == f"worker_exit: c: {KILLED}"


def test_an_exception_or_a_report_without_a_cause_may_be_a_survivors_echo_and_takes_no_blame() -> None:
    """An NCCL error the agent does not know as a peer's, or an agent of 0.3.0 that sends no cause."""
    clock = FakeClock()
    rv = peer_first(clock)
    rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "trainer exited with code 1: InternalError: NCCL error",
                     FailureCause.EXCEPTION)
    rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, "trainer exited with code 1")  # no cause: an old agent
    assert rv.reason == f"worker_exit: a: {PEER}"
    assert not rv.quarantine.is_held("b") and not rv.quarantine.is_held("c")
    rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, KILLED, FailureCause.SIGNAL)  # the root cause still counts
    assert rv.reason == f"worker_exit: c: {KILLED}"
