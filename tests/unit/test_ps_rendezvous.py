"""The coordinator's state machine running a parameter-server job (rendezvous/ps_job.py, rendezvous/state.py).

Pure logic over a fake clock, like test_rendezvous_state.py: every test asserts the exact orders returned.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import pytest
from tfelastic.daemon.agent.runner import trainer_env
from tfelastic.daemon.rendezvous import bounds
from tfelastic.daemon.rendezvous.api import (
    Assignment,
    DrainNode,
    Finished,
    JobSpec,
    JobState,
    Member,
    NodeInfo,
    OperatorRefusedError,
    RendezvousSettings,
    RestartReason,
    Send,
    StopWorkers,
    Waiting,
    WorkerReport,
    WorkerStatus,
)
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.state import Rendezvous

from tests.fakes import FakeClock

SETTINGS = RendezvousSettings(last_call_seconds=1.0, settle_seconds=3.0, node_timeout_seconds=2.0,
                              restart_backoff_seconds=0.0)
SPEC = JobSpec(job="ctr", command_digest=b"\x01" * 32, min_nodes=3, max_nodes=4, max_restarts=3,
               restart_window_seconds=3600.0, stall_timeout_seconds=300.0, backup_dir="/backup/ctr",
               strategy="parameter-server", ps=1)
PORT = 2222
TASKS = (("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1))


def info(node_id: str, role: str = "any", last_generation: int = 0) -> NodeInfo:
    return NodeInfo(node_id, f"{node_id}.cluster", PORT, last_generation=last_generation, role=role)


def state_of(rv: Rendezvous) -> JobState:
    """Read through a call, so that mypy does not narrow it between two inputs."""
    return rv.state


def members(ids: Sequence[str], tasks: Sequence[tuple[str, int]] = TASKS) -> tuple[Member, ...]:
    return tuple(Member(n, rank, f"{n}.cluster", PORT, *tasks[rank]) for rank, n in enumerate(ids))


def assignments(generation: int, ids: Sequence[str], restarts: int = 0) -> list[Send]:
    ms = members(ids)
    return [Send(n, Assignment(generation, rank, len(ids), ms, restarts)) for rank, n in enumerate(ids)]


def running(clock: FakeClock, roles: dict[str, str]) -> Rendezvous:
    rv = Rendezvous(SETTINGS, clock, SPEC)
    for node_id, role in roles.items():
        rv.join(info(node_id, role), SPEC)
    assert rv.state is JobState.RUNNING  # four joined: max_nodes
    return rv


def report(rv: Rendezvous, node_id: str, status: WorkerStatus, detail: str = "") -> list[Send]:
    return rv.report(node_id, WorkerReport(rv.generation, status, detail=detail))


def test_roles_are_assigned_chief_ps_workers_and_honour_what_nodes_asked() -> None:
    rv = Rendezvous(SETTINGS, FakeClock(), SPEC)
    sends: list[Send] = []
    for node_id, role in (("gpu1", "worker"), ("cpu1", "ps"), ("gpu2", "worker"), ("head", "any")):
        sends = rv.join(info(node_id, role), SPEC)
    assert sends == assignments(1, ["head", "cpu1", "gpu1", "gpu2"])
    assert [(n.node_id, n.role) for n in rv.status().nodes] == [
        ("head", "chief"), ("cpu1", "ps 0"), ("gpu1", "worker 0"), ("gpu2", "worker 1")]


def test_a_replaced_worker_is_counted_and_the_job_trains_on() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    assert report(rv, "d", WorkerStatus.REPLACED, "exited with code -9") == []
    assert report(rv, "d", WorkerStatus.REPLACED, "exited with code -9") == []
    snap = rv.status()
    assert snap.state is JobState.RUNNING and snap.generation == 1
    assert snap.restarts_total == 0  # no restart of the job
    assert snap.restarts_by_reason == {RestartReason.WORKER_REPLACED.value: 2}
    assert {n.node_id: n.replacements for n in snap.nodes} == {"a": 0, "b": 0, "c": 0, "d": 2}


def test_the_chief_exiting_0_ends_the_job_while_its_servers_still_serve() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    reason = "the chief of generation 1 completed training"
    assert report(rv, "a", WorkerStatus.SUCCEEDED) == [Send(n, Finished(JobState.SUCCEEDED, reason)) for n in "abcd"]


def test_a_worker_exiting_0_does_not_end_the_job() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    assert report(rv, "c", WorkerStatus.SUCCEEDED) == []
    assert rv.state is JobState.RUNNING


def test_a_lost_workers_task_is_vacant_and_a_node_that_joins_takes_it_in_a_planned_restart() -> None:
    clock = FakeClock()
    rv = running(clock, {"a": "any", "b": "any", "c": "any", "d": "any"})
    assert rv.disconnect("d") == []  # no stop order: the chief trains on
    snap = rv.status()
    assert snap.state is JobState.RUNNING
    assert snap.vacant == ("worker 1: node d lost (its session closed)",)
    assert rv.join(info("d"), SPEC) == [Send("d", Waiting(1, 3, 4, "scale-up pending: the job will re-form to take "
                                                                  "this node in"))]
    clock.now += SETTINGS.settle_seconds
    for n in "abcd":
        rv.heartbeat(n)
    # The chief first: it saves on SIGTERM, reading the variables from the parameter server, which must still serve.
    assert rv.tick() == [Send("a", StopWorkers(1, RestartReason.SCALE_UP))]
    assert rv.join(info("a", last_generation=1), SPEC, rejoin=True) == [
        *(Send(n, StopWorkers(1, RestartReason.SCALE_UP)) for n in "bc"),
        Send("a", Waiting(2, 3, 4, "waiting for the round to close"))]
    sends: list[Send] = []
    for n in "bc":
        sends = rv.join(info(n, last_generation=1), SPEC, rejoin=True)
    assert sends == assignments(2, ["a", "b", "c", "d"], restarts=1)  # d is worker 1 again: same task, same index
    assert rv.status().vacant == ()


def test_a_lost_worker_that_would_leave_too_few_nodes_restarts_the_job() -> None:
    rv = Rendezvous(SETTINGS, FakeClock(), dataclasses.replace(SPEC, min_nodes=4))
    for n in "abcd":
        rv.join(info(n), rv.spec or SPEC)
    assert rv.disconnect("d") == [Send(n, StopWorkers(1, RestartReason.NODE_LOST)) for n in "abc"]


def test_the_last_worker_lost_restarts_the_job() -> None:
    rv = Rendezvous(SETTINGS, FakeClock(), dataclasses.replace(SPEC, min_nodes=3, max_nodes=3))
    for n in "abc":
        rv.join(info(n), rv.spec or SPEC)
    assert rv.state is JobState.RUNNING
    assert rv.disconnect("c") == [Send(n, StopWorkers(1, RestartReason.NODE_LOST)) for n in "ab"]


def test_a_lost_parameter_server_or_chief_restarts_the_job() -> None:
    for lost, others in (("b", "acd"), ("a", "bcd")):
        rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
        assert rv.disconnect(lost) == [Send(n, StopWorkers(1, RestartReason.NODE_LOST)) for n in others]


def test_a_worker_that_failed_past_its_agents_budget_restarts_the_job() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    sends = report(rv, "c", WorkerStatus.FAILED, "replaced 10 times within 3600s")
    assert sends == [Send(n, StopWorkers(1, RestartReason.WORKER_EXIT)) for n in "abcd"]


def test_a_drained_worker_leaves_its_task_vacant_without_a_restart() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    # Its agent serves until told: the chief trains on without it, so it is told at once, and nobody else is.
    assert rv.leave("c", "drained: maintenance") == [Send("c", StopWorkers(1, RestartReason.NODE_LEFT))]
    assert rv.status().vacant == ("worker 0: node c left (drained: maintenance)",)


def test_every_agent_leaving_at_once_stops_the_parameter_servers_and_workers_after_the_chief() -> None:
    """systemctl stop or scancel on every node: the chief saves while its ps and workers still serve."""
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    assert rv.leave("a", "agent stopped (SIGTERM)") == []  # the chief's agent stops its trainer itself
    assert rv.leave("b", "agent stopped (SIGTERM)") == []
    assert rv.leave("c", "agent stopped (SIGTERM)") == []
    assert rv.leave("d", "agent stopped (SIGTERM)") == []
    # The chief's trainer saved and stopped, its agent hung up: the others, which wait for this, stop now.
    assert rv.disconnect("a") == [Send(n, StopWorkers(1, RestartReason.NODE_LEFT)) for n in "bcd"]
    for node in "bcd":
        assert rv.disconnect(node) == []
    assert state_of(rv) is JobState.WAITING


def test_a_parameter_server_that_leaves_waits_for_the_chief_which_is_stopped_first() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    assert rv.leave("b", "agent stopped (SIGTERM)") == [Send("a", StopWorkers(1, RestartReason.NODE_LEFT))]
    sends = rv.join(info("a", last_generation=1), SPEC, rejoin=True)  # its Join confirms its trainer is gone
    stops = [s for s in sends if isinstance(s.order, StopWorkers)]
    assert stops == [Send(n, StopWorkers(1, RestartReason.NODE_LEFT)) for n in "bcd"]  # the leaving ps among them
    assert [s.node_id for s in sends if s not in stops] == ["a"]  # and the chief waits for the next round


def test_a_round_whose_nodes_cannot_fill_the_tasks_waits_and_says_which() -> None:
    clock = FakeClock()
    rv = Rendezvous(SETTINGS, clock, SPEC)
    for n, role in (("w1", "worker"), ("w2", "worker"), ("p1", "ps")):
        rv.join(info(n, role), SPEC)
    clock.now += SETTINGS.last_call_seconds
    for n in ("w1", "w2", "p1"):
        rv.heartbeat(n)
    sends = rv.tick()
    assert rv.state is JobState.WAITING
    assert "needs 1 chief task" in rv.reason and "--role chief" in rv.reason
    assert sorted(s.node_id for s in sends) == ["p1", "w1", "w2"]
    assert rv.tick() == []  # said once, not at every tick
    sends = rv.join(info("boss", "chief"), SPEC)
    assert state_of(rv) is JobState.RUNNING
    assert [(s.node_id, s.order.rank) for s in sends if isinstance(s.order, Assignment)] == [
        ("boss", 0), ("p1", 1), ("w1", 2), ("w2", 3)]


def without_a_chief(clock: FakeClock) -> Rendezvous:
    """Two nodes that say --role worker and one --role ps, past the last call: min_nodes are in, and no chief can
    be found.
    Their leases outlast the join timeout, so that the round's own timer is the next deadline."""
    rv = Rendezvous(dataclasses.replace(SETTINGS, node_timeout_seconds=10 * SETTINGS.join_timeout_seconds), clock,
                    SPEC)
    for n, role in (("w1", "worker"), ("w2", "worker"), ("p1", "ps")):
        rv.join(info(n, role), SPEC)
    clock.now += SETTINGS.last_call_seconds
    rv.tick()
    return rv


