"""Unit tests of the coordinator's state machine (:mod:`tfelastic.daemon.rendezvous.state`).

Pure logic over a fake monotonic clock: no sleeps, no sockets, no threads. Every test asserts the exact orders
the coordinator returns, so a change in whom it tells what, or in which order, fails a test.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import pytest
from tfelastic.daemon.agent.runner import trainer_env
from tfelastic.daemon.rendezvous.api import (
    Assignment,
    ClusterStatus,
    DuplicateNodeError,
    Evict,
    Finished,
    GenerationSummary,
    GoodputView,
    JobClosedError,
    JobSpec,
    JobState,
    Member,
    NodeInfo,
    NodeState,
    NodeStatus,
    ProtocolError,
    RendezvousSettings,
    RestartReason,
    Send,
    SpecMismatchError,
    StopWorkers,
    Waiting,
    WorkerProgress,
)
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.goodput import CATEGORIES
from tfelastic.daemon.rendezvous.restarts import HEALTHY_RUN_SECONDS
from tfelastic.daemon.rendezvous.state import Rendezvous

from tests.fakes import FakeClock

WAIT = "waiting for the round to close"
SCALE_UP = "scale-up pending: the job will re-form to take this node in"
STANDBY = "standby: the job is at max_nodes=3"

# No backoff between failed generations here: the tests of rounds and the budget restart at once; the backoff
# has tests of its own (BACKOFF).
SETTINGS = RendezvousSettings(
    last_call_seconds=1.0, settle_seconds=3.0, join_timeout_seconds=600.0, node_timeout_seconds=2.0,
    restart_backoff_seconds=0.0
)
SPEC = JobSpec(
    job="mnist",
    command_digest=b"\x01" * 32,
    min_nodes=2,
    max_nodes=3,
    max_restarts=3,
    restart_window_seconds=3600.0,
    stall_timeout_seconds=300.0,
    backup_dir="/backup/mnist",
)
PORT = 2222


# ------------------------------------------------------------------------------------------------ helpers


def spec(**changes: Any) -> JobSpec:
    return dataclasses.replace(SPEC, **changes)


def info(node_id: str, **changes: Any) -> NodeInfo:
    return NodeInfo(node_id, f"{node_id}.cluster", PORT, **changes)


def members(ids: Sequence[str]) -> tuple[Member, ...]:
    return tuple(Member(n, rank, f"{n}.cluster", PORT) for rank, n in enumerate(ids))


def assignments(generation: int, ids: Sequence[str], restarts: int = 0) -> list[Send]:
    ms = members(ids)
    return [Send(n, Assignment(generation, rank, len(ids), ms, restarts)) for rank, n in enumerate(ids)]


def stops(generation: int, ids: Sequence[str], reason: RestartReason) -> list[Send]:
    return [Send(n, StopWorkers(generation, reason)) for n in ids]


def finished(ids: Sequence[str], state: JobState, reason: str) -> list[Send]:
    return [Send(n, Finished(state, reason)) for n in ids]


def waiting(node_id: str, joined: int, detail: str = WAIT, lo: int = 2, hi: int = 3) -> list[Send]:
    return [Send(node_id, Waiting(joined, lo, hi, detail))]


def at(clock: FakeClock, rv: Rendezvous, now: float) -> None:
    """Move the clock to ``now`` while every connected node keeps heartbeating."""
    clock.now = now
    for n in rv.status().nodes:
        rv.heartbeat(n.node_id)


def join(rv: Rendezvous, *ids: str) -> list[Send]:
    """New sessions join with the job's own spec."""
    sends: list[Send] = []
    for n in ids:
        sends += rv.join(info(n), rv.spec or SPEC)
    return sends


def rejoin(rv: Rendezvous, node_id: str) -> list[Send]:
    return rv.join(info(node_id, last_generation=rv.generation), rv.spec or SPEC, rejoin=True)


def rejoin_all(rv: Rendezvous, *ids: str) -> list[Send]:
    """Every id rejoins in turn; returns only the orders of the last rejoin."""
    sends: list[Send] = []
    for n in ids:
        sends = rejoin(rv, n)
    return sends


def new(clock: FakeClock, **changes: Any) -> Rendezvous:
    return Rendezvous(SETTINGS, clock, spec(**changes))


def running(clock: FakeClock, ids: Sequence[str], **changes: Any) -> Rendezvous:
    """A job whose first generation is ``ids`` in that rank order, formed at ``clock.now``."""
    rv = new(clock, **changes)
    sends = join(rv, *ids)
    if state_of(rv) is not JobState.RUNNING:
        at(clock, rv, clock.now + SETTINGS.last_call_seconds)
        sends = rv.tick()
    assert [s for s in sends if isinstance(s.order, Assignment)] == assignments(1, ids)
    return rv


def state_of(rv: Rendezvous) -> JobState:
    """The job state, read through a call so that mypy does not narrow it between two inputs."""
    return rv.state


def ranks(rv: Rendezvous) -> list[tuple[str, int, NodeState]]:
    return [(n.node_id, n.rank, n.state) for n in rv.status().nodes]


# ----------------------------------------------------------------------------------------- first round


def test_first_round_waits_below_min_nodes() -> None:
    clock = FakeClock()
    rv = new(clock)
    assert join(rv, "a") == waiting("a", 1)
    at(clock, rv, 100.0)
    assert rv.tick() == []
    assert state_of(rv) is JobState.WAITING
    assert rv.generation == 0
    assert ranks(rv) == [("a", -1, NodeState.WAITING)]


def test_first_round_closes_last_call_seconds_after_min_nodes() -> None:
    clock = FakeClock()
    rv = new(clock)
    assert join(rv, "a") == waiting("a", 1)
    at(clock, rv, 0.5)
    assert join(rv, "b") == waiting("b", 2)  # min reached: the last call starts now
    at(clock, rv, 1.4)
    assert rv.tick() == []
    assert state_of(rv) is JobState.WAITING
    at(clock, rv, 1.5)
    assert rv.tick() == assignments(1, ["a", "b"])
    assert state_of(rv) is JobState.RUNNING
    assert rv.generation == 1


def test_first_round_closes_at_max_nodes_without_waiting() -> None:
    clock = FakeClock()
    rv = new(clock)
    assert join(rv, "a", "b") == waiting("a", 1) + waiting("b", 2)
    at(clock, rv, 0.1)
    assert join(rv, "c") == assignments(1, ["a", "b", "c"])
    assert state_of(rv) is JobState.RUNNING


