"""A job state read from etcd is checked field by field (rendezvous/durable_check.py): valid JSON of the wrong
type or out of range is refused with the field's name, before any of it reaches the coordinator; and a successor
does not take wall-clock times from the future at their word."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tfelastic.daemon.rendezvous.api import JobSpec, JobState, Member, RendezvousSettings, RestartReason
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.durable_check import BadField
from tfelastic.daemon.rendezvous.state import Rendezvous

from tests.fakes import FakeClock

SPEC = JobSpec("job", b"\x01" * 32, 2, 3, 3, 60.0, 300.0, "/backup")
MEMBERS = (Member("a", 0, "a.cluster", 1234), Member("b", 1, "b.cluster", 1234))
GOOD = DurableState(SPEC, JobState.RUNNING, "", 4, MEMBERS,
                    restarts_total=3, restarts_by_reason={"worker_exit": 3}, failures=(1000.0, 1010.0),
                    failed_in_a_row=1, drained=("c",), reached_step=40, checkpoint_step=30, steps_redone=5,
                    warnings=("w",), quarantined={"d": {"kind": "node_check", "reason": "r", "until": 2000.0,
                                                       "checking": False, "quarantines": 1}})


def doc() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(GOOD.to_json())
    return document


def test_a_state_this_version_wrote_reads_back_as_it_was() -> None:
    assert DurableState.from_json(GOOD.to_json()) == GOOD


def _set(path: str, value: Any) -> bytes:
    """The good state with the value at ``path`` (dots and [i]) replaced; ``...`` deletes it."""
    document = doc()
    *parents, last = path.replace("[", ".").replace("]", "").split(".")
    node: Any = document
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is ...:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return json.dumps(document).encode()


@pytest.mark.parametrize(("path", "value", "named"), [
    ("generation", "1", "generation"),  # every Join raised TypeError
    ("generation", 2 ** 80, "generation"),  # every write overflowed the protobuf field
    ("generation", -1, "generation"),
    ("generation", True, "generation"),
    ("generation", 1.5, "generation"),
    ("generation", ..., "generation"),
    ("state", "exploded", "state"),
    ("spec", None, "spec"),  # a running job always had a spec
    ("spec.min_nodes", "2", "spec.min_nodes"),
    ("spec.min_nodes", 0, "spec.min_nodes"),
    ("spec.max_nodes", 1, "spec.max_nodes"),  # below min_nodes
    ("spec.max_restarts", -1, "spec.max_restarts"),
    ("spec.job", "a/b", "spec.job"),
    ("spec.command_digest", "zz" * 32, "spec.command_digest"),
    ("spec.command_digest", "ab", "spec.command_digest"),
    ("spec.restart_window_seconds", "60", "spec.restart_window_seconds"),
    ("spec.stall_timeout_seconds", -5.0, "spec.stall_timeout_seconds"),
    ("spec.node_timeout_seconds", 0.1, "spec.node_timeout_seconds"),  # below the heartbeat interval
    ("spec.surprise", 1, "spec.'surprise'"),
    ("members", {"a": 0}, "members"),
    ("members", [[1, 2]], "members[0]"),
    ("members[0].rank", "0", "members[0].rank"),
    ("members[1].rank", 0, "members[1].rank"),  # two members of rank 0
    ("members[1].node_id", "a", "members[1].node_id"),
    ("members[0].node_id", "../../etc", "members[0].node_id"),
    ("members[0].worker_port", 70000, "members[0].worker_port"),
    ("members[0].host", ["x"], "members[0].host"),
    ("restarts_total", -3, "restarts_total"),
    ("restarts_total", 2 ** 40, "restarts_total"),
    ("restarts_by_reason", {"gremlins": 1}, "restarts_by_reason.'gremlins'"),
    ("restarts_by_reason", {"worker_exit": -1}, "restarts_by_reason.'worker_exit'"),
    ("restarts_by_reason", [1], "restarts_by_reason"),
    ("failures", [float("nan")], "failures[0]"),
    ("failures", ["yesterday"], "failures[0]"),
    ("failures", [1.0] * 100_002, "failures"),
    ("failed_in_a_row", -1, "failed_in_a_row"),
    ("chief_succeeded", "yes", "chief_succeeded"),
    ("drained", "c", "drained"),
    ("drained", [5], "drained[0]"),
    ("reached_step", 2 ** 62, "reached_step"),
    ("checkpoint_step", -2, "checkpoint_step"),
    ("steps_redone", -1, "steps_redone"),
    ("steps_lost", 2 ** 64, "steps_lost"),
    ("warnings", [{"text": "w"}], "warnings[0]"),
    ("warnings", ["w"] * 65, "warnings"),
    ("quarantined.d.until", 1e300, "quarantined.d.until"),
    ("quarantined.d.quarantines", "1", "quarantined.d.quarantines"),
    ("quarantined", {" bad id": {}}, "quarantined.' bad id'"),
    ("surprise", 1, "'surprise'"),
])
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_its_field(path: str, value: Any, named: str) -> None:
    with pytest.raises(BadField) as refused:
        DurableState.from_json(_set(path, value))
    assert refused.value.field == named, refused.value


def test_an_infinite_failure_time_is_refused() -> None:
    """JSON has no infinity, but 1e400 parses as one: it spent the whole restart budget at once."""
    data = _set("failures", [1.0]).replace(b"[1.0]", b"[1e400]")
    with pytest.raises(BadField, match=r"failures\[0\]: inf is not a finite number"):
        DurableState.from_json(data)


def test_a_long_value_is_shown_short_and_printable() -> None:
    with pytest.raises(BadField) as refused:
        DurableState.from_json(_set("generation", "\x1b[2J" + "9" * 100_000))
    assert len(str(refused.value)) < 200 and "\x1b" not in str(refused.value)


@pytest.mark.parametrize("data", [b"[1]", b"[" * 100_000 + b"]" * 100_000, b"\xff", b"null", b"{}"])
def test_what_is_not_a_state_object_at_all_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        DurableState.from_json(data)


def test_the_fields_later_versions_added_may_be_missing() -> None:
    document = doc()
    for key in ("restarts_total", "restarts_by_reason", "failures", "failed_in_a_row", "chief_succeeded", "drained",
                "reached_step", "checkpoint_step", "steps_redone", "steps_lost", "warnings", "quarantined"):
        del document[key]
    del document["spec"]["heartbeat_interval_seconds"], document["spec"]["node_timeout_seconds"]
    recorded = DurableState.from_json(json.dumps(document).encode())
    assert (recorded.generation, recorded.restarts_total, recorded.quarantined) == (4, 0, {})


def test_a_successor_counts_a_failure_time_from_the_future_as_now() -> None:
    """A failure recorded in the future (a wall clock far ahead, or a hand-edited state) would hold a slot of the
    restart budget until that time comes: it counts from the take-over instead."""
    clock = FakeClock(50.0)
    successor = Rendezvous(RendezvousSettings(), clock)
    successor.take_over(DurableState.from_json(_set("failures", [1020.0, 9e10])), wall_offset=1000.0, grace=2.0)
    assert list(successor.restarts.export(1000.0)["failures"]) == [1020.0, 1050.0]
    clock.now = 50.0 + SPEC.restart_window_seconds + 1  # both recorded failures are out of the window now
    assert not successor.restarts.budget_exhausted(RestartReason.WORKER_EXIT, SPEC)
    assert successor.restarts.failures_in_window == 1


def test_a_successor_holds_a_quarantine_no_longer_than_the_longest_cooldown() -> None:
    clock = FakeClock(50.0)
    settings = RendezvousSettings()
    successor = Rendezvous(settings, clock)
    successor.take_over(DurableState.from_json(_set("quarantined.d.until", 9e10)), wall_offset=1000.0, grace=2.0)
    assert successor.quarantine.held["d"].until == 50.0 + settings.quarantine_cooldown_max_seconds


def _with_ledger() -> DurableState:
    from tfelastic.daemon.rendezvous.goodput import ChiefReport, GoodputLedger

    clock = FakeClock(10.0)
    ledger = GoodputLedger(clock)
    ledger.formed(4, ["a", "b"])
    clock.now += 3.0
    ledger.reported(ChiefReport(30))
    ledger.marked("drained", "b", "maintenance")
    return DurableState(SPEC, JobState.RUNNING, "", 4, MEMBERS, goodput=ledger.export(1_700_000_000.0))


def test_the_goodput_ledger_reads_back_as_it_was_written() -> None:
    state = _with_ledger()
    assert DurableState.from_json(state.to_json()) == state
    assert state.goodput is not None and state.goodput["marks"] == [[1_700_000_013.0, "drained", "b", "maintenance"]]


def test_a_ledger_an_older_coordinator_wrote_without_marks_or_reached_steps_reads() -> None:
    document = json.loads(_with_ledger().to_json())
    del document["goodput"]["marks"], document["goodput"]["lines"][0]["reached_step"]
    goodput = DurableState.from_json(json.dumps(document).encode()).goodput
    assert goodput is not None and goodput["marks"] == [] and goodput["lines"][0]["reached_step"] is None


@pytest.mark.parametrize(("path", "value", "named"), [
    ("goodput.activity", "napping", "goodput.activity"),
    ("goodput.since", 1e300, "goodput.since"),
    ("goodput.totals.training", -1.0, "goodput.totals.training"),
    ("goodput.totals.leisure", 1.0, "goodput.totals.'leisure'"),
    ("goodput.last", [1, 2], "goodput.last"),
    ("goodput.lines[0].generation", "4", "goodput.lines[0].generation"),
    ("goodput.lines[0].members", ["a"] * 17, "goodput.lines[0].members"),
    ("goodput.lines[0].seconds.startup", "3", "goodput.lines[0].seconds.startup"),
    ("goodput.steps_redone", -5, "goodput.steps_redone"),
    ("goodput.lines[0].reached_step", -1, "goodput.lines[0].reached_step"),
    ("goodput.marks[0]", [1.0, "drained", "b"], "goodput.marks[0]"),
    ("goodput.marks[0][1]", "promoted", "goodput.marks[0][1]"),
    ("goodput.marks[0][2]", "b c", "goodput.marks[0][2]"),
    ("goodput.marks[0][3]", "x" * 513, "goodput.marks[0][3]"),
])
def test_a_bad_goodput_ledger_is_refused_naming_its_field(path: str, value: Any, named: str) -> None:
    document = json.loads(_with_ledger().to_json())
    *parents, last = path.replace("[", ".").replace("]", "").split(".")
    node: Any = document
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    with pytest.raises(BadField) as refused:
        DurableState.from_json(json.dumps(document).encode())
    assert refused.value.field == named, refused.value