def test_a_round_that_nobody_can_fill_fails_the_job_after_join_timeout_and_names_the_task() -> None:
    clock = FakeClock()
    rv = without_a_chief(clock)
    assert rv.state is JobState.WAITING and "needs 1 chief task" in rv.reason
    # It waits on the join timeout, not on the last call that has passed (which would make the tick loop spin).
    assert rv.next_deadline() == SETTINGS.join_timeout_seconds
    clock.now = SETTINGS.join_timeout_seconds - 0.1
    assert rv.tick() == []
    clock.now = SETTINGS.join_timeout_seconds
    sends = rv.tick()
    assert state_of(rv) is JobState.FAILED
    assert rv.reason.startswith("the job needs 1 chief task and only 0 of the 3 waiting nodes may take one")
    assert rv.reason.endswith(f"; none joined within join_timeout={SETTINGS.join_timeout_seconds:g}s")
    assert sends == [Send(n, Finished(JobState.FAILED, rv.reason)) for n in ("w1", "w2", "p1")]


def test_the_missing_task_is_no_longer_named_once_the_nodes_it_listed_are_gone() -> None:
    clock = FakeClock()
    rv = without_a_chief(clock)
    assert "(their --role: ps, worker)" in rv.reason
    rv.leave("p1", "agent stopped (SIGTERM)")  # below min_nodes now: the reason listed a role nobody has
    assert rv.reason == "" and rv.status().reason == ""