def test_first_round_ranks_follow_join_order_not_node_ids() -> None:
    clock = FakeClock()
    rv = new(clock, max_nodes=4)
    join(rv, "zed")
    at(clock, rv, 0.2)
    join(rv, "amy")
    at(clock, rv, 0.4)
    assert join(rv, "bob") == waiting("bob", 3, hi=4)
    at(clock, rv, 1.1)
    assert rv.tick() == []
    at(clock, rv, 1.2)
    assert rv.tick() == assignments(1, ["zed", "amy", "bob"])


def test_tf_config_lists_workers_in_rank_order_with_own_index() -> None:
    clock = FakeClock()
    rv = new(clock)
    nodes = [
        NodeInfo("a", "10.0.0.1", 2222),
        NodeInfo("b", "fd00::2", 2223),  # IPv6: bracketed in the address
        NodeInfo("c", "c.example", 2224),
    ]
    sends: list[Send] = []
    for n in nodes:
        sends = rv.join(n, SPEC)
    workers = ["10.0.0.1:2222", "[fd00::2]:2223", "c.example:2224"]
    assert [s.node_id for s in sends] == ["a", "b", "c"]
    for rank, send in enumerate(sends):
        assert isinstance(send.order, Assignment)
        assert (send.order.generation, send.order.rank, send.order.world_size) == (1, rank, 3)
        env = trainer_env({}, send.order, job="j", node_id=send.node_id, backup_dir="/b", progress_socket="/p",
                          instrument=False)  # what the agent makes of the assignment
        config = json.loads(env["TF_CONFIG"])
        assert config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


# ------------------------------------------------------------------------------------ restarts and ranks


def test_survivors_keep_order_and_new_nodes_are_appended() -> None:
    clock = FakeClock()
    rv = new(clock)
    join(rv, "c")
    at(clock, rv, 0.1)
    join(rv, "a")
    at(clock, rv, 1.1)
    assert rv.tick() == assignments(1, ["c", "a"])  # c joined first: c is chief
    at(clock, rv, 2.0)
    assert join(rv, "b") == waiting("b", 1, SCALE_UP)
    at(clock, rv, 2.5)
    assert rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1") == stops(
        1, ["c", "a"], RestartReason.WORKER_EXIT
    )
    assert rejoin(rv, "a") == waiting("a", 2)  # the non-chief comes back first
    assert rejoin(rv, "c") == assignments(2, ["c", "a", "b"], restarts=1)


def test_lost_chief_makes_next_lowest_survivor_rank_zero() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    at(clock, rv, 5.0)
    assert rv.disconnect("a") == stops(1, ["b", "c"], RestartReason.NODE_LOST)
    assert rv.reason == "node_lost: a: its session closed"
    assert rejoin(rv, "c") == waiting("c", 1)
    assert rejoin(rv, "b") == assignments(2, ["b", "c"], restarts=1)
    assert rv.status().restarts_by_reason == {"node_lost": 1}


def test_recovery_closes_as_soon_as_every_survivor_rejoined() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"], max_nodes=4)
    at(clock, rv, 5.0)
    assert rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "exit 3") == stops(
        1, ["a", "b", "c"], RestartReason.WORKER_EXIT
    )
    assert state_of(rv) is JobState.RESTARTING
    assert rv.reason == "worker_exit: b: exit 3"
    assert rejoin(rv, "a") == waiting("a", 1, hi=4)
    assert rejoin(rv, "b") == waiting("b", 2, hi=4)
    # Same instant: no last call after a restart, although 3 < max_nodes=4.
    assert rejoin(rv, "c") == assignments(2, ["a", "b", "c"], restarts=1)
    assert state_of(rv) is JobState.RUNNING
    assert (rv.generation, rv.restarts_total) == (2, 1)
    assert rv.status().restarts_by_reason == {"worker_exit": 1}


def _stopped_member_outstanding(clock: FakeClock) -> Rendezvous:
    """a, b, c running; c fails; a newcomer d and the survivors a and b join, c has not confirmed yet."""
    rv = running(clock, ["a", "b", "c"])
    rv.worker_failed("c", 1, RestartReason.WORKER_EXIT, "exit 1")
    assert join(rv, "d") == waiting("d", 1)
    assert rejoin(rv, "a") == waiting("a", 2)
    assert rejoin(rv, "b") == waiting("b", 3)  # max_nodes waiting, yet c's old worker may still run
    at(clock, rv, 100.0)
    assert rv.tick() == []
    assert state_of(rv) is JobState.RESTARTING
    assert ranks(rv) == [
        ("a", -1, NodeState.WAITING),
        ("b", -1, NodeState.WAITING),
        ("c", -1, NodeState.STOPPING),
        ("d", -1, NodeState.WAITING),
    ]
    return rv


def test_round_waits_for_stopping_member_then_closes_when_it_rejoins() -> None:
    clock = FakeClock()
    rv = _stopped_member_outstanding(clock)
    assert rejoin(rv, "c") == assignments(2, ["a", "b", "c"], restarts=1) + waiting("d", 1, STANDBY)


def test_round_waits_for_stopping_member_then_closes_when_it_disconnects() -> None:
    clock = FakeClock()
    rv = _stopped_member_outstanding(clock)
    assert rv.disconnect("c") == assignments(2, ["a", "b", "d"], restarts=1)
    assert rv.restarts_total == 1  # losing a member that was already told to stop is no new restart
    assert rv.status().restarts_by_reason == {"worker_exit": 1}


def test_rejoin_while_running_is_a_protocol_error() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    with pytest.raises(ProtocolError, match="'a' joined again while running"):
        rejoin(rv, "a")


# --------------------------------------------------------------------------------------- stale reports


def test_reports_of_an_older_generation_are_ignored() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2)
    rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1")
    assert rejoin_all(rv, "a", "b") == [
        Send(n, Assignment(2, r, 2, members(["a", "b"]), 1)) for r, n in enumerate(["a", "b"])
    ]
    assert rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "late report") == []
    assert rv.worker_failed("b", 3, RestartReason.WORKER_EXIT, "future report") == []
    assert rv.worker_succeeded("a", 1) == []
    rv.worker_started("a", 1, 4242)
    rv.progress("a", 1, WorkerProgress(step=10))
    assert (rv.state, rv.generation, rv.restarts_total) == (JobState.RUNNING, 2, 1)
    a = rv.status().nodes[0]
    assert (a.node_id, a.state, a.worker_pid, a.progress) == ("a", NodeState.RUNNING, 0, None)


def test_second_report_of_the_same_fault_adds_nothing() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    assert rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1") != []
    assert rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "exit 1") == []
    assert rv.worker_failed("c", 1, RestartReason.STALLED, "no progress") == []
    assert rv.restarts_total == 1
    assert rv.status().restarts_by_reason == {"worker_exit": 1}


# ---------------------------------------------------------------------------------------- join refusals


