"""Hypothesis strategies for every agent message, with values an agent never sends: the whole range of each
integer type, NaN and infinities, empty, huge and strange text, and random bytes. Shared by the unit fuzz of
the validation (tests/unit/test_fuzz_validation.py) and the fuzz over a real Session
(tests/integration/test_fuzz_rpc.py)."""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from tfelastic.daemon.rendezvous import convert
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

from tests.rpc_harness import SPEC

UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
# Small numbers near the edges are where range checks go wrong.
SMALL = st.integers(-2, 70_000)

TEXT = st.one_of(
    st.text(max_size=40),
    st.text(max_size=3000),
    st.sampled_from(["", " ", "a b", "\x00", "\n", "é", "..", "-", "n" * 128, "n" * 129, "h" * 256, "\u202e",
                     "fuzz", "a", "b", "127.0.0.1", "[::1]"]),
)


def _ints(strategy: st.SearchStrategy[int], low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(strategy, SMALL.filter(lambda v: low <= v <= high))


SPEC_FIELDS = {
    "job": TEXT, "command_digest": st.binary(max_size=40), "min_nodes": _ints(UINT32, 0, 2**32 - 1),
    "max_nodes": _ints(UINT32, 0, 2**32 - 1), "max_restarts": _ints(UINT32, 0, 2**32 - 1),
    "restart_window_seconds": FLOATS, "stall_timeout_seconds": FLOATS, "backup_dir": TEXT,
    "heartbeat_interval_seconds": FLOATS, "node_timeout_seconds": FLOATS,
}
JOIN_FIELDS = {
    "node_id": TEXT, "host": TEXT, "worker_port": _ints(UINT32, 0, 2**32 - 1),
    "last_generation": _ints(UINT64, 0, 2**64 - 1), "restart_count": _ints(UINT32, 0, 2**32 - 1),
    "incarnation": TEXT, "last_rank": _ints(INT32, -(2**31), 2**31 - 1),
}
PROGRESS_FIELDS = {
    "step": INT64, "loss": FLOATS, "has_loss": st.booleans(), "examples": INT64, "age_seconds": FLOATS,
    "checkpoint_step": INT64, "steps_per_second": FLOATS, "checkpoint_age_seconds": FLOATS,
}
REPORT_FIELDS = {
    "generation": _ints(UINT64, 0, 2**64 - 1), "status": st.integers(-3, 8),  # an open enum: unknowns too
    "exit_code": INT32, "pid": _ints(INT32, -(2**31), 2**31 - 1), "has_progress": st.booleans(), "detail": TEXT,
    "gpus": _ints(UINT32, 0, 2**32 - 1), "gpu_utilization": FLOATS,
}


def _changes(fields: dict[str, st.SearchStrategy[Any]], most: int) -> st.SearchStrategy[dict[str, Any]]:
    """New values for up to ``most`` of ``fields``."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({name: fields[name] for name in chosen}))


def _valid_join(node_id: str) -> pb.Join:
    return pb.Join(node_id=node_id, spec=convert.spec_to_proto(SPEC), host="10.0.0.7", worker_port=2222,
                   incarnation="fuzz-incarnation", last_rank=-1)


def _mutated_join(node_id: str, join_changes: dict[str, Any], spec_changes: dict[str, Any]) -> pb.Join:
    join = _valid_join(node_id)
    for name, value in join_changes.items():
        setattr(join, name, value)
    for name, value in spec_changes.items():
        setattr(join.spec, name, value)
    return join


def _mutated_report(changes: dict[str, Any], progress: dict[str, Any]) -> pb.WorkerReport:
    report = pb.WorkerReport(generation=1, status=pb.WORKER_STATUS_RUNNING, pid=4242, has_progress=True,
                             progress=pb.Progress(step=10, age_seconds=0.5, checkpoint_age_seconds=-1.0))
    for name, value in changes.items():
        setattr(report, name, value)
    for name, value in progress.items():
        setattr(report.progress, name, value)
    return report


# Entirely random messages, and valid ones with a few fields changed: a random Join almost never gets past
# the first range check, a mutated one reaches every later check and the membership rules.
JOINS = st.one_of(
    st.builds(
        pb.Join, spec=st.one_of(st.none(), st.builds(pb.JobSpec, **SPEC_FIELDS)), **JOIN_FIELDS),
    st.builds(_mutated_join, st.sampled_from(["fuzz", "a", "b", "standby"]), _changes(JOIN_FIELDS, 2),
              _changes(SPEC_FIELDS, 2)),
)

REPORTS = st.one_of(
    st.builds(pb.WorkerReport, progress=st.builds(pb.Progress, **PROGRESS_FIELDS), **REPORT_FIELDS),
    st.builds(_mutated_report, _changes(REPORT_FIELDS, 2), _changes(PROGRESS_FIELDS, 2)),
)

LEAVES = st.builds(pb.Leave, reason=TEXT)

MESSAGES = st.one_of(
    JOINS.map(lambda j: pb.AgentMessage(join=j)),
    st.just(pb.AgentMessage(heartbeat=pb.Heartbeat())),
    REPORTS.map(lambda r: pb.AgentMessage(report=r)),
    LEAVES.map(lambda leave: pb.AgentMessage(leave=leave)),
    st.just(pb.AgentMessage()),  # no kind at all
)

# What travels: a serialized message, or bytes that may not be a message at all.
PAYLOADS = st.one_of(MESSAGES.map(lambda m: m.SerializeToString()), st.binary(max_size=300))


# Any message of our protocol, every field drawn from the whole range of its type (text with escape sequences and
# control characters among it): what a hostile or newer peer could send.
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_STRING: st.one_of(TEXT, st.sampled_from(["\x1b[2J", "\x1b]0;owned\x07", "\r", "\x9b31m"])),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=40),
    FieldDescriptor.TYPE_DOUBLE: FLOATS, FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_BOOL: st.booleans(), FieldDescriptor.TYPE_UINT32: UINT32, FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_INT32: INT32, FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_ENUM: INT32,
}


def messages(cls: type[Message], depth: int = 4) -> st.SearchStrategy[Message]:
    """Instances of ``cls`` with arbitrary values in arbitrary fields (nested messages to ``depth``)."""
    fields: list[Any] = [f for f in cls.DESCRIPTOR.fields if f.type != FieldDescriptor.TYPE_MESSAGE or depth > 0]

    def value(field: FieldDescriptor) -> st.SearchStrategy[Any]:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            return messages(_message_class(field), depth - 1)
        return _SCALARS[field.type]

    def one(field: FieldDescriptor) -> st.SearchStrategy[tuple[str, Any]]:
        repeated = field.is_repeated if hasattr(field, "is_repeated") else \
            field.label == FieldDescriptor.LABEL_REPEATED  # type: ignore[attr-defined]
        return st.tuples(st.just(field.name), st.lists(value(field), max_size=3) if repeated else value(field))

    chosen = st.lists(st.sampled_from(fields), unique_by=lambda f: f.name, max_size=len(fields)) if fields \
        else st.just([])
    return chosen.flatmap(lambda picked: st.tuples(*(one(f) for f in picked))).map(
        lambda pairs: cls(**dict(pairs)))


def _message_class(field: FieldDescriptor) -> type[Message]:
    assert field.message_type is not None
    return message_factory.GetMessageClass(field.message_type)
