"""Bounds on what one client can make the coordinator hold or do, so that a misbehaving or hostile client (with
the token or not) cannot exhaust it; docs/configuration.md#limits lists each.

gRPC core limits (:func:`server_options`: sizes, streams, metadata, timeouts, ping abuse), and
:class:`GuardInterceptor`, outermost on every RPC: an unparsable request is INVALID_ARGUMENT; at most
:meth:`Limits.max_sessions` Session streams, each sending its first message within ``first_message_seconds``; a
token bucket per Session (a flood ends it, as a lost connection) and per peer for unary calls; every field bounded
(:func:`tfelastic.daemon.rendezvous.bounds.check_message`). The buckets run on an injected clock.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.bounds import check_message
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

if TYPE_CHECKING:  # the grpc classes are generic only in their stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    Context = grpc.aio.ServicerContext[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    Context = grpc.aio.ServicerContext
    _Interceptor = grpc.aio.ServerInterceptor

Clock = Callable[[], float]
# A servicer method; grpc's stubs type handlers as synchronous, but the aio server's are coroutines or
# async generators.
Behavior = Callable[..., Any]
SESSION_METHOD = "/tfelastic.v1.Rendezvous/Session"

MAX_REQUEST_BYTES = 64 * 1024  # more than 10x the largest legitimate request, a Join (rendezvous/bounds.py)


class LimitExceededError(api.RendezvousError):
    """A client exceeded a resource limit: the call ends with RESOURCE_EXHAUSTED."""


@dataclass(frozen=True)
class Limits:
    """The coordinator's resource limits. ``create_server(limits=...)`` replaces them; they are not CLI options,
    since each is far from what legitimate traffic needs (docs/configuration.md#limits says why)."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    # Responses are O(nodes): an Assignment lists every member, a ClusterStatus every node (~100 bytes each).
    max_response_bytes: int = 16 << 20
    max_streams_per_connection: int = 100  # an agent uses 1; HTTP/2 asks servers to allow at least 100
    max_metadata_bytes: int = 16 * 1024  # the token is 64 hex characters
    handshake_timeout_ms: int = 10_000  # a TCP connection that does not finish TLS/HTTP2 setup in time is closed
    # TCP connections at once (each an fd); beyond, a new one is closed at accept. Agents hold one each.
    max_connections: int = 8192
    max_connection_idle_ms: int = 300_000  # a connection with no call for this long is closed (agents reconnect)
    min_ping_interval_ms: int = 1000  # keepalive pings more often than this are strikes
    max_ping_strikes: int = 2  # then the connection is closed (GOAWAY ENHANCE_YOUR_CALM)
    session_hard_cap: int = 20_000
    first_message_seconds: float = 10.0
    # Per session. An agent sends one message per heartbeat_interval plus a few reports per generation, so the
    # rate is at least 20x that (session_rate), and the burst covers any backlog a stalled connection can build
    # before the agent fences (node_timeout / heartbeat_interval messages).
    session_messages_per_second: float = 50.0
    session_burst: float = 200.0
    # Per peer address, for unary calls: `tfelastic status --watch` makes one every 2 s by default.
    peer_calls_per_second: float = 20.0
    peer_burst: float = 40.0
    max_tracked_peers: int = 4096  # the per-peer table is bounded too: least recently seen peers are dropped
    # Server-streaming calls (the health service's Watch): few at once, and each ends after its lifetime (a
    # watcher re-watches), so that no caller can pile up streams that never end.
    max_streams: int = 16
    stream_lifetime_seconds: float = 300.0

    def max_sessions(self, max_nodes: int | None) -> int:
        """Every node of the job, as many standbys, and room for reconnects (a stale session lingers until it
        is replaced), capped. Before the first Join the job's size is unknown: the hard cap applies."""
        if max_nodes is None:
            return self.session_hard_cap
        return min(self.session_hard_cap, 2 * max_nodes + 64)

    def session_rate(self, heartbeat_interval: float) -> float:
        return max(self.session_messages_per_second, 20.0 / heartbeat_interval)

    def max_concurrent_rpcs(self) -> int:
        """gRPC's own backstop over every call: every session the cap allows, and room for status calls."""
        return self.session_hard_cap + 1024


def server_options(limits: Limits) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", limits.max_request_bytes),
        ("grpc.max_send_message_length", limits.max_response_bytes),
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
        ("grpc.max_metadata_size", limits.max_metadata_bytes),
        ("grpc.server_handshake_timeout_ms", limits.handshake_timeout_ms),
        ("grpc.max_connection_idle_ms", limits.max_connection_idle_ms),
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", limits.min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", limits.max_ping_strikes),
    ]


# ------------------------------------------------------------------------------------------ rate limiting


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; it starts full."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, not {rate}, {burst}")
        self.rate, self.burst = rate, burst
        self._tokens, self._at = burst, now

    def take(self, now: float) -> bool:
        """Spend one token if there is one. A clock that went backwards adds nothing."""
        self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = max(self._at, now)
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class PeerBuckets:
    """One bucket per peer address, for at most ``max_peers`` peers (the least recently seen are dropped)."""

    def __init__(self, rate: float, burst: float, max_peers: int, clock: Clock) -> None:
        self._rate, self._burst, self._max, self._clock = rate, burst, max_peers, clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, peer: str) -> bool:
        now = self._clock()
        bucket = self._buckets.pop(peer, None) or TokenBucket(self._rate, self._burst, now)
        self._buckets[peer] = bucket  # most recently seen last
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._buckets)


