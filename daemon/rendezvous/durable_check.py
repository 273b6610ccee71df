"""What a job state read from etcd must hold, field by field: the type and the range of every value, before any of
it reaches the coordinator's logic. Anyone who can write to etcd can write anything there, and valid JSON of the
wrong shape (a generation as a string, a number beyond any int64, an infinite failure time) would otherwise fail
later and far from its cause: every Join raising TypeError, a write that overflows a protobuf field, a restart
budget spent at once.

Pure: a parsed JSON document in, the checked values out, or :class:`BadField` naming the first field (by its path
in the document, ``members[2].worker_port``) that no tfelastic of this version writes.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable
from typing import Any, TypeVar

from tfelastic.daemon.rendezvous import bounds
from tfelastic.daemon.rendezvous.api import (
    HEARTBEAT_INTERVAL_SECONDS,
    NODE_TIMEOUT_SECONDS,
    STALL_LEARNED,
    JobSpec,
    JobState,
    Member,
    RestartReason,
)
from tfelastic.daemon.rendezvous.goodput import (
    CATEGORIES,
    MARK_DETAIL_CHARS,
    MARK_KINDS,
    MAX_GENERATIONS,
    MAX_MARKS,
    MEMBERS_LISTED,
)
from tfelastic.daemon.rendezvous.quarantine import QUARANTINE_KINDS

VERSION = 1  # of the state's format
MAX_TEXT_CHARS = 64 << 10  # a reason or a warning: an agent's 4 KiB detail in the coordinator's words, or a list
MAX_WALL_CLOCK = 1e11  # a wall-clock reading in seconds (the year 5138): failure times, quarantine ends
MAX_STEPS_TOTAL = (1 << 63) - 1  # steps_redone, steps_lost: sums of steps, in int64 fields on the wire
MAX_WARNINGS = 64  # a coordinator keeps the last 5
_REQUIRED: Any = object()
T = TypeVar("T")


class BadField(ValueError):
    """A job state that this version of tfelastic did not write; ``field`` is the first value that shows it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def shown(value: object) -> str:
    """A value from etcd, made short and printable for a message."""
    return bounds.printable(reprlib.repr(value), bounds.SHOWN_STORED_VALUE_CHARS)


