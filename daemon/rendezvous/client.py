"""The agent's and the status client's side of the connection to a coordinator."""

from __future__ import annotations

import time

import grpc
from tfelastic.daemon.auth import bearer, channel_credentials
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.limits import Limits
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", Limits().max_response_bytes),
    # Reconnect at once after a coordinator fails over instead of backing off for seconds.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A connection of its own per channel, so a new session is a new TCP connection: after a partition heals,
    # the old one may still hold the coordinator's replies in TCP's retransmission backoff for seconds, long
    # enough for the agent to give the new session up (the network-namespace chaos soak saw it).
    ("grpc.use_local_subchannel_pool", 1),
]


def open_channel(endpoint: Endpoint, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    target = str(endpoint)
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(target, channel_credentials(tls), options=_CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return bearer(token) if token else ()


async def fetch_status(endpoint: Endpoint, token: str | None, tls: TlsConfig | None = None,
                       timeout: float = 5.0) -> api.ClusterStatus:
    """The cluster as the coordinator sees it; its times are readings of this process's monotonic clock."""
    async with open_channel(endpoint, tls) as channel:
        stub = pb_grpc.RendezvousStub(channel)  # type: ignore[no-untyped-call]
        status: pb.ClusterStatus = await stub.GetStatus(pb.StatusRequest(), metadata=call_metadata(token),
                                                        timeout=timeout)
        return convert.status_from_proto(status, time.monotonic())


async def drain_node(endpoint: Endpoint, token: str | None, tls: TlsConfig | None, node_id: str, reason: str,
                     force: bool, timeout: float = 5.0) -> str:
    return await _operator_call(endpoint, token, tls, "Drain",
                                pb.DrainRequest(node_id=node_id, reason=reason, force=force), timeout)


async def restart_job(endpoint: Endpoint, token: str | None, tls: TlsConfig | None, reason: str,
                      timeout: float = 5.0) -> str:
    return await _operator_call(endpoint, token, tls, "RestartJob", pb.RestartJobRequest(reason=reason), timeout)


async def readmit_node(endpoint: Endpoint, token: str | None, tls: TlsConfig | None, node_id: str,
                       timeout: float = 5.0) -> str:
    return await _operator_call(endpoint, token, tls, "Readmit", pb.ReadmitRequest(node_id=node_id), timeout)


async def _operator_call(endpoint: Endpoint, token: str | None, tls: TlsConfig | None, method: str,
                         request: object, timeout: float) -> str:
    """One operator RPC; returns the coordinator's account of what it did."""
    async with open_channel(endpoint, tls) as channel:
        stub = pb_grpc.RendezvousStub(channel)  # type: ignore[no-untyped-call]
        reply: pb.OperatorReply = await getattr(stub, method)(request, metadata=call_metadata(token),
                                                              timeout=timeout)
        return reply.detail