@pytest.mark.parametrize(
    ("field_name", "value", "fragment"),
    [
        ("job", "other", "job: job has 'mnist', joining agent has 'other'"),
        ("command_digest", b"\x02" * 32, "the trainer command differs"),
        ("min_nodes", 1, "min_nodes: job has 2, joining agent has 1"),
        ("max_nodes", 4, "max_nodes: job has 3, joining agent has 4"),
        ("max_restarts", 9, "max_restarts: job has 3, joining agent has 9"),
    ],
    ids=["job", "command_digest", "min_nodes", "max_nodes", "max_restarts"],
)
def test_spec_mismatch_names_the_differing_setting(field_name: str, value: object, fragment: str) -> None:
    clock = FakeClock()
    rv = Rendezvous(SETTINGS, clock)  # the first Join sets the spec
    join(rv, "a")
    with pytest.raises(SpecMismatchError) as excinfo:
        rv.join(info("b"), spec(**{field_name: value}))
    message = str(excinfo.value)
    assert fragment in message
    assert "job 'mnist'" in message
    assert message.count(";") == 0  # exactly one setting differs, exactly one is named
    assert "b" not in [n.node_id for n in rv.status().nodes]
    assert rv.spec == SPEC


def test_duplicate_node_id_on_a_new_session_is_refused() -> None:
    clock = FakeClock()
    rv = new(clock)
    join(rv, "a")
    with pytest.raises(DuplicateNodeError, match=r"'a'.*--node-id"):
        join(rv, "a")
    assert join(rv, "b") == waiting("b", 2)


def _formed_with_incarnations(clock: FakeClock, ids: Sequence[str], **changes: Any) -> Rendezvous:
    """A running first generation whose agents name their process (incarnation ``inc-<id>``), as real ones do."""
    rv = new(clock, **changes)
    for n in ids:
        rv.join(info(n, incarnation=f"inc-{n}"), rv.spec or SPEC)
    if state_of(rv) is not JobState.RUNNING:
        at(clock, rv, clock.now + SETTINGS.last_call_seconds)
        rv.tick()
    assert state_of(rv) is JobState.RUNNING and rv.generation == 1
    return rv


def test_the_same_agent_on_a_new_session_replaces_its_old_one() -> None:
    """An agent that gave up on its stream before the coordinator noticed joins again from the same process: that
    counts as the node lost (the others stop) and found again, not as a duplicate."""
    clock = FakeClock()
    rv = _formed_with_incarnations(clock, ["a", "b"], max_nodes=2)
    sends = rv.join(info("a", incarnation="inc-a", last_generation=1, last_rank=0), rv.spec or SPEC)
    assert Send("b", StopWorkers(1, RestartReason.NODE_LOST)) in sends
    assert rv.restarts.by_reason == {RestartReason.NODE_LOST.value: 1}
    assert {n.node_id: n.state for n in rv.status().nodes}["a"] is NodeState.WAITING


def test_another_process_with_a_members_id_is_a_duplicate() -> None:
    clock = FakeClock()
    rv = _formed_with_incarnations(clock, ["a", "b"], max_nodes=2)
    with pytest.raises(DuplicateNodeError, match=r"'a'.*--node-id"):
        rv.join(info("a", incarnation="another-process"), rv.spec or SPEC)
    assert state_of(rv) is JobState.RUNNING and rv.restarts.total == 0


def test_a_reconnection_that_spends_the_last_restart_tells_the_node_the_verdict() -> None:
    clock = FakeClock()
    rv = _formed_with_incarnations(clock, ["a", "b"], max_nodes=2, max_restarts=0)
    sends = rv.join(info("a", incarnation="inc-a", last_generation=1, last_rank=0), rv.spec or SPEC)
    assert state_of(rv) is JobState.FAILED
    assert sends[-1] == Send("a", Finished(JobState.FAILED, rv.reason))
    assert Send("b", Finished(JobState.FAILED, rv.reason)) in sends


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED])
def test_join_after_the_job_finished_is_refused(state: JobState) -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2, max_restarts=0)
    if state is JobState.SUCCEEDED:
        rv.worker_succeeded("a", 1)
        rv.worker_succeeded("b", 1)
    else:
        rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1")
    assert rv.state is state
    with pytest.raises(JobClosedError, match=f"'mnist' has already {state.value}"):
        join(rv, "c")
    assert "c" not in [n.node_id for n in rv.status().nodes]


# ----------------------------------------------------------------------------------------------- faults


def test_worker_failure_stops_every_member_and_counts_a_restart() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    at(clock, rv, 10.0)
    assert rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "exit code 3") == stops(
        1, ["a", "b", "c"], RestartReason.WORKER_EXIT
    )
    assert state_of(rv) is JobState.RESTARTING
    assert rv.reason == "worker_exit: b: exit code 3"
    assert rv.restarts_total == 1
    assert rv.status().restarts_by_reason == {"worker_exit": 1}
    assert rejoin_all(rv, "c", "b", "a") == assignments(2, ["a", "b", "c"], restarts=1)


def test_stall_stops_every_member_with_reason_stalled() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    assert rv.worker_failed("a", 1, RestartReason.STALLED, "no progress for 300s") == stops(
        1, ["a", "b"], RestartReason.STALLED
    )
    assert rv.reason == "stalled: a: no progress for 300s"
    assert rv.status().restarts_by_reason == {"stalled": 1}
    assert rejoin_all(rv, "a", "b") == assignments(2, ["a", "b"], restarts=1)


def test_node_lost_when_its_lease_expires() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])  # formed at t=0 (max_nodes joined), everyone seen then
    clock.now = 1.5
    rv.heartbeat("a")
    rv.heartbeat("c")
    clock.now = 2.0
    assert rv.tick() == []  # b silent for exactly node_timeout: not yet lost
    clock.now = 2.5
    assert rv.tick() == [
        Send("b", Evict("no message for 2.5s")),
        *stops(1, ["a", "c"], RestartReason.NODE_LOST),
    ]
    assert "b" not in [n.node_id for n in rv.status().nodes]
    assert rv.reason == "node_lost: b: silent for 2.5s"
    assert rv.status().restarts_by_reason == {"node_lost": 1}
    assert rejoin_all(rv, "c", "a") == assignments(2, ["a", "c"], restarts=1)


def test_heartbeats_keep_the_lease() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    for t in range(2, 50):
        at(clock, rv, float(t))
        assert rv.tick() == []
    assert (rv.state, rv.generation) == (JobState.RUNNING, 1)


def test_node_lost_when_its_session_closes() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    assert rv.disconnect("c") == stops(1, ["a", "b"], RestartReason.NODE_LOST)
    assert rv.reason == "node_lost: c: its session closed"
    assert rv.disconnect("c") == []  # a second close of the same session is harmless
    assert rv.restarts_total == 1


