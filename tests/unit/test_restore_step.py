"""The snapshot step a generation restores: what agents report in their Join (``restorable_steps``), the
coordinator's choice (:func:`~tfelastic.daemon.rendezvous.restore_point.common_restore_step`), the wire both ways, the
bounds, what the agent's core puts in its Joins and what the trainer gets (``TFELASTIC_RESTORE_STEP``,
``TFELASTIC_LOCAL_CHECKPOINT_DIR``). Pure: a fake clock, no sockets."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.api import (
    Connection,
    Identity,
    RestorableSteps,
    ScanSnapshots,
    Send,
    StopResult,
    Timing,
)
from tfelastic.daemon.agent.core import AgentCore
from tfelastic.daemon.agent.runner import trainer_env
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.rendezvous import api, bounds, convert
from tfelastic.daemon.rendezvous.api import (
    Assignment,
    JobSpec,
    Member,
    NodeInfo,
    RendezvousSettings,
    RestartReason,
)
from tfelastic.daemon.rendezvous.restore_point import NEWER_SNAPSHOTS_LOGGED, common_restore_step
from tfelastic.daemon.rendezvous.state import Rendezvous
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.worker.stall import StallLimits
from tfelastic.trainer import snapshots
from tfelastic.trainer.environment import LOCAL_CHECKPOINT_DIR_ENV, RESTORE_STEP_ENV, TrainerEnvironment

from tests.fakes import FakeClock

SPEC = JobSpec("mnist", b"\x01" * 32, 2, 3, 3, 3600.0, 300.0, "/backup/mnist")
SETTINGS = RendezvousSettings(last_call_seconds=1.0, restart_backoff_seconds=0.0)


# ------------------------------------------------------------------------------------------ the choice


@pytest.mark.parametrize(("reported", "expected"), [
    ([(30, 20, 10), (20, 10)], 20),  # the newest step every member has
    ([(40, 30), (40, 30), (40, 30)], 40),  # the newest wins when all have it
    ([(30, 20), ()], None),  # a member with no snapshot
    ([(50, 40, 20), (30, 20, 10)], 20),  # a member with only older ones: the newest common
    ([(30,), (20,)], None),  # nothing in common
    ([(10, 30, 20), (20, 30)], 30),  # the order reported does not matter
    ([(7,)], 7),  # one member
    ([], None),  # no members
    ([(0,), (0, 5)], 0),  # step 0 is a step
])
def test_the_restore_step_is_the_newest_step_common_to_every_member(
        reported: list[tuple[int, ...]], expected: int | None) -> None:
    assert common_restore_step(reported) == expected


@pytest.mark.parametrize(("reported", "shared", "expected"), [
    # A survivor of a peer's failure wrote step 37 to the backup dir after the failed node had joined: every
    # member reads the backup dir, so it counts as the failed node's too.
    ([(37, 30, 20), (30, 20)], (37, 20), 37),
    ([(30,), ()], (30,), 30),  # a member whose own scan found nothing still reads the backup dir
    ([(40, 30), (30,)], (), 30),  # nothing in the backup dir: the intersection as before
    ([(40,), (50,)], (20,), 20),  # local steps apart, a shared one in common
])
def test_a_step_in_the_backup_dir_counts_as_every_members(
        reported: list[tuple[int, ...]], shared: tuple[int, ...], expected: int | None) -> None:
    assert common_restore_step(reported, shared) == expected


def test_the_choice_reads_the_members_lazily_and_stops_at_the_first_empty_intersection() -> None:
    seen: list[int] = []

    def members() -> Iterator[tuple[int, ...]]:
        for i, steps in enumerate([(1,), (2,), (3,)]):
            seen.append(i)
            yield steps

    assert common_restore_step(members()) is None
    assert seen == [0, 1]


# ---------------------------------------------------------------------------------------- the coordinator


def info(node_id: str, *steps: int, **changes: object) -> NodeInfo:
    return NodeInfo(node_id, f"{node_id}.cluster", 2222, restorable_steps=steps, **changes)  # type: ignore[arg-type]


def assignments_of(sends: list[api.Send]) -> dict[str, Assignment]:
    return {s.node_id: s.order for s in sends if isinstance(s.order, Assignment)}


def formed(*nodes: NodeInfo) -> tuple[Rendezvous, dict[str, Assignment]]:
    clock = FakeClock()
    rv = Rendezvous(dataclasses.replace(SETTINGS), clock)
    sends: list[api.Send] = []
    for node in nodes:
        sends += rv.join(node, SPEC)
    clock.now = 1.5
    for node in nodes:
        rv.heartbeat(node.node_id)
    sends += rv.tick()
    return rv, assignments_of(sends)


def test_every_member_is_assigned_the_common_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tfelastic.coordinator")
    rv, orders = formed(info("a", 30, 20, 10), info("b", 20, 10))
    assert {n: o.restore_step for n, o in orders.items()} == {"a": 20, "b": 20}
    assert rv.restore_step == 20
    assert "generation 1 restores step 20 (common to all 2 members)" in caplog.text
    # a has newer work than the step restored: it is named
    assert "generation 1: node a has a newer snapshot (step 30) than step 20; its newer work is redone" in caplog.text
    assert "node b has" not in caplog.text


def test_the_coordinator_counts_a_members_backup_dir_steps_as_everyones() -> None:
    rv, orders = formed(info("a", 30, 20), info("b", 37, 30, 20, shared_steps=(37, 20)))
    assert rv.restore_step == 37
    assert {n: o.restore_step for n, o in orders.items()} == {"a": 37, "b": 37}


def test_without_a_common_step_the_assignment_has_none(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tfelastic.coordinator")
    _, orders = formed(info("a", 30), info("b"))
    assert {o.restore_step for o in orders.values()} == {None}
    assert "generation 1: no snapshot step common to all 2 members" in caplog.text
    assert "node a has a snapshot of step 30 that not every member has" in caplog.text
    caplog.clear()
    formed(info("a"), info("b"))
    assert "no snapshot step common to all 2 members (none reported a snapshot)" in caplog.text


def test_many_members_with_newer_snapshots_are_summed_up(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tfelastic.coordinator")
    clock = FakeClock()
    rv = Rendezvous(SETTINGS, clock)
    spec = dataclasses.replace(SPEC, min_nodes=1, max_nodes=20)
    sends = [s for i in range(15) for s in rv.join(info(f"n{i:02d}", 30, 20), spec)]
    sends += rv.join(info("old", 20), spec)
    clock.now = 1.5
    for node in rv.status().nodes:
        rv.heartbeat(node.node_id)
    orders = assignments_of(sends + rv.tick())
    assert {o.restore_step for o in orders.values()} == {20}
    named = [r for r in caplog.records if "has a newer snapshot" in r.getMessage()]
    assert len(named) == NEWER_SNAPSHOTS_LOGGED
    assert f"generation 1: {15 - NEWER_SNAPSHOTS_LOGGED} more members have newer snapshots" in caplog.text


def test_a_rejoin_reports_fresh_steps_for_the_next_generation() -> None:
    """Agents join again after every stop; the steps of that Join, not the first one's, count."""
    rv, orders = formed(info("a", 10), info("b", 10))
    assert orders["a"].restore_step == 10
    stops = rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 3")
    assert {s.node_id for s in stops} == {"a", "b"}
    rv.join(info("a", 30, 20, 10, last_generation=1), SPEC, rejoin=True)
    sends = rv.join(info("b", 20, 10, last_generation=1), SPEC, rejoin=True)
    orders = assignments_of(sends)
    assert rv.generation == 2 and {o.restore_step for o in orders.values()} == {20}