class Fields:
    """One JSON object of the state; each read checks a value's type and range and names it by its path. Every
    key must be read: one that is not is a field this version does not know."""

    def __init__(self, doc: object, path: str) -> None:
        if not isinstance(doc, dict):
            raise BadField(path or "the state", f"{shown(doc)} is not a JSON object")
        self._doc: dict[str, Any] = doc
        self._path = path
        self._read: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _get(self, key: str, default: Any) -> Any:
        self._read.add(key)
        if key in self._doc:
            return self._doc[key]
        if default is _REQUIRED:
            raise BadField(self.name(key), "is missing")
        return default

    def integer(self, key: str, low: int, high: int, default: Any = _REQUIRED) -> int:
        return checked_integer(self._get(key, default), self.name(key), low, high)

    def number(self, key: str, low: float, high: float, default: Any = _REQUIRED) -> float:
        return checked_number(self._get(key, default), self.name(key), low, high)

    def text(self, key: str, limit: int, default: Any = _REQUIRED) -> str:
        return checked_text(self._get(key, default), self.name(key), limit)

    def boolean(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise BadField(self.name(key), f"{shown(value)} is not true or false")
        return value

    def items(self, key: str, limit: int, read: Callable[[object, str], T], default: Any = _REQUIRED) -> tuple[T, ...]:
        """A JSON array of at most ``limit`` values, each checked by ``read(value, its path)``."""
        values = self._get(key, default)
        if not isinstance(values, (list, tuple)):
            raise BadField(self.name(key), f"{shown(values)} is not a JSON array")
        if len(values) > limit:
            raise BadField(self.name(key), f"holds {len(values)} values, more than {limit}")
        return tuple(read(value, f"{self.name(key)}[{i}]") for i, value in enumerate(values))

    def mapping(self, key: str, limit: int, default: Any = _REQUIRED) -> dict[str, Any]:
        values = self._get(key, default)
        if not isinstance(values, dict):
            raise BadField(self.name(key), f"{shown(values)} is not a JSON object")
        if len(values) > limit:
            raise BadField(self.name(key), f"holds {len(values)} entries, more than {limit}")
        return values

    def fields(self, key: str) -> Fields:
        return Fields(self._get(key, _REQUIRED), self.name(key))

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._get(key, default)

    def no_others(self) -> None:
        unknown = sorted(set(self._doc) - self._read)
        if unknown:
            raise BadField(self.name(shown(unknown[0])), f"is not a field of a version {VERSION} job state (a "
                                                         "newer tfelastic wrote it?)")


def checked_integer(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadField(name, f"{shown(value)} is not an integer")
    if not low <= value <= high:
        raise BadField(name, f"{shown(value)} is out of range {low}..{high}")
    return value


def checked_number(value: object, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadField(name, f"{shown(value)} is not a number")
    if not (math.isfinite(value) and low <= value <= high):  # 1e400 parses as infinity
        raise BadField(name, f"{shown(value)} is not a finite number in {low:g}..{high:g}")
    return float(value)


def checked_text(value: object, name: str, limit: int) -> str:
    if not isinstance(value, str):
        raise BadField(name, f"{shown(value)} is not a string")
    if len(value) > limit:
        raise BadField(name, f"has {len(value)} characters, more than {limit}")
    return value


def checked_node_id(value: object, name: str) -> str:
    node_id = checked_text(value, name, bounds.MAX_NAME_CHARS)
    problem = bounds.node_id_problem(node_id)
    if problem is not None:
        raise BadField(name, problem.text)
    return node_id


# ---------------------------------------------------------------------------------------------- the state


def state_fields(doc: object) -> dict[str, Any]:
    """The keyword arguments of a DurableState, every one checked; raises BadField."""
    top = Fields(doc, "")
    version = top.raw("version", None)
    if version != VERSION or isinstance(version, bool):
        raise BadField("version", f"{shown(version)} is not {VERSION}: not a tfelastic job state of version "
                                  f"{VERSION} (a newer tfelastic wrote it?)")
    spec = None if top.raw("spec") is None else job_spec(top.fields("spec"))
    state = top.text("state", 16)
    if state not in {s.value for s in JobState}:
        raise BadField("state", f"{shown(state)} is not one of {', '.join(s.value for s in JobState)}")
    if spec is None and state != JobState.WAITING.value:
        raise BadField("spec", f"is null, and a job {state} has one")
    members = top.items("members", bounds.MAX_NODES, member)
    _distinct([m.node_id for m in members], "members", "node_id")
    _distinct([m.rank for m in members], "members", "rank")
    fields: dict[str, Any] = {
        "spec": spec, "state": JobState(state), "members": members,
        "reason": top.text("reason", MAX_TEXT_CHARS),
        "generation": top.integer("generation", 0, bounds.MAX_GENERATION),
        "restarts_total": top.integer("restarts_total", 0, bounds.MAX_RESTART_COUNT, 0),
        "restarts_by_reason": restarts_by_reason(top),
        "failures": top.items("failures", bounds.MAX_NODES + 1, wall_clock, ()),
        "failed_in_a_row": top.integer("failed_in_a_row", 0, bounds.MAX_RESTART_COUNT, 0),
        "chief_succeeded": top.boolean("chief_succeeded", False),
        "drained": top.items("drained", bounds.MAX_NODES, checked_node_id, ()),
        "reached_step": top.integer("reached_step", -1, bounds.MAX_STEP, -1),
        "checkpoint_step": top.integer("checkpoint_step", -1, bounds.MAX_STEP, -1),
        "steps_redone": top.integer("steps_redone", 0, MAX_STEPS_TOTAL, 0),
        "steps_lost": top.integer("steps_lost", 0, MAX_STEPS_TOTAL, 0),
        "warnings": top.items("warnings", MAX_WARNINGS, lambda v, name: checked_text(v, name, MAX_TEXT_CHARS), ()),
        "quarantined": quarantined(top),
        "goodput": None if top.raw("goodput", None) is None else goodput(top.fields("goodput")),
    }
    top.no_others()
    return fields


def job_spec(spec: Fields) -> JobSpec:
    digest = spec.text("command_digest", 2 * bounds.DIGEST_BYTES)
    try:
        command_digest = bytes.fromhex(digest)
    except ValueError:
        raise BadField(spec.name("command_digest"), f"{shown(digest)} is not hexadecimal") from None
    nodes, seconds = bounds.MAX_NODES, bounds.MAX_SECONDS
    result = JobSpec(
        job=spec.text("job", bounds.MAX_NAME_CHARS), command_digest=command_digest,
        min_nodes=spec.integer("min_nodes", 1, nodes), max_nodes=spec.integer("max_nodes", 1, nodes),
        max_restarts=spec.integer("max_restarts", 0, nodes),
        restart_window_seconds=spec.number("restart_window_seconds", 0.0, seconds),
        stall_timeout_seconds=spec.number("stall_timeout_seconds", STALL_LEARNED, seconds),
        backup_dir=spec.text("backup_dir", bounds.MAX_PATH_CHARS),
        heartbeat_interval_seconds=spec.number("heartbeat_interval_seconds", 0.0, seconds, HEARTBEAT_INTERVAL_SECONDS),
        node_timeout_seconds=spec.number("node_timeout_seconds", 0.0, seconds, NODE_TIMEOUT_SECONDS),
        strategy=spec.text("strategy", 32, "mirrored"), ps=spec.integer("ps", 0, nodes, 0))
    spec.no_others()
    problems = bounds.spec_problems(result)  # the same rules as a Join's spec: the stall timeout, the node range
    if problems:
        raise BadField(spec.name(problems[0].field), problems[0].text)
    return result


def member(doc: object, path: str) -> Member:
    fields = Fields(doc, path)
    result = Member(checked_node_id(fields.raw("node_id"), fields.name("node_id")),
                    fields.integer("rank", 0, bounds.MAX_NODES - 1), fields.text("host", bounds.MAX_HOST_CHARS),
                    fields.integer("worker_port", 1, 65535),
                    fields.text("task_type", 16, "worker"), fields.integer("task_index", -1, bounds.MAX_NODES, -1))
    fields.no_others()
    return result


def wall_clock(value: object, name: str) -> float:
    return checked_number(value, name, 0.0, MAX_WALL_CLOCK)


def restarts_by_reason(top: Fields) -> dict[str, int]:
    counts = top.mapping("restarts_by_reason", len(RestartReason), {})
    reasons = {r.value for r in RestartReason}
    for reason, count in counts.items():
        name = f"restarts_by_reason.{shown(reason)}"
        if reason not in reasons:
            raise BadField(name, f"is not a restart reason ({', '.join(sorted(reasons))})")
        checked_integer(count, name, 0, bounds.MAX_RESTART_COUNT)
    return dict(counts)


def quarantined(top: Fields) -> dict[str, dict[str, Any]]:
    entries = top.mapping("quarantined", bounds.MAX_NODES, {})
    return {checked_node_id(node, f"quarantined.{shown(node)}"): quarantine_entry(Fields(entry, f"quarantined.{node}"))
            for node, entry in entries.items()}


def quarantine_entry(entry: Fields) -> dict[str, Any]:
    kind = entry.text("kind", 32)
    if kind not in QUARANTINE_KINDS:
        raise BadField(entry.name("kind"), f"{shown(kind)} is not one of {', '.join(QUARANTINE_KINDS)}")
    result = {"kind": kind, "reason": entry.text("reason", MAX_TEXT_CHARS),
              "until": entry.number("until", 0.0, MAX_WALL_CLOCK),
              "checking": entry.boolean("checking", False),  # not in the first records written
              "quarantines": entry.integer("quarantines", 0, bounds.MAX_RESTART_COUNT)}
    entry.no_others()
    return result


def goodput(ledger: Fields) -> dict[str, Any]:
    """The goodput ledger (rendezvous/goodput.py, GoodputLedger.export)."""
    activity = ledger.raw("activity")
    if activity is not None and activity not in CATEGORIES:
        raise BadField(ledger.name("activity"), f"{shown(activity)} is not null or one of {', '.join(CATEGORIES)}")
    last = ledger.raw("last")
    if last is not None:
        if not isinstance(last, list) or len(last) != 3:
            raise BadField(ledger.name("last"), f"{shown(last)} is not null or [step, save seconds, other seconds]")
        checked_integer(last[0], ledger.name("last[0]"), 0, bounds.MAX_STEP)
        for i in (1, 2):
            checked_number(last[i], ledger.name(f"last[{i}]"), 0.0, bounds.MAX_SECONDS)
    result = {"totals": seconds_by_category(ledger.fields("totals")), "activity": activity,
              "since": ledger.number("since", 0.0, MAX_WALL_CLOCK),
              "furthest_step": ledger.integer("furthest_step", -1, bounds.MAX_STEP),
              "steps_redone": ledger.integer("steps_redone", 0, MAX_STEPS_TOTAL, 0), "last": last,
              "lines": list(ledger.items("lines", MAX_GENERATIONS, generation_line)),
              "marks": list(ledger.items("marks", MAX_MARKS, timeline_mark, ()))}  # an older one's: absent
    ledger.no_others()
    return result


def timeline_mark(doc: object, path: str) -> list[Any]:
    """``[at, kind, node, detail]`` (rendezvous/goodput.py, Mark)."""
    if not isinstance(doc, list) or len(doc) != 4:
        raise BadField(path, f"{shown(doc)} is not [time, kind, node, detail]")
    at, kind, node, detail = doc
    if kind not in MARK_KINDS:
        raise BadField(f"{path}[1]", f"{shown(kind)} is not one of {', '.join(MARK_KINDS)}")
    return [checked_number(at, f"{path}[0]", 0.0, MAX_WALL_CLOCK), kind, checked_node_id(node, f"{path}[2]"),
            checked_text(detail, f"{path}[3]", MARK_DETAIL_CHARS)]


def seconds_by_category(seconds: Fields) -> dict[str, float]:
    result = {c: seconds.number(c, 0.0, bounds.MAX_SECONDS, 0.0) for c in CATEGORIES}
    seconds.no_others()
    return result


def generation_line(doc: object, path: str) -> dict[str, Any]:
    line = Fields(doc, path)
    restored, startup = line.raw("restored_step"), line.raw("startup_seconds")
    reached = line.raw("reached_step", None)  # an older coordinator's line: absent
    result = {"generation": line.integer("generation", 1, bounds.MAX_GENERATION),
              "formed_at": line.number("formed_at", 0.0, MAX_WALL_CLOCK),
              "size": line.integer("size", 0, bounds.MAX_NODES),
              "members": list(line.items("members", MEMBERS_LISTED, checked_node_id)),
              "restored_step": None if restored is None else
              checked_integer(restored, line.name("restored_step"), 0, bounds.MAX_STEP),
              "startup_seconds": None if startup is None else
              checked_number(startup, line.name("startup_seconds"), 0.0, bounds.MAX_SECONDS),
              "steps_redone": line.integer("steps_redone", 0, MAX_STEPS_TOTAL),
              "ended": line.text("ended", MAX_TEXT_CHARS),
              "seconds": seconds_by_category(line.fields("seconds")),
              "reached_step": None if reached is None else
              checked_integer(reached, line.name("reached_step"), 0, bounds.MAX_STEP)}
    line.no_others()
    return result


def _distinct(values: list[Any], path: str, key: str) -> None:
    seen: set[Any] = set()
    for i, value in enumerate(values):
        if value in seen:
            raise BadField(f"{path}[{i}].{key}", f"{shown(value)} appears twice")
        seen.add(value)