def test_losing_a_standby_does_not_restart_the_job() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    assert join(rv, "d") == waiting("d", 1, STANDBY)
    assert rv.disconnect("d") == []
    assert (rv.state, rv.generation, rv.restarts_total) == (JobState.RUNNING, 1, 0)


def test_planned_leave_restarts_without_spending_the_budget() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"], max_restarts=1)
    at(clock, rv, 10.0)
    assert rv.leave("b", "SIGTERM") == stops(1, ["a", "c"], RestartReason.NODE_LEFT)
    assert state_of(rv) is JobState.RESTARTING
    assert rv.reason == "node_left: b: SIGTERM"
    assert rejoin(rv, "a") == waiting("a", 1)
    assert rejoin(rv, "c") == waiting("c", 2)  # b's workers are not confirmed gone until its session closes
    assert ("b", -1, NodeState.LEAVING) in ranks(rv)
    assert rv.disconnect("b") == assignments(2, ["a", "c"], restarts=1)
    assert rv.status().restarts_by_reason == {"node_left": 1}
    # max_restarts=1: had the leave counted, this first failure would end the job.
    assert rv.worker_failed("a", 2, RestartReason.WORKER_EXIT, "exit 1") == stops(
        2, ["a", "c"], RestartReason.WORKER_EXIT
    )
    assert state_of(rv) is JobState.RESTARTING
    assert rv.restarts_total == 2


# --------------------------------------------------------------------------------------------- scale-up


def test_scale_up_after_settle_keeps_old_ranks() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_restarts=0)  # formed at t=1.0
    at(clock, rv, 2.0)
    assert join(rv, "c") == waiting("c", 1, SCALE_UP)
    assert state_of(rv) is JobState.RUNNING
    at(clock, rv, 4.9)
    assert rv.tick() == []
    at(clock, rv, 5.0)
    assert rv.tick() == stops(1, ["a", "b"], RestartReason.SCALE_UP)
    assert rv.reason == "scale_up: 1 node(s) waiting to join"
    assert rejoin(rv, "b") == waiting("b", 2)
    assert rejoin(rv, "a") == assignments(2, ["a", "b", "c"], restarts=1)
    assert state_of(rv) is JobState.RUNNING  # max_restarts=0, yet a scale-up is no failure
    snap = rv.status()
    assert (snap.world_size, snap.restarts_total, snap.restarts_by_reason) == (3, 1, {"scale_up": 1})


def test_join_at_max_nodes_is_a_standby_and_does_not_scale_up() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    at(clock, rv, 1.0)
    assert join(rv, "d") == waiting("d", 1, STANDBY)
    for t in (4.0, 7.0, 30.0):
        at(clock, rv, t)
        assert rv.tick() == []
    assert (rv.state, rv.generation, rv.restarts_total) == (JobState.RUNNING, 1, 0)
    assert ranks(rv)[-1] == ("d", -1, NodeState.WAITING)
    rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1")
    assert rejoin_all(rv, "c", "b", "a") == assignments(2, ["a", "b", "c"], restarts=1) + waiting(
        "d", 1, STANDBY
    )


# --------------------------------------------------------------------------------------- restart budget


def _fail_and_recover(rv: Rendezvous, clock: FakeClock, now: float, ids: Sequence[str]) -> None:
    at(clock, rv, now)
    generation = rv.generation
    assert rv.worker_failed(ids[0], generation, RestartReason.WORKER_EXIT, "exit 1") == stops(
        generation, ids, RestartReason.WORKER_EXIT
    )
    assert rejoin_all(rv, *ids) == assignments(generation + 1, ids, restarts=rv.restarts_total)


def test_budget_allows_max_restarts_then_fails_the_job() -> None:
    clock = FakeClock()
    ids = ["a", "b"]
    rv = running(clock, ids, max_nodes=2, max_restarts=2, restart_window_seconds=100.0)
    _fail_and_recover(rv, clock, 10.0, ids)
    _fail_and_recover(rv, clock, 20.0, ids)
    assert (rv.generation, rv.restarts_total) == (3, 2)
    at(clock, rv, 30.0)
    reason = (
        "restart budget exhausted: 3 failures within 100s exceed max_restarts=2; "
        "last: worker_exit (a: exit 1)"
    )
    sends = rv.worker_failed("a", 3, RestartReason.WORKER_EXIT, "exit 1")
    assert sends == finished(ids, JobState.FAILED, reason)
    assert (rv.state, rv.reason) == (JobState.FAILED, reason)
    snap = rv.status()
    assert (snap.state, snap.world_size, snap.generation) == (JobState.FAILED, 0, 3)
    assert [(n.node_id, n.rank) for n in snap.nodes] == [("a", -1), ("b", -1)]
    at(clock, rv, 40.0)
    assert rv.tick() == []


def test_failures_older_than_the_window_are_forgotten() -> None:
    clock = FakeClock()
    ids = ["a", "b"]
    rv = running(clock, ids, max_nodes=2, max_restarts=1, restart_window_seconds=100.0)
    _fail_and_recover(rv, clock, 10.0, ids)
    _fail_and_recover(rv, clock, 111.0, ids)  # the failure at t=10 is 101s old: out of the window
    assert state_of(rv) is JobState.RUNNING
    at(clock, rv, 150.0)
    sends = rv.worker_failed("a", 3, RestartReason.WORKER_EXIT, "exit 1")
    reason = (
        "restart budget exhausted: 2 failures within 100s exceed max_restarts=1; "
        "last: worker_exit (a: exit 1)"
    )
    assert sends == finished(ids, JobState.FAILED, reason)


# ------------------------------------------------------------------------------------ where generations resume


def test_steps_redone_after_a_restart_and_steps_lost_below_a_saved_checkpoint(caplog: pytest.LogCaptureFixture
                                                                             ) -> None:
    clock = FakeClock()
    ids = ["a", "b"]
    rv = running(clock, ids, max_nodes=2)
    rv.progress("a", 1, WorkerProgress(step=1))
    rv.progress("a", 1, WorkerProgress(step=130, checkpoint_step=100))
    _fail_and_recover(rv, clock, 10.0, ids)
    rv.progress("a", 2, WorkerProgress(step=100))  # resumed from the checkpoint: 30 steps redone, none lost
    rv.progress("b", 2, WorkerProgress(step=100))
    snap = rv.status()
    assert (snap.steps_redone, snap.steps_lost, snap.warnings) == (30, 0, ())
    rv.progress("a", 2, WorkerProgress(step=150, checkpoint_step=150))
    _fail_and_recover(rv, clock, 20.0, ids)
    rv.progress("a", 3, WorkerProgress(step=0))  # the backup was deleted: it starts over
    snap = rv.status()
    warning = ("generation 3 resumed at step 0, below the checkpoint of step 150 the job had saved: 150 steps lost "
               "(was the backup deleted or damaged?)")
    assert (snap.steps_redone, snap.steps_lost, snap.warnings) == (180, 150, (warning,))
    assert [r.levelname for r in caplog.records if "steps lost" in r.getMessage()] == ["WARNING"]