def test_a_member_that_lost_its_snapshots_pulls_the_step_back_to_what_it_has() -> None:
    """A replacement node sees only the backup dir (older, copied in the background): the generation restores
    from there, and the others' newer local snapshots are redone."""
    rv, _ = formed(info("a", 50, 40), info("b", 50, 40))
    rv.disconnect("b")
    rv.join(info("a", 60, 50, 40, last_generation=1), SPEC, rejoin=True)
    orders = assignments_of(rv.join(info("c", 40, 30), SPEC))
    assert {n: o.restore_step for n, o in orders.items()} == {"a": 40, "c": 40}


# -------------------------------------------------------------------------------------------- the wire


def test_a_join_carries_its_restorable_steps_both_ways() -> None:
    join = api.Join(info("a", 30, 20, 10, incarnation="i", last_generation=4, last_rank=1, last_world_size=3), SPEC,
                    restart_count=2)
    wire = convert.agent_message_to_proto(join, now=0.0)
    assert list(wire.join.restorable_steps) == [30, 20, 10]
    assert wire.join.last_world_size == 3  # a coordinator that starts without state waits for that many
    assert convert.agent_message_from_proto(wire, now=0.0) == join
    empty = api.Join(info("a"), SPEC)
    assert convert.agent_message_from_proto(convert.agent_message_to_proto(empty, 0.0), 0.0) == empty


