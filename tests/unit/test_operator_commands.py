"""The coordinator's operator commands (drain, restart), as pure state-machine logic over a fake clock."""

from __future__ import annotations

import pytest
from tfelastic.daemon.rendezvous.api import (
    DrainNode,
    JobClosedError,
    JobState,
    NodeState,
    OperatorRefusedError,
    RestartReason,
    Send,
    UnknownNodeError,
)
from tfelastic.daemon.rendezvous.state import RESTART_ABSORB_SECONDS

from tests.fakes import FakeClock
from tests.unit.test_rendezvous_state import assignments, at, join, rejoin, rejoin_all, running, state_of, stops


def test_drain_orders_the_node_to_leave_and_changes_nothing_until_it_does() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    assert rv.drain("b", "disk replacement") == [Send("b", DrainNode("disk replacement"))]
    assert state_of(rv) is JobState.RUNNING and rv.restarts_total == 0


def test_drained_node_leaving_reforms_without_it_and_does_not_spend_the_budget() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"], max_restarts=0)
    rv.drain("b", "maintenance")
    assert rv.leave("b", "drained: maintenance") == stops(1, ["a", "c"], RestartReason.NODE_LEFT)
    rejoin(rv, "a")
    rv.disconnect("b")
    assert rejoin(rv, "c") == assignments(2, ["a", "c"], restarts=1)
    assert state_of(rv) is JobState.RUNNING  # max_restarts=0, yet not failed: a drain is not a failure


def test_drain_below_min_nodes_is_refused_unless_forced() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    with pytest.raises(OperatorRefusedError, match=r"leave 1 node\(s\), below min_nodes=2.*--force"):
        rv.drain("a", "x")
    assert rv.drain("a", "x", force=True) == [Send("a", DrainNode("x"))]


def test_drain_counts_nodes_already_leaving() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    rv.leave("c", "SIGTERM")
    with pytest.raises(OperatorRefusedError, match="below min_nodes=2"):
        rv.drain("a", "x")


def test_drain_of_a_standby_node_is_allowed_and_a_second_drain_of_a_leaving_node_is_a_no_op() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    join(rv, "d")  # standby at max_nodes=3
    assert rv.drain("d", "x") == [Send("d", DrainNode("x"))]
    rv.leave("a", "SIGTERM")
    assert rv.drain("a", "x") == []


def test_drain_of_an_unknown_node_names_the_known_ones() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    with pytest.raises(UnknownNodeError, match=r"'zz' is not in job 'mnist' \(nodes: a, b\)"):
        rv.drain("zz", "x")


def test_drain_after_the_job_ended_is_refused() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    rv.worker_succeeded("a", 1)
    rv.worker_succeeded("b", 1)
    with pytest.raises(JobClosedError, match="already succeeded"):
        rv.drain("a", "x")


def test_restart_stops_every_member_and_the_same_nodes_reform_in_the_same_order() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"], max_restarts=0)
    assert rv.restart_job("new data")[0] == stops(1, ["a", "b", "c"], RestartReason.OPERATOR_RESTART)
    assert rv.reason == "operator_restart: new data"
    assert rejoin_all(rv, "c", "b", "a") == assignments(2, ["a", "b", "c"], restarts=1)
    assert rv.status().restarts_by_reason == {"operator_restart": 1}
    assert state_of(rv) is JobState.RUNNING  # not counted against max_restarts=0


def test_restart_is_refused_unless_the_job_is_running() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1")  # a restart no operator asked for
    with pytest.raises(OperatorRefusedError, match=r"is restarting.*only a running job can be restarted"):
        rv.restart_job("second")
    at(clock, rv, clock.now + 1)
    assert [n.state for n in rv.status().nodes] == [NodeState.STOPPING] * 3


def test_a_second_restart_while_the_first_is_under_way_is_absorbed_into_it() -> None:
    """Two operators (or one, twice) asking at once get one restart; the second is told so."""
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2)
    sends, said = rv.restart_job("first")
    assert sends == stops(1, ["a", "b"], RestartReason.OPERATOR_RESTART)
    assert said == "restarting job mnist from generation 1: every trainer checkpoints and stops, and the same " \
                   "nodes re-form"
    at(clock, rv, clock.now + RESTART_ABSORB_SECONDS + 5)  # stopping takes long: it is still under way
    sends, said = rv.restart_job("second")
    assert sends == []
    assert said == ("absorbed into the restart of job mnist from generation 1 that an operator asked for 15.0s ago "
                    "(first), still under way: no second restart")
    assert rejoin_all(rv, "a", "b") == assignments(2, ["a", "b"], restarts=1)
    assert rv.status().restarts_by_reason == {"operator_restart": 1}


def test_a_second_restart_that_arrives_after_the_first_re_formed_is_absorbed_into_it() -> None:
    """The stop and re-formation take milliseconds when the trainers exit at once: a command sent with the first
    arrives after generation 2 formed, and must not stop it again."""
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2)
    rv.restart_job("first")
    assert rejoin_all(rv, "a", "b") == assignments(2, ["a", "b"], restarts=1)
    at(clock, rv, clock.now + 0.5)
    sends, said = rv.restart_job("first, sent twice")
    assert sends == []
    assert said == ("absorbed into the restart of job mnist from generation 1 that an operator asked for 0.5s ago "
                    "(first); generation 2 runs now: no second restart (ask again after 10s for another)")
    assert (rv.generation, rv.status().restarts_by_reason) == (2, {"operator_restart": 1})


def test_a_restart_after_the_window_is_a_restart_of_its_own() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2)
    rv.restart_job("first")
    rejoin_all(rv, "a", "b")
    at(clock, rv, clock.now + RESTART_ABSORB_SECONDS)
    sends, said = rv.restart_job("again, on purpose")
    assert sends == stops(2, ["a", "b"], RestartReason.OPERATOR_RESTART)
    assert said.startswith("restarting job mnist from generation 2")