# ----------------------------------------------------------------------------- backoff between failed generations

BACKOFF = dataclasses.replace(SETTINGS, restart_backoff_seconds=1.0, restart_backoff_max_seconds=4.0)


def _fail_and_rejoin(rv: Rendezvous, clock: FakeClock, now: float, ids: Sequence[str]) -> list[Send]:
    """A failure, then every member back; returns the assignments the last rejoin brought (none: it waits)."""
    at(clock, rv, now)
    rv.worker_failed(ids[0], rv.generation, RestartReason.WORKER_EXIT, "exit 1")
    return [send for send in rejoin_all(rv, *ids) if isinstance(send.order, Assignment)]


def test_failed_generations_in_a_row_wait_longer_and_longer() -> None:
    clock = FakeClock()
    ids = ["a", "b"]
    rv = Rendezvous(BACKOFF, clock, spec(max_nodes=2, max_restarts=10))
    join(rv, *ids)
    assert rv.generation == 1
    # The first failure restarts at once: recovery stays fast.
    assert _fail_and_rejoin(rv, clock, 5.0, ids) == assignments(2, ids, restarts=1)
    waits = []
    for n in range(3, 7):  # generations 2..5 fail before making any progress
        assert _fail_and_rejoin(rv, clock, clock.now + 0.5, ids) == []  # both back, but the round waits
        failed_at = clock.now
        deadline = rv.restarts.not_before
        assert deadline is not None
        next_deadline = rv.next_deadline()
        assert next_deadline is not None and next_deadline <= deadline  # the coordinator wakes up for it
        waits.append(deadline - failed_at)
        at(clock, rv, deadline - 0.01)
        assert rv.tick() == []
        at(clock, rv, deadline)
        assert rv.tick() == assignments(n, ids, restarts=n - 1)
    assert waits == [1.0, 2.0, 4.0, 4.0]  # doubles, up to restart_backoff_max


def test_a_backoff_is_named_in_the_reason_and_to_the_waiting_nodes() -> None:
    clock = FakeClock()
    ids = ["a", "b"]
    rv = Rendezvous(BACKOFF, clock, spec(max_nodes=2, max_restarts=10))
    join(rv, *ids)
    _fail_and_rejoin(rv, clock, 5.0, ids)
    at(clock, rv, 5.5)
    rv.worker_failed("a", 2, RestartReason.WORKER_EXIT, "exit 1")
    assert rv.status().reason == "worker_exit: a: exit 1; backing off 1s before generation 3"
    rejoin(rv, "a")
    assert rejoin(rv, "b") == waiting("b", 2, "backing off after 2 failed generations in a row: the next forms in "
                                             "1.0s", hi=2)


def _trained_after_two_failures(clock: FakeClock, ids: Sequence[str]) -> Rendezvous:
    """Two failed generations in a row, then generation 3 trains (a healthy generation)."""
    rv = Rendezvous(BACKOFF, clock, spec(max_nodes=2, max_restarts=10))
    join(rv, *ids)
    _fail_and_rejoin(rv, clock, 5.0, ids)
    assert _fail_and_rejoin(rv, clock, 6.0, ids) == []  # second in a row: waits
    at(clock, rv, 7.0)
    rv.tick()
    assert rv.generation == 3
    rv.progress("a", 3, WorkerProgress(step=100))
    rv.progress("a", 3, WorkerProgress(step=101))  # training moved on
    return rv


def test_a_generation_that_trained_resets_the_backoff() -> None:
    clock, ids = FakeClock(), ["a", "b"]
    rv = _trained_after_two_failures(clock, ids)
    assert _fail_and_rejoin(rv, clock, 8.0, ids) == assignments(4, ids, restarts=3)


def test_a_generation_that_trained_resets_the_backoff_even_when_a_planned_restart_ends_it() -> None:
    clock, ids = FakeClock(), ["a", "b"]
    rv = _trained_after_two_failures(clock, ids)
    rv.restart_job("maintenance")  # generation 3 ends by a planned restart
    rejoin_all(rv, *ids)
    assert rv.generation == 4
    assert _fail_and_rejoin(rv, clock, 8.0, ids) == assignments(5, ids, restarts=4)  # a first failure: at once


def test_a_long_run_resets_the_backoff_and_planned_restarts_never_wait() -> None:
    clock = FakeClock()
    ids = ["a", "b"]
    rv = Rendezvous(BACKOFF, clock, spec(max_nodes=2, max_restarts=10))
    join(rv, *ids)
    _fail_and_rejoin(rv, clock, 5.0, ids)
    at(clock, rv, 5.0 + HEALTHY_RUN_SECONDS)  # no progress reports, but it ran a minute
    assert _fail_and_rejoin(rv, clock, clock.now, ids) == assignments(3, ids, restarts=2)
    assert _fail_and_rejoin(rv, clock, clock.now + 1, ids) == []  # in a row again
    at(clock, rv, clock.now + 1.0)
    rv.tick()
    rv.restart_job("maintenance")
    assert rejoin_all(rv, *ids) == assignments(5, ids, restarts=4)  # planned: at once


def test_job_waits_below_min_nodes_and_fails_after_join_timeout() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])  # formed at t=1.0
    at(clock, rv, 10.0)
    assert rv.disconnect("b") == stops(1, ["a"], RestartReason.NODE_LOST)
    assert rejoin(rv, "a") == waiting("a", 1)
    at(clock, rv, 609.9)
    assert rv.tick() == []
    assert state_of(rv) is JobState.WAITING
    at(clock, rv, 610.0)
    reason = "only 1 of min_nodes=2 nodes joined within join_timeout=600s"
    assert rv.tick() == finished(["a"], JobState.FAILED, reason)
    assert (rv.state, rv.reason) == (JobState.FAILED, reason)


def test_job_below_min_nodes_recovers_when_a_node_joins_in_time() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    at(clock, rv, 10.0)
    rv.disconnect("a")
    rejoin(rv, "b")
    at(clock, rv, 300.0)
    assert join(rv, "c") == assignments(2, ["b", "c"], restarts=1)


