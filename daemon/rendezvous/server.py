"""The coordinator's gRPC server: a thin adapter that feeds the rendezvous state machine from one event loop.

Each agent session is one bidirectional stream. Incoming messages become calls on :class:`Rendezvous`; the
orders it returns are queued on the target sessions' streams. A ticker fires the state machine's timers and
sends coordinator heartbeats. Because everything runs on one asyncio loop, the state machine needs no lock, and
one thread serves thousands of streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tfelastic.daemon.auth import TokenInterceptor, server_credentials
from tfelastic.daemon.config import TlsConfig
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.state import Clock, Rendezvous
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

log = logging.getLogger("tfelastic.coordinator")

MAX_MESSAGE_BYTES = 1 << 20
SERVICE_NAME = "tfelastic.v1.Rendezvous"

_ERROR_CODES: dict[type[api.RendezvousError], grpc.StatusCode] = {
    api.SpecMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    api.DuplicateNodeError: grpc.StatusCode.ALREADY_EXISTS,
    api.JobClosedError: grpc.StatusCode.ABORTED,
    api.ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
}


@dataclass
class _Close:
    code: grpc.StatusCode
    details: str


@dataclass(eq=False)
class _Session:
    peer: str
    outbox: asyncio.Queue[pb.CoordinatorMessage | _Close] = field(default_factory=asyncio.Queue)
    node_id: str = ""


class RendezvousServicer(pb_grpc.RendezvousServicer):
    def __init__(self, rendezvous: Rendezvous, clock: Clock, heartbeat_interval: float) -> None:
        self.rendezvous = rendezvous
        self._clock = clock
        self._heartbeat_interval = heartbeat_interval
        self._sessions: dict[str, _Session] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._timers_changed = asyncio.Event()
        self._assignment_template: pb.Assignment | None = None
        self.finished = asyncio.Event()

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_forever())

    def close_sessions(self, details: str) -> None:
        for session in self._sessions.values():
            session.outbox.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE, details))

    async def stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    @property
    def connected(self) -> int:
        return len(self._sessions)

    async def Session(
        self, requests: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        session = _Session(peer=context.peer())
        reader = asyncio.create_task(self._read(requests, session))
        try:
            while True:
                item = await session.outbox.get()
                if isinstance(item, _Close):
                    if item.code is not grpc.StatusCode.OK:
                        await context.abort(item.code, item.details)
                    return
                yield item
        finally:
            reader.cancel()
            self._end(session)

    async def GetStatus(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClusterStatus:
        return convert.status_to_proto(self.rendezvous.snapshot(), self._clock())

    async def _read(self, requests: AsyncIterator[pb.AgentMessage], session: _Session) -> None:
        try:
            async for message in requests:
                self._handle(session, message)
        except api.RendezvousError as e:
            log.warning("refused %s (%s): %s", session.node_id or session.peer, type(e).__name__, e)
            session.outbox.put_nowait(_Close(_ERROR_CODES.get(type(e), grpc.StatusCode.INVALID_ARGUMENT), str(e)))
            return
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            return
        # The agent closed its side: the session is over.
        session.outbox.put_nowait(_Close(grpc.StatusCode.OK, "session closed by the agent"))

    def _handle(self, session: _Session, message: pb.AgentMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "join":
            self._join(session, message.join)
            return
        if not session.node_id:
            raise api.ProtocolError("the first message of a session must be a Join")
        node_id, rdzv = session.node_id, self.rendezvous
        rdzv.heartbeat(node_id)
        if kind == "report":
            self._dispatch(self._report(node_id, message.report))
        elif kind == "leave":
            log.info("node %s leaves: %s", node_id, message.leave.reason)
            self._dispatch(rdzv.leave(node_id, message.leave.reason))
        elif kind != "heartbeat":
            raise api.ProtocolError(f"unexpected message {kind!r}")

    def _join(self, session: _Session, join: pb.Join) -> None:
        if not join.node_id or (session.node_id and join.node_id != session.node_id):
            raise api.ProtocolError(f"bad node id {join.node_id!r} in Join")
        if not join.HasField("spec") or not join.spec.job:
            raise api.ProtocolError("Join without a job spec")
        rejoin = bool(session.node_id)
        info = api.NodeInfo(join.node_id, join.host, join.worker_port)
        sends = self.rendezvous.join(info, convert.spec_from_proto(join.spec), rejoin=rejoin,
                                     last_generation=join.last_generation, restart_count=join.restart_count)
        if not rejoin:
            session.node_id = join.node_id
            self._sessions[join.node_id] = session
            log.info("node %s joined from %s", join.node_id, session.peer)
        self._dispatch(sends)

    def _report(self, node_id: str, report: pb.WorkerReport) -> list[api.Send]:
        rdzv, gen = self.rendezvous, report.generation
        if report.pid:
            rdzv.worker_started(node_id, gen, report.pid)
        if report.has_progress:
            p = report.progress
            rdzv.progress(node_id, gen, api.WorkerProgress(
                step=p.step, examples=p.examples, loss=p.loss if p.has_loss else None,
                checkpoint_step=p.checkpoint_step, reported_at=self._clock() - p.age_seconds))
        if report.status == pb.WORKER_STATUS_SUCCEEDED:
            return rdzv.worker_succeeded(node_id, gen)
        if report.status == pb.WORKER_STATUS_FAILED:
            detail = report.detail or f"trainer exited with code {report.exit_code}"
            return rdzv.worker_failed(node_id, gen, api.RestartReason.WORKER_EXIT, detail)
        if report.status == pb.WORKER_STATUS_STALLED:
            return rdzv.worker_failed(node_id, gen, api.RestartReason.STALLED, report.detail or "stalled")
        return []

    def _end(self, session: _Session) -> None:
        if session.node_id and self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
            log.info("node %s disconnected", session.node_id)
            self._dispatch(self.rendezvous.disconnect(session.node_id))

    def _dispatch(self, sends: Sequence[api.Send]) -> None:
        for send in sends:
            session = self._sessions.get(send.node_id)
            if isinstance(send.order, api.Assignment):
                log.info("generation %d: %s is rank %d of %d", send.order.generation, send.node_id,
                         send.order.rank, send.order.world_size)
            elif isinstance(send.order, api.StopWorkers):
                log.info("generation %d: stop %s (%s)", send.order.generation, send.node_id,
                         send.order.reason.value)
            elif isinstance(send.order, api.Finished) and not self.finished.is_set():
                log.info("job %s: %s", send.order.state.value, send.order.reason)
                self.finished.set()
            if session is None:
                continue
            if isinstance(send.order, api.Evict):
                log.warning("node %s lost: %s", send.node_id, send.order.reason)
                del self._sessions[send.node_id]
                session.outbox.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE, send.order.reason))
            elif isinstance(send.order, api.Assignment):
                session.outbox.put_nowait(convert.order_to_proto(send.order, self._template_for(send.order)))
            else:
                session.outbox.put_nowait(convert.order_to_proto(send.order))
        if self.rendezvous.state.is_terminal:
            self.finished.set()
        if sends:  # orders mean state changed, and with it maybe a timer; heartbeats only push leases later
            self._timers_changed.set()

    def _template_for(self, order: api.Assignment) -> pb.Assignment:
        template = self._assignment_template
        if template is None or template.generation != order.generation:
            template = self._assignment_template = convert.assignment_template(order)
        return template

    async def _tick_forever(self) -> None:
        """Fire the state machine's timers when they are due, and send heartbeats; sleep in between."""
        heartbeat = pb.CoordinatorMessage(heartbeat=pb.Heartbeat())
        next_heartbeat = 0.0
        while True:
            deadline = self.rendezvous.next_deadline()
            if deadline is not None and self._clock() >= deadline:
                try:
                    self._dispatch(self.rendezvous.tick())
                except Exception:  # a bug in one tick must not stop node timeouts for good
                    log.exception("coordinator tick failed")
                deadline = self.rendezvous.next_deadline()
            now = self._clock()
            if now >= next_heartbeat:
                for session in self._sessions.values():
                    session.outbox.put_nowait(heartbeat)
                next_heartbeat = now + self._heartbeat_interval
            self._timers_changed.clear()
            wake = min(next_heartbeat, deadline if deadline is not None else next_heartbeat)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._timers_changed.wait(), max(0.001, wake - self._clock() + 0.001))


