"""The coordinator refuses out-of-range Join values before they reach the state machine."""

from __future__ import annotations

from typing import Any

import pytest
from tfelastic.daemon.rendezvous.api import STALL_LEARNED, ProtocolError
from tfelastic.daemon.rendezvous.bounds import validate_join
from tfelastic.daemon.rpc import rendezvous_pb2 as pb


def join(**changes: Any) -> pb.Join:
    spec: dict[str, Any] = dict(job="j", command_digest=b"\x01" * 32, min_nodes=1, max_nodes=2, max_restarts=3,
                restart_window_seconds=60, stall_timeout_seconds=10, heartbeat_interval_seconds=0.5,
                node_timeout_seconds=2)
    spec.update(changes.pop("spec", {}))
    fields: dict[str, Any] = dict(node_id="node-1", host="10.0.0.1", worker_port=2222, last_rank=-1)
    fields.update(changes)
    return pb.Join(spec=pb.JobSpec(**spec), **fields)


def test_a_valid_join_passes() -> None:
    validate_join(join())


def test_a_learned_stall_limit_passes() -> None:
    validate_join(join(spec={"stall_timeout_seconds": STALL_LEARNED}))


@pytest.mark.parametrize(("changes", "named"), [
    ({"node_id": ""}, "node_id"),
    ({"node_id": "a b"}, "node_id"),
    ({"node_id": "x" * 129}, "node_id"),
    ({"host": ""}, "host"),
    ({"host": "a\nb"}, "host"),
    ({"worker_port": 0}, "worker_port"),
    ({"worker_port": 70000}, "worker_port"),
    ({"last_generation": 2**64 - 1}, "last_generation"),
    ({"restart_count": 2**32 - 1}, "restart_count"),
    ({"last_rank": -2}, "last_rank"),
    ({"spec": {"job": ""}}, "spec.job ''"),
    ({"spec": {"job": "a/b"}}, "spec.job 'a/b'"),
    ({"spec": {"command_digest": b"short"}}, "spec.command_digest has 5 bytes"),
    ({"spec": {"max_restarts": 100_001}}, "spec.max_restarts 100001"),
    ({"spec": {"backup_dir": "d" * 4097}}, "spec.backup_dir has 4097 characters"),
    ({"incarnation": "i" * 65}, "incarnation has 65 characters"),
    ({"spec": {"min_nodes": 0, "max_nodes": 0}}, "node range 0:0"),
    ({"spec": {"min_nodes": 3, "max_nodes": 2}}, "node range 3:2"),
    ({"spec": {"node_timeout_seconds": -1}}, "spec.node_timeout_seconds timing -1.0"),
    ({"spec": {"stall_timeout_seconds": float("nan")}}, "spec.stall_timeout_seconds timing nan"),
    ({"spec": {"stall_timeout_seconds": -2.0}}, "spec.stall_timeout_seconds timing -2.0"),
    ({"spec": {"node_timeout_seconds": 0.5}}, "spec.node_timeout_seconds 0.5s must exceed heartbeat_interval 0.5s"),
])
def test_out_of_range_values_are_refused_naming_them(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(ProtocolError, match=r"^invalid Join: .*" + named):
        validate_join(join(**changes))