@pytest.mark.parametrize("step", [None, 0, 120, 2**40])
def test_an_assignment_carries_its_restore_step_both_ways(step: int | None) -> None:
    members = (Member("a", 0, "10.0.0.1", 2222), Member("b", 1, "10.0.0.2", 2222))
    order = Assignment(3, 1, 2, members, 5, step)
    template = convert.assignment_template(order)
    wire = convert.order_to_proto(order, template)
    assert wire.assignment.has_restore_step == (step is not None)
    assert convert.coordinator_message_from_proto(wire) == order
    assert convert.coordinator_message_from_proto(convert.order_to_proto(order)) == order  # without a template


def test_an_old_coordinators_assignment_has_no_restore_step() -> None:
    wire = pb.CoordinatorMessage(assignment=pb.Assignment(generation=1, world_size=1, restart_count=0))
    message = convert.coordinator_message_from_proto(wire)
    assert isinstance(message, Assignment) and message.restore_step is None


def valid_join(**changes: object) -> pb.Join:
    return pb.Join(node_id="a", spec=convert.spec_to_proto(SPEC), host="10.0.0.1", worker_port=2222, last_rank=-1,
                   **changes)  # type: ignore[arg-type]


def test_the_coordinator_takes_as_many_steps_as_an_agent_reports() -> None:
    assert snapshots.MAX_REPORTED <= bounds.MAX_RESTORABLE_STEPS
    bounds.validate_join(valid_join(restorable_steps=list(range(bounds.MAX_RESTORABLE_STEPS))))
    bounds.validate_join(valid_join(restorable_steps=[0, bounds.MAX_STEP]))


@pytest.mark.parametrize("field", ["restorable_steps", "shared_steps"])
@pytest.mark.parametrize(("steps", "named"), [
    (list(range(bounds.MAX_RESTORABLE_STEPS + 1)), "has 65 steps, more than 64"),
    ([10, -1], "holds a step out of range"),
    ([bounds.MAX_STEP + 1], "holds a step out of range"),
])
def test_out_of_range_restorable_steps_are_refused(field: str, steps: list[int], named: str) -> None:
    with pytest.raises(api.ProtocolError, match=r"^invalid Join: .*" + field + " " + named):
        bounds.validate_join(valid_join(**{field: steps}))


def test_a_joins_steps_in_the_backup_dir_cross_the_wire_both_ways() -> None:
    node = info("a", 37, 30, shared_steps=(37,))
    join = api.Join(node, SPEC, 0)
    wire = convert.agent_message_to_proto(join, 0.0)
    assert list(wire.join.shared_steps) == [37]
    assert convert.agent_message_from_proto(wire, 0.0) == join
    old = pb.AgentMessage(join=valid_join(restorable_steps=[30]))  # an agent older than the field
    decoded = convert.agent_message_from_proto(old, 0.0)
    assert isinstance(decoded, api.Join) and decoded.node.shared_steps == ()