def test_first_round_fails_after_join_timeout() -> None:
    clock = FakeClock()
    rv = new(clock)
    join(rv, "a")
    at(clock, rv, 599.9)
    assert rv.tick() == []
    at(clock, rv, 600.0)
    reason = "only 1 of min_nodes=2 nodes joined within join_timeout=600s"
    assert rv.tick() == finished(["a"], JobState.FAILED, reason)


# -------------------------------------------------------------------------------------------- success


def test_all_members_succeeded_finishes_the_job_for_every_node() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    join(rv, "d")  # standby
    assert rv.worker_succeeded("a", 1) == []
    assert rv.worker_succeeded("b", 1) == []
    assert rv.worker_succeeded("a", 1) == []  # a repeated report changes nothing
    assert state_of(rv) is JobState.RUNNING
    reason = "every trainer of generation 1 exited 0"
    assert rv.worker_succeeded("c", 1) == finished(["a", "b", "c", "d"], JobState.SUCCEEDED, reason)
    assert (rv.state, rv.reason) == (JobState.SUCCEEDED, reason)
    snap = rv.status()
    assert snap.world_size == 3
    assert [(n.node_id, n.rank, n.state) for n in snap.nodes] == [
        ("a", 0, NodeState.SUCCEEDED),
        ("b", 1, NodeState.SUCCEEDED),
        ("c", 2, NodeState.SUCCEEDED),
        ("d", -1, NodeState.WAITING),
    ]


def test_failure_after_a_non_chief_succeeded_restarts_all_of_them() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    assert rv.worker_succeeded("c", 1) == []
    assert rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "exit 1") == stops(
        1, ["a", "b", "c"], RestartReason.WORKER_EXIT
    )
    assert rejoin_all(rv, "a", "b", "c") == assignments(2, ["a", "b", "c"], restarts=1)


def test_failure_after_the_chief_succeeded_completes_the_job() -> None:
    # The chief's exit 0 means training completed (and BackupAndRestore deleted its checkpoint): a restart
    # would retrain from scratch, so the job succeeds and the reason names the later failure.
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    assert rv.worker_succeeded("a", 1) == []
    reason = "training completed on the chief; then worker_exit: b: exit 1"
    assert rv.worker_failed("b", 1, RestartReason.WORKER_EXIT, "exit 1") == [
        Send(n, Finished(JobState.SUCCEEDED, reason)) for n in ["a", "b", "c"]
    ]
    assert rv.state is JobState.SUCCEEDED and rv.restarts_total == 0


def test_member_lost_after_the_chief_succeeded_completes_the_job() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    rv.worker_succeeded("a", 1)
    reason = "training completed on the chief; then node_lost: b: its session closed"
    assert rv.disconnect("b") == [Send("a", Finished(JobState.SUCCEEDED, reason))]


def test_no_scale_up_once_the_chief_succeeded() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=3)
    rv.worker_succeeded("a", 1)
    rv.join(info("c"), spec(max_nodes=3))
    at(clock, rv, 100.0)
    assert rv.tick() == []
    assert rv.state is JobState.RUNNING


def test_chief_completing_while_the_set_stops_completes_the_job() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    rv.worker_failed("b", 1, RestartReason.STALLED, "no progress")
    assert rv.state is JobState.RESTARTING
    reason = "the chief of generation 1 completed training while the set stopped"
    assert rv.worker_succeeded("a", 1) == [Send(n, Finished(JobState.SUCCEEDED, reason)) for n in ["a", "b"]]
    # the members' rejoins after the verdict are answered with the verdict, not refused
    assert rv.join(info("b"), SPEC, rejoin=True) == [Send("b", Finished(JobState.SUCCEEDED, reason))]


def test_non_chief_completing_while_the_set_stops_changes_nothing() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    rv.worker_failed("a", 1, RestartReason.STALLED, "no progress")
    assert rv.worker_succeeded("b", 1) == []
    assert rv.state is JobState.RESTARTING


# ----------------------------------------------------------------------------- coordinator restarts


def test_restarted_coordinator_continues_generation_numbering() -> None:
    clock = FakeClock()
    rv = new(clock)
    rv.join(info("a", last_generation=7, last_rank=1), SPEC, restart_count=4)
    rv.join(info("b", last_generation=7, last_rank=0), SPEC, restart_count=3)
    at(clock, rv, 1.0)
    # b was the chief of generation 7, so it is the chief again
    assert rv.tick() == assignments(8, ["b", "a"], restarts=4)
    snap = rv.status()
    assert (snap.generation, snap.restarts_total, snap.restarts_by_reason) == (8, 4, {})
    rv.worker_failed("b", 8, RestartReason.WORKER_EXIT, "exit 1")
    assert rejoin_all(rv, "a", "b") == assignments(9, ["b", "a"], restarts=5)


def test_a_restarted_coordinator_re_forms_once_every_member_of_the_last_generation_is_back() -> None:
    """Not a first formation: the Joins say generation 7 had three members; once all three are back the round
    closes, below the last call (the slow settings' 30 s) and with the old ranks."""
    clock = FakeClock()
    job = spec(max_nodes=4)  # three members are not max_nodes: a first formation would wait its last call
    rv = Rendezvous(dataclasses.replace(SETTINGS, last_call_seconds=30.0), clock, job)
    for node_id, rank in (("a", 1), ("c", 2)):
        assert rv.join(info(node_id, last_generation=7, last_rank=rank, last_world_size=3), job) == waiting(
            node_id, 1 if node_id == "a" else 2, hi=4)
    assert rv.join(info("b", last_generation=7, last_rank=0, last_world_size=3), job) == \
        assignments(8, ["b", "a", "c"])


def test_a_member_of_the_last_generation_that_is_not_back_within_a_node_timeout_is_lost() -> None:
    """The killed agent's node hosted the coordinator: its member never comes back. The others re-form a node
    timeout after the first of them is back, not after the last call."""
    clock = FakeClock()
    rv = Rendezvous(dataclasses.replace(SETTINGS, last_call_seconds=30.0), clock, SPEC)
    rv.join(info("a", last_generation=7, last_rank=1, last_world_size=3), SPEC)
    at(clock, rv, 0.5)
    rv.join(info("c", last_generation=7, last_rank=2, last_world_size=3), SPEC)
    assert rv.next_deadline() == SETTINGS.node_timeout_seconds  # the first one back, plus a node timeout
    at(clock, rv, SETTINGS.node_timeout_seconds - 0.01)
    assert rv.tick() == []
    at(clock, rv, SETTINGS.node_timeout_seconds)
    assert rv.tick() == assignments(8, ["a", "c"])