def peer_address(peer: str) -> str:
    """The address part of a gRPC peer ("ipv4:10.0.0.1:5555" -> "ipv4:10.0.0.1"): a client's ports vary."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class SessionGate:
    """Counts open Session streams against :meth:`Limits.max_sessions`."""

    def __init__(self, limits: Limits, max_nodes: Callable[[], int | None]) -> None:
        self._limits, self._max_nodes = limits, max_nodes
        self.open = 0

    def admit(self) -> str | None:
        """Takes a slot, or returns why not."""
        cap = self._limits.max_sessions(self._max_nodes())
        if self.open >= cap:
            return (f"the coordinator already serves {self.open} sessions, its limit (2 x max_nodes + 64, at most "
                    f"{self._limits.session_hard_cap}); try again later")
        self.open += 1
        return None

    def release(self) -> None:
        self.open -= 1


# ---------------------------------------------------------------------------------------------- interceptor


@dataclass(frozen=True)
class Malformed:
    """What the tolerant deserializer returns for bytes that do not parse."""

    type_name: str
    error: str


def _tolerant(deserialize: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    type_name = method.rpartition("/")[2]

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or anything a parser of hostile bytes raises
            return Malformed(type_name, type(e).__name__)

    return parse


async def _relay(result: Any) -> AsyncIterator[Any]:
    """A stream handler is an async generator, or a coroutine that writes with ``context.write``."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


async def _until(responses: AsyncIterator[Any], deadline: float, clock: Clock) -> AsyncIterator[Any]:
    """``responses`` until they end or ``deadline`` passes; then the stream ends as if it were complete."""
    iterator = responses.__aiter__()
    try:
        while (left := deadline - clock()) > 0:
            try:
                yield await asyncio.wait_for(iterator.__anext__(), left)
            except (StopAsyncIteration, asyncio.TimeoutError):
                return
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


class GuardInterceptor(_Interceptor):
    def __init__(self, limits: Limits, clock: Clock, heartbeat_interval: float,
                 max_nodes: Callable[[], int | None]) -> None:
        self.limits = limits
        self._clock = clock
        self._session_rate = limits.session_rate(heartbeat_interval)
        self.sessions = SessionGate(limits, max_nodes)
        self.streams = 0  # open server-streaming calls
        self.peers = PeerBuckets(limits.peer_calls_per_second, limits.peer_burst, limits.max_tracked_peers, clock)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        if handler is None:
            return handler
        parse = _tolerant(handler.request_deserializer, details.method)
        serialize = handler.response_serializer
        if details.method == SESSION_METHOD and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(self._session(handler.stream_stream), parse, serialize)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), parse, serialize)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream(handler.unary_stream), parse, serialize)
        return handler  # no such methods: leave them as they are

    async def _admit_call(self, request: Any, context: Context) -> None:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"malformed request: the bytes do not parse as the method's message ({request.error})")
        if not self.peers.take(peer_address(context.peer())):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many calls from {peer_address(context.peer())}: at most "
                                f"{self.limits.peer_calls_per_second:g}/s (burst {self.limits.peer_burst:g})")

    def _unary(self, behavior: Behavior) -> Callable[[Any, Context], Awaitable[Any]]:
        async def call(request: Any, context: Context) -> Any:
            await self._admit_call(request, context)
            return await behavior(request, context)

        return call

    def _unary_stream(self, behavior: Behavior) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def call(request: Any, context: Context) -> AsyncIterator[Any]:
            await self._admit_call(request, context)
            if self.streams >= self.limits.max_streams:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{self.streams} streams are open, the coordinator's limit; try again later")
            self.streams += 1
            try:
                async for response in _until(_relay(behavior(request, context)),
                                             self._clock() + self.limits.stream_lifetime_seconds, self._clock):
                    yield response
            finally:
                self.streams -= 1

        return call

    def _session(self, behavior: Behavior) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def call(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            refusal = self.sessions.admit()
            if refusal is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            try:
                async for response in _relay(behavior(self._guarded(requests), context)):
                    yield response
            finally:
                self.sessions.release()

        return call

    async def _guarded(self, requests: AsyncIterator[Any]) -> AsyncIterator[pb.AgentMessage]:
        """The session's messages, each checked: it parses, the session is within its rate, its fields are
        bounded. A violation raises, and the servicer ends the session with the error's status."""
        limits = self.limits
        bucket = TokenBucket(self._session_rate, limits.session_burst, self._clock())
        iterator = requests.__aiter__()
        try:
            message = await asyncio.wait_for(iterator.__anext__(), limits.first_message_seconds)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise LimitExceededError(f"no message within {limits.first_message_seconds:g}s of opening the "
                                     "session; an agent sends its Join at once") from None
        while True:
            if isinstance(message, Malformed):
                raise api.ProtocolError(f"malformed AgentMessage: the bytes do not parse ({message.error})")
            if not bucket.take(self._clock()):
                raise LimitExceededError(
                    f"more than {bucket.rate:g} messages/s (burst {bucket.burst:g}) on one session; an agent sends "
                    "one per heartbeat_interval and a few reports: closing the session")
            check_message(message)
            yield message
            try:
                message = await iterator.__anext__()
            except StopAsyncIteration:
                return
