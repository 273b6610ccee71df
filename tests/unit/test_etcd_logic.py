"""The pure parts of the etcd rendezvous: which of etcd's errors the client retries on another member (a member
without quorum answers with several codes; retrying those lets a failure wait for quorum instead of killing the
writer), and how long a new coordinator waits for the node of a leader that lost its lease."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from tfelastic.daemon.etcd.client import EtcdCredentials, is_transient
from tfelastic.daemon.etcd.coordinator import departed_leader_grace
from tfelastic.daemon.etcd.election import LeaderInfo
from tfelastic.daemon.rendezvous.durable import DurableState


def error(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details, None)


@pytest.mark.parametrize(("code", "details"), [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded"),  # our deadline, as the member saw it
    (grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out"),
    (grpc.StatusCode.UNKNOWN, "etcdserver: no leader"),
    (grpc.StatusCode.UNKNOWN, "etcdserver: leader changed"),
])
def test_what_a_member_without_quorum_answers_is_retried(code: grpc.StatusCode, details: str) -> None:
    assert is_transient(error(code, details))


@pytest.mark.parametrize(("code", "details"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided"),
    (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"),
    (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: authentication failed, invalid user ID or password"),
])
def test_a_refusal_is_not_retried(code: grpc.StatusCode, details: str) -> None:
    assert not is_transient(error(code, details))


def test_the_previous_leaders_node_is_waited_for_until_its_worker_is_certainly_gone() -> None:
    # Defaults: node_timeout 2 s, failure_stop_grace 0.25 s, lease TTL 2 s. Cut off at P, its worker is gone by
    # P + 2.25 s; its lease ran out no earlier than P + 1.33 s: 0.92 s more after the successor won.
    assert departed_leader_grace(2.0, 0.25, 2) == pytest.approx(2.25 - 4 / 3)
    assert departed_leader_grace(2.0, 0.25, 10) == 0.0  # a long lease outlasts the fencing by itself


def test_the_etcd_password_is_not_in_the_credentials_repr() -> None:
    assert "s3cret" not in repr(EtcdCredentials(user="tfe", password="s3cret"))


@pytest.mark.parametrize("data", [b'{"version": 1}', b'{"version": 1, "spec": null, "members": [1]}',
                                  b'{"version": 1, "spec": {"job": 5}, "members": []}', b"[1]", b"\xff"])
def test_a_malformed_job_state_in_etcd_is_a_value_error(data: bytes) -> None:
    """Anything but a state this version wrote is refused the same way (the caller turns it into an EtcdError)."""
    with pytest.raises(ValueError):
        DurableState.from_json(data)


@pytest.mark.parametrize("value", [
    {"node": "n" * 1_400_000, "address": "127.0.0.1:1", "since": 0.0},  # once made 1.4 MB log lines
    {"node": "a\nb", "address": "127.0.0.1:1", "since": 0.0},
    {"node": 5, "address": "127.0.0.1:1", "since": 0.0},
    {"node": "a", "address": "127.0.0.1", "since": 0.0},  # no port
    {"node": "a", "address": "h" * 300 + ":1", "since": 0.0},
    {"node": "a", "address": "127.0.0.1:1", "since": "now"},
    {"node": "a", "address": "127.0.0.1:1", "since": True},
    {"node": "a", "address": "127.0.0.1:1", "since": 0.0, "kind": "wizard"},
    {"address": "127.0.0.1:1", "since": 0.0},
    ["a", "127.0.0.1:1"],
])
def test_a_leader_key_no_coordinator_writes_names_no_leader(value: object) -> None:
    assert LeaderInfo.from_json(json.dumps(value).encode()) is None


def test_a_leader_key_a_coordinator_writes_names_it() -> None:
    for info in (LeaderInfo("gpu-07", "10.0.0.7:41233", 1795627793.09), LeaderInfo("head-1", "[::1]:29400", 0.0,
                                                                                    "coordinator")):
        assert LeaderInfo.from_json(info.to_json()) == info
    assert LeaderInfo.from_json(b'{"node": "a", "address": "h:1", "since": 1e400}') is None  # infinity