def test_joins_that_name_no_last_generation_are_a_first_formation() -> None:
    clock = FakeClock()
    rv = Rendezvous(dataclasses.replace(SETTINGS, last_call_seconds=30.0), clock, SPEC)
    join(rv, "a", "b")
    at(clock, rv, SETTINGS.node_timeout_seconds + 1.0)
    assert rv.tick() == []  # min_nodes are in: the last call, for max_nodes
    at(clock, rv, 30.0)
    assert rv.tick() == assignments(1, ["a", "b"])


def test_a_coordinator_re_forms_only_before_its_own_first_generation() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1")
    rv.join(info("x", last_generation=9, last_rank=0, last_world_size=1), SPEC)  # a stranger's old generation
    assert rejoin_all(rv, "a", "b") == assignments(10, ["a", "b", "x"], restarts=1)


def test_a_late_join_from_an_older_coordinator_does_not_change_a_running_generation() -> None:
    # A restarted coordinator formed generation 1 with c; an old member then joins with last_generation=5.
    clock = FakeClock()
    rv = running(clock, ["c"], min_nodes=1)
    assert rv.join(info("b", last_generation=5), spec(min_nodes=1))[0].order == Waiting(
        1, 1, 3, "scale-up pending: the job will re-form to take this node in")
    assert rv.generation == 1
    assert rv.worker_succeeded("c", 1) == [Send(n, Finished(JobState.SUCCEEDED,
                                                            "every trainer of generation 1 exited 0"))
                                           for n in ["c", "b"]]


def test_the_next_round_after_a_late_join_continues_above_every_generation_seen() -> None:
    clock = FakeClock()
    rv = running(clock, ["c"], min_nodes=1)
    rv.join(info("b", last_generation=5), spec(min_nodes=1))
    at(clock, rv, clock.now + SETTINGS.settle_seconds)
    assert rv.tick() == [Send("c", StopWorkers(1, RestartReason.SCALE_UP))]
    assert next(s.order for s in rejoin(rv, "c") if isinstance(s.order, Assignment)).generation == 6


def test_leave_after_the_chief_succeeded_completes_the_job() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    rv.worker_succeeded("a", 1)
    reason = "training completed on the chief; then node_left: b: drained"
    assert rv.leave("b", "drained") == [Send(n, Finished(JobState.SUCCEEDED, reason)) for n in ["a", "b"]]


def test_join_timeout_of_a_standalone_coordinator_counts_from_the_first_join() -> None:
    clock = FakeClock()
    rv = Rendezvous(SETTINGS, clock)  # no spec until the first join
    clock.now = 10 * SETTINGS.join_timeout_seconds
    assert rv.join(info("a"), SPEC) == [Send("a", Waiting(1, 2, 3, "waiting for the round to close"))]
    assert rv.tick() == []
    assert rv.state is JobState.WAITING


# ------------------------------------------------------------------------------------------- snapshot


def test_snapshot_of_a_running_job() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    join(rv, "d")
    rv.worker_started("a", 1, 101)
    progress = WorkerProgress(step=50, examples=3200, loss=0.25, checkpoint_step=40, reported_at=1.0)
    rv.progress("b", 1, progress)

    def node(n: str, rank: int, st: NodeState, pid: int = 0, p: WorkerProgress | None = None) -> NodeStatus:
        return NodeStatus(n, rank, f"{n}.cluster", PORT, st, pid, p)

    assert rv.status() == ClusterStatus(
        job="mnist",
        state=JobState.RUNNING,
        reason="",
        generation=1,
        world_size=3,
        min_nodes=2,
        max_nodes=3,
        max_restarts=3,
        restarts_total=0,
        restarts_by_reason={},
        nodes=(
            node("a", 0, NodeState.RUNNING, 101),
            node("b", 1, NodeState.RUNNING, 0, progress),
            node("c", 2, NodeState.RUNNING),
            node("d", -1, NodeState.WAITING),
        ),
        goodput=GoodputView(dict.fromkeys(CATEGORIES, 0.0), (GenerationSummary(
            1, 0.0, 3, ("a", "b", "c"), None, None, 0, "", dict.fromkeys(CATEGORIES, 0.0)),)),
    )


def test_snapshot_while_restarting() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b", "c"])
    rv.worker_started("b", 1, 7)
    rv.worker_failed("c", 1, RestartReason.STALLED, "no progress")
    rejoin(rv, "a")
    snap = rv.status()
    assert (snap.state, snap.generation, snap.world_size) == (JobState.RESTARTING, 1, 0)
    assert (snap.restarts_total, snap.restarts_by_reason) == (1, {"stalled": 1})
    assert snap.reason == "stalled: c: no progress"
    assert [(n.node_id, n.rank, n.state, n.worker_pid) for n in snap.nodes] == [
        ("a", -1, NodeState.WAITING, 0),
        ("b", -1, NodeState.STOPPING, 0),
        ("c", -1, NodeState.STOPPING, 0),
    ]


# ----------------------------------------------------------------------------------------- suspected bugs


def test_tick_before_the_first_join_without_a_preset_spec() -> None:
    # Regression: the gRPC servicer ticks every 50 ms from start-up, and create_server() builds the Rendezvous
    # with spec=None by default. tick() must not raise before the first Join (it used to raise ProtocolError
    # from _require_spec(), which would kill the ticker task: no last call, lease or join timeout afterwards).
    clock = FakeClock()
    rv = Rendezvous(SETTINGS, clock)
    assert rv.tick() == []
    clock.now = 0.5
    assert rv.join(info("a"), SPEC) == waiting("a", 1)


def test_last_call_restarts_when_a_disconnect_drops_the_round_below_min() -> None:
    clock = FakeClock()
    rv = new(clock)
    join(rv, "a", "b")  # min reached at t=0
    at(clock, rv, 0.2)
    assert rv.disconnect("b") == []
    at(clock, rv, 5.0)
    assert join(rv, "c") == waiting("c", 2)  # min reached again: a fresh last call, not an instant close
    at(clock, rv, 6.0)
    assert rv.tick() == assignments(1, ["a", "c"])


def test_last_call_restarts_when_a_planned_leave_drops_the_round_below_min() -> None:
    # BUG? Same as above, but b leaves on purpose (Leave, then its session closes). disconnect() of a LEAVING
    # node skips _lost(), the only place that resets _min_reached_at, so the stale t=0 mark survives and c's
    # join at t=5 closes the round at once: the last_call_seconds window after min_nodes is skipped.
    clock = FakeClock()
    rv = new(clock)
    join(rv, "a", "b")  # min reached at t=0
    at(clock, rv, 0.2)
    assert rv.leave("b", "drain") == []
    assert rv.disconnect("b") == []
    at(clock, rv, 5.0)
    assert join(rv, "c") == waiting("c", 2)
    at(clock, rv, 6.0)
    assert rv.tick() == assignments(1, ["a", "c"])