def test_a_chief_that_joins_before_join_timeout_fills_the_round() -> None:
    clock = FakeClock()
    rv = without_a_chief(clock)
    clock.now = SETTINGS.join_timeout_seconds - 1.0
    rv.join(info("boss", "chief"), SPEC)
    assert state_of(rv) is JobState.RUNNING and rv.next_deadline() != SETTINGS.join_timeout_seconds


def test_a_drain_that_would_leave_a_task_nobody_can_take_is_refused_without_force() -> None:
    rv = running(FakeClock(), {"a": "chief", "b": "ps", "c": "worker", "d": "worker"})
    with pytest.raises(OperatorRefusedError, match=r"draining 'b' would leave a task nobody can take: the job needs "
                                                    r"1 ps task and only 0 of the 3 waiting nodes may take one"):
        rv.drain("b", "maintenance")
    with pytest.raises(OperatorRefusedError, match="needs 1 chief task"):
        rv.drain("a", "maintenance")
    assert rv.drain("c", "maintenance") == [Send("c", DrainNode("maintenance"))]  # d still works
    assert rv.drain("b", "maintenance", force=True) == [Send("b", DrainNode("maintenance"))]


def test_a_new_coordinator_knows_the_tasks_from_the_recorded_ranks() -> None:
    clock = FakeClock()
    rv = running(clock, {"a": "any", "b": "any", "c": "any", "d": "any"})
    recorded = DurableState.from_json(rv.durable(wall_offset=0.0).to_json())
    successor = Rendezvous(SETTINGS, clock, None)
    successor.take_over(recorded, wall_offset=0.0, grace=5.0)
    assert successor.tasks.described("b") == "ps 0" and successor.tasks.described("d") == "worker 1"
    assert successor.disconnect("d") == []  # a worker: vacant, the job trains on