# --------------------------------------------------------------------------------------------- the agent


def core() -> AgentCore:
    identity = Identity("n1", "10.0.0.1", SPEC, "incarnation-1")
    timing = Timing(0.5, 2.0, 600.0, StallLimits(fixed=10.0), stop_grace=10.0)
    return AgentCore(identity, timing, Connection("head:29400"), AgentMetrics(CollectorRegistry(), "mnist", "n1"),
                     FakeClock(100.0), pick_port=lambda host: 5555)


def joins(actions: Sequence[object]) -> list[api.Join]:
    return [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, api.Join)]


def test_every_join_carries_the_steps_the_shell_read_last() -> None:
    c = core()
    c.node_read(restorable=RestorableSteps((40, 30), (30,)))
    [first] = joins(c.session_opened())
    assert (first.node.restorable_steps, first.node.shared_steps) == ((40, 30), (30,))
    members = (Member("n1", 0, "10.0.0.1", 5555),)
    c.received(Assignment(1, 0, 1, members, 0, restore_step=30))
    c.worker_started(1, 4000)
    c.received(api.StopWorkers(1, RestartReason.WORKER_EXIT))
    assert c.worker_gone(()) == [ScanSnapshots()]  # the shell reads the steps again before it reports the stop
    c.node_read(restorable=RestorableSteps((50, 40, 30), (50, 30)))
    [rejoin] = joins(c.worker_stopped(StopResult(-15, False)))
    assert (rejoin.node.restorable_steps, rejoin.node.shared_steps) == ((50, 40, 30), (50, 30))


def test_a_stop_for_leaving_is_not_followed_by_a_join() -> None:
    c = core()
    c.session_opened()
    c.received(Assignment(1, 0, 1, (Member("n1", 0, "10.0.0.1", 5555),), 0))
    c.worker_started(1, 4000)
    c.received(api.DrainNode("maintenance"))
    assert c.worker_gone(()) == []  # no Join follows: nothing to read for one


# ------------------------------------------------------------------------------------------- the trainer

ASSIGNMENT = Assignment(2, 1, 2, (Member("a", 0, "10.0.0.1", 2222), Member("b", 1, "10.0.0.2", 2222)), 1, 120)


def env_of(assignment: Assignment = ASSIGNMENT, local: str | None = "/dev/shm/tfelastic/mnist/b",
           base: dict[str, str] | None = None) -> dict[str, str]:
    return trainer_env(base or {}, assignment, job="mnist", node_id="b", backup_dir="/backup/mnist",
                       progress_socket="/p", instrument=False, local_checkpoint_dir=local)


def test_the_trainer_gets_the_restore_step_and_the_local_tier() -> None:
    env = env_of()
    assert env[RESTORE_STEP_ENV] == "120" and env[LOCAL_CHECKPOINT_DIR_ENV] == "/dev/shm/tfelastic/mnist/b"
    trainer = TrainerEnvironment.from_env(env)
    assert (trainer.restore_step, trainer.local_checkpoint_dir) == (120, "/dev/shm/tfelastic/mnist/b")


def test_without_a_restore_step_or_a_local_tier_the_trainer_gets_neither() -> None:
    env = env_of(dataclasses.replace(ASSIGNMENT, restore_step=None), local=None)
    assert RESTORE_STEP_ENV not in env and LOCAL_CHECKPOINT_DIR_ENV not in env
    assert env_of(dataclasses.replace(ASSIGNMENT, restore_step=0))[RESTORE_STEP_ENV] == "0"


def test_values_in_the_agents_own_environment_never_reach_the_trainer() -> None:
    """Only the agent decides them: an agent started from a trainer's shell must not pass its values on."""
    inherited = {RESTORE_STEP_ENV: "999", LOCAL_CHECKPOINT_DIR_ENV: "/elsewhere"}
    env = env_of(dataclasses.replace(ASSIGNMENT, restore_step=None), local=None, base=inherited)
    assert RESTORE_STEP_ENV not in env and LOCAL_CHECKPOINT_DIR_ENV not in env