# ----------------------------------------------------------------------------------- timer deadlines


def test_next_deadline_follows_leases_last_call_and_join_timeout() -> None:
    clock = FakeClock()
    assert Rendezvous(SETTINGS, clock).next_deadline() is None  # no spec, nobody joined: nothing to time
    rv = new(clock)
    assert rv.next_deadline() == SETTINGS.join_timeout_seconds  # a preset spec arms the join timeout
    rv.join(info("a"), SPEC)
    # below min_nodes: the join timeout, or a's lease, whichever is first
    assert rv.next_deadline() == min(SETTINGS.join_timeout_seconds, SETTINGS.node_timeout_seconds)
    at(clock, rv, 0.5)
    rv.join(info("b"), SPEC)  # min reached at 0.5: the last call ends at 0.5 + last_call
    assert rv.next_deadline() == min(0.5 + SETTINGS.last_call_seconds, 0.0 + SETTINGS.node_timeout_seconds)
    clock.now = 0.5 + SETTINGS.last_call_seconds
    rv.heartbeat("a")
    rv.heartbeat("b")
    assert [type(s.order) for s in rv.tick()] == [Assignment, Assignment]
    assert rv.next_deadline() == clock.now + SETTINGS.node_timeout_seconds  # running: only the leases


def test_ticking_at_the_deadline_fires_the_timer() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"])
    clock.now += 0.5
    rv.heartbeat("a")  # b is now the first to fall silent
    deadline = rv.next_deadline()
    assert deadline is not None
    clock.now = deadline + 1e-9
    assert rv.tick() == [Send("b", Evict("no message for 2.0s")), Send("a", StopWorkers(1, RestartReason.NODE_LOST))]


# --------------------------------------------------------------------- a coordinator that takes the job over (etcd)


def _recorded(clock: FakeClock) -> DurableState:
    rv = running(clock, ["a", "b"], max_nodes=2)
    rv.progress("a", 1, WorkerProgress(step=40, checkpoint_step=30))
    return DurableState.from_json(rv.durable(wall_offset=1000.0).to_json())  # through etcd's bytes


def test_the_durable_state_round_trips_through_json() -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2, max_restarts=5)
    _fail_and_recover(rv, clock, 10.0, ["a", "b"])
    rv.drain("b", "maintenance", force=True)
    recorded = rv.durable(wall_offset=1000.0)
    assert DurableState.from_json(recorded.to_json()) == recorded
    assert (recorded.generation, recorded.restarts_total, recorded.failures) == (2, 1, (1010.0,))
    assert [m.node_id for m in recorded.members] == ["a", "b"] and recorded.drained == ("b",)


def test_a_new_coordinator_keeps_the_running_generation_when_its_members_attach() -> None:
    clock = FakeClock()
    recorded = _recorded(clock)
    successor = Rendezvous(SETTINGS, clock)
    successor.take_over(recorded, wall_offset=1000.0, grace=2.0)
    assert (successor.state, successor.generation) == (JobState.RUNNING, 1)
    for n in ("a", "b"):
        assert successor.join(info(n, last_generation=1), spec(max_nodes=2), attached_generation=1) == []
    at(clock, successor, clock.now + 10.0)  # heartbeats: nobody is lost
    assert successor.tick() == []
    assert (successor.state, successor.generation, successor.restarts_total) == (JobState.RUNNING, 1, 0)


def test_a_member_that_does_not_attach_is_lost_after_the_grace() -> None:
    clock = FakeClock()
    recorded = _recorded(clock)
    successor = Rendezvous(SETTINGS, clock)
    successor.take_over(recorded, wall_offset=1000.0, grace=2.0)
    successor.join(info("a", last_generation=1), spec(max_nodes=2), attached_generation=1)
    clock.now += 2.0 + SETTINGS.node_timeout_seconds - 0.1
    successor.heartbeat("a")
    assert successor.tick() == []
    clock.now += 0.2
    successor.heartbeat("a")
    sends = successor.tick()
    assert Send("b", Evict("no message for 2.1s")) in sends and stops(1, ["a"], RestartReason.NODE_LOST)[0] in sends
    assert successor.status().restarts_by_reason == {"node_lost": 1}


def test_the_node_of_a_leader_that_lost_its_lease_is_waited_for_only_its_own_grace() -> None:
    clock = FakeClock()
    successor = Rendezvous(SETTINGS, clock)
    # b led and its lease ran out: lost after 0.9 s, while a keeps the whole grace (2 s + the node timeout)
    successor.take_over(_recorded(clock), wall_offset=1000.0, grace=2.0,
                        graces={"b": 0.9 - SETTINGS.node_timeout_seconds})
    successor.join(info("a", last_generation=1), spec(max_nodes=2), attached_generation=1)
    clock.now += 0.8
    successor.heartbeat("a")
    assert successor.tick() == []
    clock.now += 0.2
    successor.heartbeat("a")
    sends = successor.tick()
    assert stops(1, ["a"], RestartReason.NODE_LOST)[0] in sends
    assert successor.status().restarts_by_reason == {"node_lost": 1}


def test_a_member_whose_worker_died_during_the_failover_restarts_the_job() -> None:
    clock = FakeClock()
    successor = Rendezvous(SETTINGS, clock)
    successor.take_over(_recorded(clock), wall_offset=1000.0, grace=2.0)
    assert successor.join(info("a", last_generation=1), spec(max_nodes=2), attached_generation=1) == []
    sends = successor.join(info("b", last_generation=1), spec(max_nodes=2))  # no worker to attach
    assert stops(1, ["a"], RestartReason.NODE_LOST)[0] in sends
    assert successor.state is JobState.RESTARTING


def test_a_stale_worker_is_stopped_before_its_node_may_join() -> None:
    clock = FakeClock()
    successor = Rendezvous(SETTINGS, clock)
    successor.take_over(_recorded(clock), wall_offset=1000.0, grace=2.0)
    sends = successor.join(info("c", last_generation=7), spec(max_nodes=2), attached_generation=7)  # not a member
    assert sends == [Send("c", StopWorkers(7, RestartReason.NODE_LOST))]
    assert successor.join(info("c"), spec(max_nodes=2), rejoin=True) != []  # the confirmation: now it waits to join
    assert [n.state for n in successor.status().nodes if n.node_id == "c"] == [NodeState.WAITING]


def test_a_new_coordinator_continues_the_budget_and_the_steps() -> None:
    clock = FakeClock()
    recorded = _recorded(clock)
    successor = Rendezvous(SETTINGS, clock)
    successor.take_over(recorded, wall_offset=1000.0, grace=2.0)
    assert successor.restarts.resumes.checkpoint_step == 30
    assert successor.durable(wall_offset=1000.0) == recorded