@dataclass
class Coordinator:
    server: grpc.aio.Server
    port: int
    servicer: RendezvousServicer

    async def wait_agents_gone(self, timeout: float) -> None:
        """After the job ended: give the agents time to read the verdict and hang up."""
        deadline = time.monotonic() + timeout
        while self.servicer.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, grace: float = 0.5) -> None:
        await self.servicer.stop()
        self.servicer.close_sessions("the coordinator is shutting down")
        await self.server.stop(grace)


class BindError(OSError):
    pass


async def create_server(
    address: str,
    settings: api.RendezvousSettings,
    *,
    token: str | None = None,
    tls: TlsConfig | None = None,
    spec: api.JobSpec | None = None,
    heartbeat_interval: float = 0.5,
    clock: Clock = time.monotonic,
) -> Coordinator:
    """Start a coordinator on ``address`` (port 0 picks a free one). Raises BindError if the port is taken.

    The port is bound exclusively (no SO_REUSEPORT): when several agents on one host try to host the same
    endpoint, exactly one succeeds and the others connect to it.
    """
    if _port_taken(address):
        raise BindError(f"cannot listen on {address}: the address is in use")
    interceptors = [TokenInterceptor(token)] if token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", 16 * MAX_MESSAGE_BYTES),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ],
    )
    servicer = RendezvousServicer(Rendezvous(settings, clock, spec), clock, heartbeat_interval)
    pb_grpc.add_RendezvousServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if tls is not None and tls.enabled:
            port = server.add_secure_port(address, server_credentials(tls))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise BindError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise BindError(f"cannot listen on {address}: the address is in use or not local")
    await server.start()
    servicer.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Coordinator(server, port, servicer)


def _port_taken(address: str) -> bool:
    """A quiet pre-check, so that losing the hosting race does not make gRPC log a bind error. The exclusive
    bind by gRPC itself still decides who hosts."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # Like gRPC's own bind: connections of a coordinator that died (TIME_WAIT) do not block it.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError:
                return True
    return False
