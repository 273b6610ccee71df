"""A small asyncio client of etcd's v3 gRPC API: reads, writes, transactions, leases, watches and etcd's own
authentication, over the members of one cluster (a member that does not answer is skipped).

Why our own: the maintained Python clients either speak etcd's JSON gateway, or cannot do TLS, or pin protobuf
and grpcio far below TensorFlow's floors (docs/design.md, "etcd"). This one speaks the subset of the API in
proto/etcd, generated with the same pinned grpcio-tools as tfelastic's own protocol.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.metrics import EtcdMetrics
from tfelastic.daemon.etcd.rpc import kv_pb2, rpc_pb2
from tfelastic.daemon.etcd.rpc import rpc_pb2_grpc as rpc
from tfelastic.daemon.etcd.url import EtcdTarget

KeyValue = kv_pb2.KeyValue
Event = kv_pb2.Event
REQUEST_TIMEOUT_SECONDS = 1.5  # one member's chance to answer; below the default lease TTL (2 s)
_TRY_NEXT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# What a member without quorum answers, with other codes: its own timeouts, and our deadline as the server saw it
# (UNKNOWN "context deadline exceeded" races the client's own DEADLINE_EXCEEDED).
_NO_QUORUM_DETAILS = ("context deadline exceeded", "request timed out", "no leader", "leader changed",
                      "too many requests", "not capable")


class EtcdError(Exception):
    """etcd refused a request or could not answer it."""


class EtcdUnavailable(EtcdError):
    """No member answered (all down or unreachable, or no quorum): retry later."""


class EtcdAuthError(EtcdError):
    """etcd refused our credentials, or our user lacks a permission: retrying will not help."""


@dataclass(frozen=True)
class EtcdCredentials:
    """TLS files (``etcds://``) and etcd's own user and password, if it has authentication on."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = field(default="", repr=False)  # a secret: never in a log line, not even by repr


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdClient:
    def __init__(self, target: EtcdTarget, credentials: EtcdCredentials | None = None,
                 metrics: EtcdMetrics | None = None, timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        self.target, self._metrics, self._timeout = target, metrics, timeout
        self._credentials = credentials or EtcdCredentials()
        self._channels: list[grpc.aio.Channel | None] = [None] * len(target.endpoints)
        self._current = 0  # the member that answered last
        self._token: str | None = None

    @property
    def credentials(self) -> EtcdCredentials:
        return self._credentials

    # ------------------------------------------------------------------------------------------ key/value

    async def get(self, key: bytes, *, serializable: bool = False) -> KeyValue | None:
        """``serializable``: any member answers from what it has, without quorum (it may be stale)."""
        return (await self.read(key, serializable=serializable))[0]

    async def read(self, key: bytes, *, serializable: bool = False) -> tuple[KeyValue | None, int]:
        """The key (None if absent) and the store's revision at the read: a watch from the next one misses
        nothing."""
        response = await self._unary("KV", "Range", rpc_pb2.RangeRequest(key=key, serializable=serializable))
        return (response.kvs[0] if response.kvs else None), int(response.header.revision)

    async def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        response = await self._unary("KV", "Range", rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix)))
        return list(response.kvs)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Returns the revision of the write."""
        response = await self._unary("KV", "Put", rpc_pb2.PutRequest(key=key, value=value, lease=lease))
        return int(response.header.revision)

    async def delete(self, key: bytes) -> int:
        response = await self._unary("KV", "DeleteRange", rpc_pb2.DeleteRangeRequest(key=key))
        return int(response.deleted)

    async def txn(self, compare: Sequence[Any], success: Sequence[Any],
                  failure: Sequence[Any] = ()) -> Any:
        return await self._unary("KV", "Txn", rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure))

    # ---------------------------------------------------------------------------------------------- leases

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be more than asked)."""
        response = await self._unary("Lease", "LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl))
        if response.error:
            raise EtcdError(f"etcd refused a lease of {ttl}s: {response.error}")
        return int(response.ID), int(response.TTL)

    async def revoke(self, lease: int) -> None:
        await self._unary("Lease", "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease))

    async def keep_alive_once(self, lease: int, timeout: float | None = None) -> int:
        """Renews ``lease``; returns the TTL it now has, 0 if it had expired. ``timeout``: for this member."""
        started = time.monotonic()
        channel = await self._channel()

        async def requests() -> AsyncIterator[Any]:
            yield rpc_pb2.LeaseKeepAliveRequest(ID=lease)

        call = rpc.LeaseStub(channel).LeaseKeepAlive(requests(), metadata=self._metadata(),  # type: ignore[no-untyped-call]
                                                     timeout=timeout or self._timeout)
        try:
            async for response in call:
                self._observe("LeaseKeepAlive", started)
                return int(response.TTL)
        except grpc.aio.AioRpcError as e:
            self._failed("LeaseKeepAlive", e)
            self._rotate()
            raise EtcdUnavailable(f"lease keep-alive failed at {self._endpoint()}: {_describe(e)}") from None
        raise EtcdUnavailable("the lease keep-alive stream ended without an answer")

    # --------------------------------------------------------------------------------------------- watches

    async def watch(self, key: bytes, *, prefix: bool = False, start_revision: int = 0) -> AsyncIterator[Any]:
        """WatchResponses for ``key`` (or every key under it) from ``start_revision`` (0: from now on). Ends with
        EtcdUnavailable when the member goes away; the caller reads again and watches from where it was."""
        channel = await self._channel()
        create = rpc_pb2.WatchCreateRequest(key=key, range_end=prefix_end(key) if prefix else b"",
                                            start_revision=start_revision, prev_kv=True)
        stop = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield rpc_pb2.WatchRequest(create_request=create)
            await stop.wait()

        call = rpc.WatchStub(channel).Watch(requests(), metadata=self._metadata())  # type: ignore[no-untyped-call]
        try:
            async for response in call:
                if response.canceled:
                    raise EtcdError(f"etcd cancelled a watch of {key!r}: {response.cancel_reason or 'compacted'}")
                yield response
        except grpc.aio.AioRpcError as e:
            self._failed("Watch", e)
            self._rotate()
            raise EtcdUnavailable(f"watch at {self._endpoint()} broke: {_describe(e)}") from None
        finally:
            stop.set()
            call.cancel()
        raise EtcdUnavailable(f"watch at {self._endpoint()} ended")

    # ----------------------------------------------------------------------------------------- maintenance

    async def status(self) -> Any:
        return await self._unary("Maintenance", "Status", rpc_pb2.StatusRequest())

    async def close(self) -> None:
        for i, channel in enumerate(self._channels):
            if channel is not None:
                await channel.close(None)
            self._channels[i] = None

    # ---------------------------------------------------------------------------------------- internals

    async def _unary(self, service: str, method: str, request: Any) -> Any:
        """One call, tried on each member in turn until one answers; re-authenticates once on an expired token."""
        last = "no member tried"
        authenticated_again = False
        attempt = 0
        while attempt < len(self._channels):
            started = time.monotonic()
            try:
                channel = await self._channel()  # authenticates here first: a member that is down is skipped
            except EtcdUnavailable as e:
                last = str(e)
                self._rotate()
                attempt += 1
                continue
            stub = getattr(rpc, f"{service}Stub")(channel)
            try:
                response = await getattr(stub, method)(request, metadata=self._metadata(), timeout=self._timeout)
            except grpc.aio.AioRpcError as e:
                self._failed(method, e)
                if e.code() is grpc.StatusCode.UNAUTHENTICATED and self._credentials.user and not authenticated_again:
                    authenticated_again = True  # the token expired (etcd's simple tokens last 5 minutes)
                    self._token = None
                    await self._authenticate()
                    continue
                if _is_auth_error(e):
                    raise EtcdAuthError(f"etcd at {self._endpoint()} refused {method}: {e.details()}") from None
                if not is_transient(e):
                    raise EtcdError(f"etcd at {self._endpoint()} refused {method}: {_describe(e)}") from None
                last = f"{self._endpoint()}: {_describe(e)}"
                self._rotate()
                attempt += 1
                continue
            self._observe(method, started)
            return response
        raise EtcdUnavailable(f"no etcd member answered {method} ({last})")

    async def _channel(self) -> grpc.aio.Channel:
        channel = self._channels[self._current]
        if channel is None:
            channel = self._channels[self._current] = self._open(self.target.endpoints[self._current])
        if self._credentials.user and self._token is None:
            await self._authenticate()
        return channel

    def _open(self, endpoint: Endpoint) -> grpc.aio.Channel:
        # Keepalive pings break a watch on a member that went silent (a partition sends no RST). etcd refuses
        # pings more often than its --grpc-keepalive-min-time (5 s by default).
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]
        if not self.target.tls:
            return grpc.aio.insecure_channel(str(endpoint), options=options)
        creds = self._credentials

        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        tls = grpc.ssl_channel_credentials(read(creds.ca), read(creds.key), read(creds.cert))
        return grpc.aio.secure_channel(str(endpoint), tls, options=options)

    async def _authenticate(self) -> None:
        channel = self._channels[self._current]
        assert channel is not None
        request = rpc_pb2.AuthenticateRequest(name=self._credentials.user, password=self._credentials.password)
        try:
            response = await rpc.AuthStub(channel).Authenticate(request, timeout=self._timeout)  # type: ignore[no-untyped-call]
        except grpc.aio.AioRpcError as e:
            if e.code() in _TRY_NEXT:
                raise EtcdUnavailable(f"etcd at {self._endpoint()} did not answer Authenticate: {_describe(e)}") \
                    from None
            raise EtcdAuthError(f"etcd at {self._endpoint()} refused user {self._credentials.user!r}: "
                                f"{e.details()}") from None
        self._token = str(response.token)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("token", self._token),) if self._token else ()

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self._channels)

    def _endpoint(self) -> Endpoint:
        return self.target.endpoints[self._current]

    def _observe(self, method: str, started: float) -> None:
        if self._metrics is not None:
            self._metrics.requests.labels(method=method).observe(time.monotonic() - started)

    def _failed(self, method: str, error: grpc.aio.AioRpcError) -> None:
        if self._metrics is not None:
            self._metrics.errors.labels(method=method, code=error.code().name).inc()


_AUTH_DETAILS = ("authentication failed", "user name is empty", "permission denied", "invalid auth token",
                 "user name not found")


def _is_auth_error(error: grpc.aio.AioRpcError) -> bool:
    details = (error.details() or "").lower()
    return error.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or \
        any(text in details for text in _AUTH_DETAILS)


def is_transient(error: grpc.aio.AioRpcError) -> bool:
    """Another member, or a later try, may answer."""
    details = (error.details() or "").lower()
    return error.code() in _TRY_NEXT or any(text in details for text in _NO_QUORUM_DETAILS)


def _describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"