def test_the_job_spec_rules_of_a_parameter_server_job() -> None:
    def problems(**changes: Any) -> list[str]:
        return [f"{p.field}: {p.text}" for p in bounds.strategy_problems(dataclasses.replace(SPEC, **changes))]

    assert problems() == []
    assert problems(ps=0) == ["ps: a parameter-server job needs at least 1 parameter server: set --ps N"]
    assert problems(ps=2)[0].startswith("min_nodes: 3 nodes cannot hold the chief, 2 parameter servers and a worker")
    assert problems(strategy="mirrored", ps=1)[0].startswith("ps: 1 needs --strategy parameter-server")
    assert problems(strategy="async")[0].startswith("strategy: 'async' is not one of mirrored, parameter-server")
    assert problems(strategy="mirrored", ps=0) == []


def test_tf_config_names_chief_ps_and_workers_and_each_members_own_task() -> None:
    got = {}
    for send in assignments(1, ["a", "b", "c", "d"]):
        assert isinstance(send.order, Assignment)
        env = trainer_env({}, send.order, job="ctr", node_id=send.node_id, backup_dir="/b", progress_socket="/s",
                          instrument=False)
        got[send.node_id] = json.loads(env["TF_CONFIG"])
        assert env["TFELASTIC_RANK"] == str(send.order.rank) and env["TFELASTIC_WORLD_SIZE"] == "4"
    cluster = {"chief": ["a.cluster:2222"], "ps": ["b.cluster:2222"], "worker": ["c.cluster:2222", "d.cluster:2222"]}
    assert got == {"a": {"cluster": cluster, "task": {"type": "chief", "index": 0}},
                   "b": {"cluster": cluster, "task": {"type": "ps", "index": 0}},
                   "c": {"cluster": cluster, "task": {"type": "worker", "index": 0}},
                   "d": {"cluster": cluster, "task": {"type": "worker", "index": 1}}}


def test_a_failure_stops_every_member_at_once() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    assert rv.disconnect("b") == [Send(n, StopWorkers(1, RestartReason.NODE_LOST)) for n in "acd"]


def test_an_operator_restart_stops_the_chief_first_and_the_others_when_its_node_is_gone() -> None:
    rv = running(FakeClock(), {"a": "any", "b": "any", "c": "any", "d": "any"})
    sends, _ = rv.restart_job("new data")
    assert sends == [Send("a", StopWorkers(1, RestartReason.OPERATOR_RESTART))]
    assert rv.disconnect("a") == [Send(n, StopWorkers(1, RestartReason.OPERATOR_RESTART)) for n in "bcd"]
