"""Unit tests of bad nodes set aside (:mod:`tfelastic.daemon.rendezvous.quarantine` inside the rendezvous state
machine): strikes, the min_nodes rule, cooldowns and their doubling, the node check at re-admission, an operator's
readmit, and the quarantine's way through etcd. Pure logic over a fake clock; every test asserts exact orders."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pytest
from tfelastic.daemon.rendezvous.api import (
    CheckNode,
    DrainNode,
    JobSpec,
    JobState,
    Join,
    NodeInfo,
    NodeState,
    OperatorRefusedError,
    ProbeWorkerPort,
    RestartReason,
    Send,
)
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.state import PROBE_SECONDS, Rendezvous

from tests.fakes import FakeClock
from tests.unit.test_rendezvous_state import (
    SCALE_UP,
    SETTINGS,
    assignments,
    at,
    finished,
    info,
    join,
    rejoin,
    running,
    spec,
    stops,
    waiting,
)

COOLDOWN = SETTINGS.quarantine_cooldown_seconds
IDS = ["a", "b", "c"]


def fail(rv: Rendezvous, clock: FakeClock, now: float, node_id: str, detail: str = "trainer exited with code 1"
         ) -> list[Send]:
    at(clock, rv, now)
    return rv.worker_failed(node_id, rv.generation, RestartReason.WORKER_EXIT, detail)


def rejoin_each(rv: Rendezvous, ids: Sequence[str]) -> list[Send]:
    """Every id confirms its stop; returns every order of every rejoin."""
    sends: list[Send] = []
    for node_id in ids:
        sends += rejoin(rv, node_id)
    return sends


def checked(rv: Rendezvous, node_id: str, failure: str = "", *, again: bool = True) -> list[Send]:
    """The node's Join with a node check's result (``again``: on its open session, answering CheckNode)."""
    return rv.join(info(node_id), rv.spec or spec(), rejoin=again, checked=True, check_failure=failure)


def quarantined_c(clock: FakeClock) -> Rendezvous:
    """A 2:3 job whose node c failed first twice: it is set aside, and a and b run generation 3."""
    rv = running(clock, IDS)
    fail(rv, clock, 10.0, "c")
    rejoin_each(rv, IDS)
    sends = fail(rv, clock, 20.0, "c")
    assert sends == stops(2, IDS, RestartReason.WORKER_EXIT)
    assert rv.reason == f"worker_exit: c: trainer exited with code 1; c quarantined for {COOLDOWN:g}s"
    assert rejoin(rv, "c") == waiting("c", 0, f"quarantined for {COOLDOWN:.0f}s more: its worker failed first in 2 "
                                              "generations within 3600s; last: trainer exited with code 1")
    assert rejoin_each(rv, ["a", "b"])[-2:] == assignments(3, ["a", "b"], restarts=2)
    return rv


def test_a_node_whose_worker_fails_first_twice_is_set_aside_and_the_others_go_on() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    snap = rv.status()
    assert (snap.state, snap.world_size, snap.quarantines_by_kind) == (JobState.RUNNING, 2, {"worker_failures": 1})
    c = next(n for n in snap.nodes if n.node_id == "c")
    assert (c.state, c.rank, c.quarantine_kind, c.quarantined_until) == (
        NodeState.QUARANTINED, -1, "worker_failures", 20.0 + COOLDOWN)
    assert c.quarantine_reason.endswith("last: trainer exited with code 1")


def test_only_the_failure_that_stops_the_generation_is_a_strike() -> None:
    clock = FakeClock()
    rv = running(clock, IDS)
    for now in (10.0, 20.0):
        fail(rv, clock, now, "a")
        fail(rv, clock, now, "c")  # c's trainer died of a's fault: an echo, not a strike
        rejoin_each(rv, ["b", "c", "a"])
    assert rv.quarantine.held.keys() == {"a"}


def test_a_node_is_not_set_aside_when_fewer_than_min_nodes_would_remain(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rv = running(clock, ["a", "b"], max_nodes=2)
    for now in (10.0, 20.0, 30.0):
        fail(rv, clock, now, "b")
        expected = assignments(rv.generation + 1, ["a", "b"], rv.restarts_total)
        assert rejoin_each(rv, ["a", "b"])[-2:] == expected
    assert rv.quarantine.held == {}
    assert "b failed first in 2 generations, but is not quarantined: only 1 other node(s) for min_nodes=2" in \
        caplog.text


def test_a_second_bad_node_is_not_set_aside_below_min_nodes() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)  # a and b left, min_nodes 2
    fail(rv, clock, 30.0, "b")
    rejoin_each(rv, ["a", "b"])
    fail(rv, clock, 40.0, "b")
    assert rv.quarantine.held.keys() == {"c"}


def test_strikes_older_than_the_window_are_forgotten() -> None:
    clock = FakeClock()
    rv = running(clock, IDS)
    fail(rv, clock, 10.0, "c")
    rejoin_each(rv, IDS)
    fail(rv, clock, 10.0 + SETTINGS.quarantine_window_seconds + 1, "c")
    assert rv.quarantine.held == {}


def test_quarantine_after_zero_never_sets_a_node_aside() -> None:
    clock = FakeClock()
    rv = Rendezvous(dataclasses.replace(SETTINGS, quarantine_after=0), clock, spec())
    join(rv, *IDS)
    at(clock, rv, SETTINGS.last_call_seconds)
    rv.tick()
    for now in (10.0, 20.0, 30.0):
        fail(rv, clock, now, "c")
        rejoin_each(rv, IDS)
    assert rv.quarantine.held == {} and rv.generation == 4


def test_after_the_cooldown_the_node_is_checked_and_admitted_if_the_check_passes() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    until = 20.0 + COOLDOWN
    assert rv.next_deadline() is not None
    at(clock, rv, until - 0.5)
    assert rv.tick() == []
    at(clock, rv, until)
    assert rv.tick() == [Send("c", CheckNode("the quarantine's cooldown is over"))]
    at(clock, rv, until + 1)
    assert rv.tick() == []  # asked once
    assert checked(rv, "c") == waiting("c", 1, SCALE_UP)  # admitted: the job grows to take it in again
    assert rv.quarantine.held == {}
    assert [(m.kind, m.detail) for m in rv.goodput.marks][-1] == ("readmitted", "it passed its node check")
    at(clock, rv, until + 1 + SETTINGS.settle_seconds)
    assert rv.tick() == stops(3, ["a", "b"], RestartReason.SCALE_UP)


def test_a_node_whose_check_fails_again_stays_aside_twice_as_long() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    at(clock, rv, 20.0 + COOLDOWN)
    rv.tick()
    sends = checked(rv, "c", "backup dir /b is not writable: Read-only file system")
    assert sends == waiting("c", 0, f"quarantined for {2 * COOLDOWN:.0f}s more: node check failed: backup dir /b is "
                                    "not writable: Read-only file system")
    assert rv.quarantine.held["c"].until == clock.now + 2 * COOLDOWN
    assert rv.status().quarantines_by_kind == {"worker_failures": 1, "node_check": 1}
    assert [m.kind for m in rv.goodput.marks] == ["quarantined", "quarantined"]  # never readmitted in between


def test_the_cooldown_doubles_up_to_its_cap() -> None:
    settings = dataclasses.replace(SETTINGS, quarantine_cooldown_seconds=10.0, quarantine_cooldown_max_seconds=35.0)
    rv = Rendezvous(settings, FakeClock(), spec())
    assert [rv.quarantine.cooldown(n) for n in range(4)] == [10.0, 20.0, 35.0, 35.0]


def test_a_join_without_a_check_after_the_cooldown_is_asked_for_one() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    at(clock, rv, 20.0 + COOLDOWN)
    rv.tick()
    rv.disconnect("c")  # its agent restarted, and its first Join came before it could check (or it lost it)
    sends = rv.join(info("c"), spec())
    assert sends == [*waiting("c", 0, "quarantined, waiting for its node check: its worker failed first in 2 "
                                      "generations within 3600s; last: trainer exited with code 1"),
                     Send("c", CheckNode("the quarantine's cooldown is over"))]


def test_a_failed_node_check_sets_a_node_aside_at_its_first_join() -> None:
    clock = FakeClock()
    rv = Rendezvous(SETTINGS, clock, spec())
    join(rv, "a", "b")
    sends = checked(rv, "c", "c cannot be reached at c.cluster:2222 from the coordinator: Connection refused",
                    again=False)
    assert sends == waiting("c", 2, f"quarantined for {COOLDOWN:.0f}s more: node check failed: c cannot be "
                                    "reached at c.cluster:2222 from the coordinator: Connection refused")
    at(clock, rv, SETTINGS.last_call_seconds)
    assert rv.tick() == assignments(1, ["a", "b"])


def test_a_failed_check_sets_a_node_aside_even_below_min_nodes() -> None:
    clock = FakeClock()
    rv = Rendezvous(dataclasses.replace(SETTINGS, join_timeout_seconds=60.0), clock, spec())
    join(rv, "a")
    checked(rv, "b", "GPU 0 (GPU-1): 3 uncorrectable ECC error(s) since the driver loaded", again=False)
    at(clock, rv, 60.0)
    reason = "only 1 of min_nodes=2 nodes joined within join_timeout=60s (1 quarantined: b)"
    assert rv.tick() == finished(["a", "b"], JobState.FAILED, reason)


def test_a_readmit_survives_a_coordinator_failover() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    at(clock, rv, 30.0)
    rv.readmit("c")
    assert rv.status().nodes[-1].quarantined_until == 30.0  # no cooldown left: it waits for its check
    recorded = DurableState.from_json(rv.durable(wall_offset=1000.0).to_json())
    successor = Rendezvous(SETTINGS, FakeClock(30.0))
    successor.take_over(recorded, wall_offset=1000.0, grace=2.0)
    sends = successor.join(info("c"), spec())  # the readmitted node reconnects to the new coordinator
    assert sends[-1] == Send("c", CheckNode("the quarantine's cooldown is over"))
    assert checked(successor, "c") == waiting("c", 1, SCALE_UP)
    assert successor.quarantine.times_quarantined("c") == 0  # the readmit forgot its history, on etcd too


def test_an_operator_readmits_a_node_which_joins_once_its_check_passes() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    with pytest.raises(OperatorRefusedError, match=r"node 'a' is not quarantined \(quarantined nodes: c\)"):
        rv.readmit("a")
    at(clock, rv, 30.0)  # long before the cooldown ends
    assert rv.readmit("c") == [Send("c", CheckNode("readmitted by an operator"))]
    assert checked(rv, "c") == waiting("c", 1, SCALE_UP)
    # Its history is forgotten: one more failure does not set it aside again.
    at(clock, rv, 40.0)
    rv.tick()
    rejoin_each(rv, ["a", "b"])
    fail(rv, clock, 50.0, "c")
    assert rv.quarantine.held == {}


def test_a_quarantined_node_does_not_count_for_a_drain() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    with pytest.raises(OperatorRefusedError, match="would leave 1 node"):
        rv.drain("a", "maintenance")


def test_a_quarantined_node_can_be_drained_for_good() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    rv.disconnect("b")  # even with the job below min_nodes now: draining c takes away nothing it has
    assert rv.drain("c", "the GPU goes back to the vendor") == [Send("c", DrainNode("the GPU goes back to the vendor"))]


def test_a_quarantine_recorded_before_checking_was_kept_is_read_as_not_checking() -> None:
    clock = FakeClock()
    doc = json.loads(quarantined_c(clock).durable(wall_offset=0.0).to_json())
    del doc["quarantined"]["c"]["checking"]
    assert DurableState.from_json(json.dumps(doc).encode()).quarantined["c"]["checking"] is False


def test_no_quarantine_is_recorded_when_the_failure_ends_the_job() -> None:
    clock = FakeClock()
    rv = running(clock, IDS, max_restarts=1)
    fail(rv, clock, 10.0, "c")
    rejoin_each(rv, IDS)
    fail(rv, clock, 20.0, "c")  # the second failure exhausts the budget: nothing is left to set c aside from
    assert rv.state is JobState.FAILED and "quarantined" not in rv.reason
    assert rv.quarantine.held == {} and rv.status().quarantines_by_kind == {}


def test_a_quarantined_node_leaves_at_once() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    assert rv.leave("c", "agent stopped (SIGTERM)") == []
    assert [n.node_id for n in rv.status().nodes] == ["a", "b"]


def test_a_quarantine_survives_a_coordinator_failover() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    recorded = DurableState.from_json(rv.durable(wall_offset=1000.0).to_json())
    assert recorded.quarantined["c"]["until"] == 1000.0 + 20.0 + COOLDOWN
    successor_clock = FakeClock(5.0)  # another machine's monotonic clock: 15 s behind
    successor = Rendezvous(SETTINGS, successor_clock)
    successor.take_over(recorded, wall_offset=1015.0, grace=2.0)
    assert successor.quarantine.held["c"].until == 5.0 + COOLDOWN
    assert successor.join(info("c"), spec()) == waiting(
        "c", 0, f"quarantined for {COOLDOWN:.0f}s more: its worker failed first in 2 generations within 3600s; "
                "last: trainer exited with code 1")
    successor.quarantine.quarantine("c", "node_check", "again", now=10.0)
    assert successor.quarantine.held["c"].until == 10.0 + 2 * COOLDOWN  # c had been set aside once: it doubles


@pytest.mark.parametrize("entry", [
    {"kind": "worker_failures", "reason": "x", "until": 1.0, "checking": False},  # no count
    {"kind": "cosmic_rays", "reason": "x", "until": 1.0, "checking": False, "quarantines": 1},
    {"kind": "node_check", "reason": "x", "until": "soon", "checking": False, "quarantines": 1},
    {"kind": "node_check", "reason": "x", "until": float("nan"), "checking": False, "quarantines": 1},
    {"kind": "node_check", "reason": "x", "until": 1.0, "checking": False, "quarantines": -1},
    {"kind": "node_check", "reason": "x", "until": 1.0, "checking": False, "quarantines": float("inf")},
    {"kind": "node_check", "reason": "x", "until": 1.0, "checking": "yes", "quarantines": 1},
    "not an object",
])
def test_a_malformed_quarantine_in_etcd_is_refused_as_malformed(entry: object) -> None:
    clock = FakeClock()
    doc = json.loads(running(clock, IDS).durable(wall_offset=0.0).to_json())
    doc["quarantined"] = {"c": entry}
    with pytest.raises(ValueError):
        DurableState.from_json(json.dumps(doc).encode())


def test_a_node_readmitted_while_away_is_checked_when_it_comes_back() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    rv.disconnect("c")
    at(clock, rv, 30.0)
    assert rv.readmit("c") == []  # nobody to ask now
    assert checked(rv, "c", again=False) == waiting("c", 1, SCALE_UP)  # its agent's first Join carries a check


def _checked_join(node_id: str, job_spec: JobSpec, *, checked: bool = True, failure: str = "") -> Join:
    return Join(NodeInfo(node_id, "10.0.0.3", 2222), job_spec, checked=checked, check_failure=failure)


@pytest.mark.parametrize(("probe_nodes", "checked", "failure", "probed"), [
    (True, True, "", True),
    (True, False, "", False),  # no check, no listener: nothing to reach
    (True, True, "backup dir /b is not writable", False),  # set aside already
    (False, True, "", False),  # --no-node-probe
])
def test_which_joins_the_coordinator_probes(probe_nodes: bool, checked: bool, failure: str, probed: bool) -> None:
    clock = FakeClock()
    rv = Rendezvous(dataclasses.replace(SETTINGS, probe_nodes=probe_nodes), clock, spec())
    probe = rv.probe_for(_checked_join("c", spec(), checked=checked, failure=failure))
    assert (probe.node_id, probe.host, probe.port) == ("c", "10.0.0.3", 2222) if probe else not probed
    assert (probe is not None) is probed
    assert rv.probe_for(_checked_join("c", spec(job="other"))) is None  # refused anyway: no connection for it


@pytest.mark.parametrize(("node_timeout", "heartbeat", "timeout"), [(2.0, 0.5, 0.75), (30.0, 1.0, PROBE_SECONDS)])
def test_a_probe_ends_well_within_the_liveness_timeout(node_timeout: float, heartbeat: float, timeout: float) -> None:
    """The session waits for the probe, and the agent fences after node_timeout - heartbeat without an answer."""
    timing = dataclasses.replace(spec(), node_timeout_seconds=node_timeout, heartbeat_interval_seconds=heartbeat)
    assert rv_probe(timing) == ProbeWorkerPort("c", "10.0.0.3", 2222, timeout)


def rv_probe(job_spec: JobSpec) -> ProbeWorkerPort | None:
    return Rendezvous(SETTINGS, FakeClock()).probe_for(_checked_join("c", job_spec))


def test_a_standalone_coordinator_probes_its_first_join_but_not_after_the_verdict() -> None:
    rv = Rendezvous(SETTINGS, FakeClock())  # no spec until the first Join brings one
    assert rv.probe_for(_checked_join("a", spec())) is not None
    rv.rounds.state = JobState.SUCCEEDED
    assert rv.probe_for(_checked_join("a", spec())) is None


def test_the_timeline_marks_each_quarantine_readmission_and_drain() -> None:
    clock = FakeClock()
    rv = quarantined_c(clock)
    at(clock, rv, 30.0)
    rv.readmit("c")
    checked(rv, "c")
    at(clock, rv, 20.0 + 2 * COOLDOWN)
    checked(rv, "d", "no GPU found", again=False)
    rv.drain("a", "maintenance")
    assert [(m.at, m.kind, m.node, m.detail) for m in rv.goodput.marks] == [
        (20.0, "quarantined", "c", "its worker failed first in 2 generations within 3600s; last: trainer exited "
                                   "with code 1"),
        (30.0, "readmitted", "c", "an operator readmitted it; it passed its node check"),
        (20.0 + 2 * COOLDOWN, "quarantined", "d", "node check failed: no GPU found"),
        (20.0 + 2 * COOLDOWN, "drained", "a", "maintenance")]
    assert [m.kind for m in rv.status().goodput.marks] == [  # type: ignore[union-attr]
        "quarantined", "readmitted", "quarantined", "drained"]
