"""Which of etcd's errors the client retries on another member (daemon/etcd/client.py). A member without quorum
answers with several codes; retrying those is what lets a failure wait for quorum instead of killing the writer."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from tfelastic.daemon.etcd.client import is_transient


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
