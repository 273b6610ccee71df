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
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tfelastic.daemon.auth import TokenInterceptor, server_credentials
from tfelastic.daemon.config import TlsConfig
from tfelastic.daemon.netutil import bind_addresses, host_port, port_taken
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.limits import GuardInterceptor, LimitExceededError, Limits, server_options
from tfelastic.daemon.rendezvous.state import Clock, Rendezvous
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

log = logging.getLogger("tfelastic.coordinator")

SERVICE_NAME = "tfelastic.v1.Rendezvous"

_ERROR_CODES: dict[type[api.RendezvousError], grpc.StatusCode] = {
    api.SpecMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    api.DuplicateNodeError: grpc.StatusCode.ALREADY_EXISTS,
    api.JobClosedError: grpc.StatusCode.ABORTED,
    api.ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
    LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    api.UnknownNodeError: grpc.StatusCode.NOT_FOUND,
    api.OperatorRefusedError: grpc.StatusCode.FAILED_PRECONDITION,
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
    incarnation: str = ""


class RendezvousServicer(pb_grpc.RendezvousServicer):
    def __init__(self, rendezvous: Rendezvous, clock: Clock, heartbeat_interval: float) -> None:
        self.rendezvous = rendezvous
        self._clock = clock
        self._heartbeat_interval = heartbeat_interval
        self._sessions: dict[str, _Session] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._timers_changed = asyncio.Event()
        self._assignment_template: pb.Assignment | None = None
        # What other threads (the /metrics server) may read: republished by the ticker, never mutated.
        self.published = rendezvous.snapshot()
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

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.OperatorReply:
        node_id = _printable(request.node_id, 128)
        reason = _printable(request.reason, 200) or "drained by an operator"
        await self._operator(context, lambda: self.rendezvous.drain(node_id, reason, force=request.force))
        log.info("operator drains node %s (%s)", node_id, reason)
        return pb.OperatorReply(detail=f"node {node_id} is draining: its trainer checkpoints and stops, the node "
                                       "leaves, and the job re-forms without it")

    async def RestartJob(self, request: pb.RestartJobRequest,
                         context: grpc.aio.ServicerContext[Any, Any]) -> pb.OperatorReply:
        reason = _printable(request.reason, 200) or "requested by an operator"
        await self._operator(context, lambda: self.rendezvous.restart_job(reason))
        log.info("operator restarts the job (%s)", reason)
        return pb.OperatorReply(detail=f"restarting job {self.rendezvous.spec.job if self.rendezvous.spec else ''}"
                                       f" from generation {self.rendezvous.generation}: every trainer checkpoints "
                                       "and stops, and the same nodes re-form")

    async def _operator(self, context: grpc.aio.ServicerContext[Any, Any],
                        command: Callable[[], list[api.Send]]) -> None:
        """Run an operator command on the state machine; a refusal becomes the call's status."""
        try:
            sends = command()
        except api.RendezvousError as e:
            log.warning("refused an operator command from %s: %s", context.peer(), e)
            await context.abort(_ERROR_CODES.get(type(e), grpc.StatusCode.FAILED_PRECONDITION), str(e))
        self._dispatch(sends)

    async def _read(self, requests: AsyncIterator[pb.AgentMessage], session: _Session) -> None:
        try:
            async for message in requests:
                self._handle(session, message)
        except api.RendezvousError as e:
            log.warning("refused %s (%s): %s", session.node_id or session.peer, type(e).__name__, e)
            session.outbox.put_nowait(_Close(_ERROR_CODES.get(type(e), grpc.StatusCode.INVALID_ARGUMENT), str(e)))
            return
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.AbortError):  # ended, or aborted by us
            return
        except Exception:  # a bug must cost one session, not the coordinator
            log.exception("session of %s failed", session.node_id or session.peer)
            session.outbox.put_nowait(_Close(grpc.StatusCode.INTERNAL, "the coordinator failed to handle a message"))
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
        if self._sessions.get(session.node_id) is not session:
            return  # evicted or replaced: it is being closed, and nothing it says counts any more
        node_id, rdzv = session.node_id, self.rendezvous
        rdzv.heartbeat(node_id)
        if kind == "report":
            self._dispatch(self._report(node_id, message.report))
        elif kind == "leave":
            reason = _printable(message.leave.reason, 200)
            log.info("node %s leaves: %s", node_id, reason)
            self._dispatch(rdzv.leave(node_id, reason))
        elif kind != "heartbeat":
            raise api.ProtocolError(f"unexpected message {kind!r}")

    def _join(self, session: _Session, join: pb.Join) -> None:
        validate_join(join)
        if session.node_id and join.node_id != session.node_id:
            raise api.ProtocolError(f"node id {join.node_id!r} differs from this session's {session.node_id!r}")
        if session.node_id and self._sessions.get(session.node_id) is not session:
            return  # evicted or replaced
        rejoin = bool(session.node_id)
        if not rejoin:
            self._replace_stale_session(join)
        info = api.NodeInfo(join.node_id, join.host, join.worker_port, join.incarnation, join.last_generation,
                            join.last_rank)
        sends = self.rendezvous.join(info, convert.spec_from_proto(join.spec), rejoin=rejoin,
                                     restart_count=join.restart_count)
        if not rejoin:
            session.node_id, session.incarnation = join.node_id, join.incarnation
            self._sessions[join.node_id] = session
            log.info("node %s joined from %s", join.node_id, session.peer)
        self._dispatch(sends)

    def _replace_stale_session(self, join: pb.Join) -> None:
        """The same agent process reconnecting (it gave up on its old stream before we noticed) replaces its
        old session; that counts as the node lost and found again. Another process with the node's id does not:
        the state machine refuses it as a duplicate."""
        old = self._sessions.get(join.node_id)
        if old is None or not join.incarnation or old.incarnation != join.incarnation:
            return
        log.info("node %s reconnected; closing its previous session", join.node_id)
        del self._sessions[join.node_id]
        old.outbox.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE, "replaced by a newer session of this agent"))
        self._dispatch(self.rendezvous.disconnect(join.node_id))

    def _report(self, node_id: str, report: pb.WorkerReport) -> list[api.Send]:
        rdzv, gen = self.rendezvous, report.generation
        if report.generation > _MAX_GENERATION or len(report.detail) > 4096 or report.gpus > 4096:
            raise api.ProtocolError("WorkerReport out of range")
        if report.pid:
            rdzv.worker_started(node_id, gen, report.pid)
        rdzv.node_gpus(node_id, report.gpus, min(max(report.gpu_utilization, 0.0), 1.0))
        if report.has_progress:
            p, now = report.progress, self._clock()
            checkpoint_at = now - p.checkpoint_age_seconds if p.checkpoint_age_seconds >= 0 else None
            rdzv.progress(node_id, gen, api.WorkerProgress(
                step=p.step, examples=p.examples, loss=p.loss if p.has_loss else None,
                checkpoint_step=p.checkpoint_step, reported_at=now - p.age_seconds,
                steps_per_second=p.steps_per_second, checkpoint_at=checkpoint_at))
        if report.status == pb.WORKER_STATUS_SUCCEEDED:
            return rdzv.worker_succeeded(node_id, gen)
        if report.status == pb.WORKER_STATUS_FAILED:
            detail = _printable(report.detail, 300) or f"trainer exited with code {report.exit_code}"
            return rdzv.worker_failed(node_id, gen, api.RestartReason.WORKER_EXIT, detail)
        if report.status == pb.WORKER_STATUS_STALLED:
            detail = _printable(report.detail, 300) or "stalled"
            return rdzv.worker_failed(node_id, gen, api.RestartReason.STALLED, detail)
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
        if self.rendezvous.state.is_terminal and not self.finished.is_set():
            log.info("job %s: %s", self.rendezvous.state.value, self.rendezvous.reason)
            self.published = self.rendezvous.snapshot()
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
                self.published = self.rendezvous.snapshot()
            self._timers_changed.clear()
            wake = min(next_heartbeat, deadline if deadline is not None else next_heartbeat)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._timers_changed.wait(), max(0.001, wake - self._clock() + 0.001))


@dataclass
class Coordinator:
    server: grpc.aio.Server
    port: int
    servicer: RendezvousServicer
    health: Any

    async def wait_agents_gone(self, timeout: float) -> None:
        """After the job ended: give the agents time to read the verdict and hang up."""
        deadline = time.monotonic() + timeout
        while self.servicer.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, grace: float = 0.5) -> None:
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for every service
        await self.servicer.stop()
        self.servicer.close_sessions("the coordinator is shutting down")
        await self.server.stop(grace)


class BindError(OSError):
    pass


_MAX_GENERATION = 1 << 53  # far beyond any job, and exact in every field it reaches
_MAX_NODES = 100_000
_MAX_RESTARTS = 1 << 31
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def validate_join(join: pb.Join) -> None:
    """Refuses a Join whose values are out of range, before any of it reaches the state machine."""
    spec = join.spec
    problems = []
    if not _NODE_ID.fullmatch(join.node_id):
        problems.append(f"node_id {join.node_id[:64]!r} must be 1-128 letters, digits or ._:@-")
    if not join.host or len(join.host) > 255 or not join.host.isprintable() or " " in join.host:
        problems.append(f"host {join.host[:64]!r} must be a host name or address")
    if not 1 <= join.worker_port <= 65535:
        problems.append(f"worker_port {join.worker_port} is out of range 1-65535")
    if join.last_generation > _MAX_GENERATION:
        problems.append(f"last_generation {join.last_generation} is out of range")
    if join.restart_count > _MAX_RESTARTS:  # it ends up in uint32 fields, plus the restarts still to come
        problems.append(f"restart_count {join.restart_count} is out of range")
    if not -1 <= join.last_rank < _MAX_NODES:
        problems.append(f"last_rank {join.last_rank} is out of range -1..{_MAX_NODES - 1}")
    if len(join.incarnation) > 64:
        problems.append(f"incarnation has {len(join.incarnation)} characters, more than 64")
    if not join.HasField("spec"):
        problems.append("a job spec is required")
    problems += _spec_problems(spec)
    if problems:
        raise api.ProtocolError("invalid Join: " + "; ".join(problems))


def _spec_problems(spec: pb.JobSpec) -> list[str]:
    problems = []
    if not _valid_job(spec.job):
        problems.append(f"spec.job {spec.job[:64]!r} must be 1-128 letters, digits, '-', '_' or '.'")
    if len(spec.command_digest) != 32:
        problems.append(f"spec.command_digest has {len(spec.command_digest)} bytes, not 32 (SHA-256)")
    if not 1 <= spec.min_nodes <= spec.max_nodes <= _MAX_NODES:
        problems.append(f"node range {spec.min_nodes}:{spec.max_nodes} (spec.min_nodes:spec.max_nodes) is out of "
                        f"range 1..{_MAX_NODES}")
    if spec.max_restarts > _MAX_NODES:
        problems.append(f"spec.max_restarts {spec.max_restarts} is more than {_MAX_NODES}")
    for name in ("restart_window_seconds", "stall_timeout_seconds", "heartbeat_interval_seconds",
                 "node_timeout_seconds"):
        if not 0 <= getattr(spec, name) <= 1e9:  # NaN fails too
            problems.append(f"spec.{name} timing {getattr(spec, name)} is out of range 0..1e9")
    if len(spec.backup_dir) > 4096:
        problems.append(f"spec.backup_dir has {len(spec.backup_dir)} characters, more than 4096")
    return problems


def _valid_job(name: str) -> bool:
    """The rule of the agent's configuration (config.validate), bounded."""
    return 0 < len(name) <= 128 and all(c.isalnum() or c in "-_." for c in name)


def _printable(text: str, limit: int) -> str:
    """Text from the network, made safe to log: printable, and bounded."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


async def create_server(
    address: str,
    settings: api.RendezvousSettings,
    *,
    token: str | None = None,
    tls: TlsConfig | None = None,
    spec: api.JobSpec | None = None,
    heartbeat_interval: float = 0.5,
    clock: Clock = time.monotonic,
    limits: Limits | None = None,
) -> Coordinator:
    """Start a coordinator on ``address`` (port 0 picks a free one). Raises BindError if the port is taken.

    The port is bound exclusively (no SO_REUSEPORT): when several agents on one host try to host the same
    endpoint, exactly one succeeds and the others connect to it.
    """
    bind_host, _, bind_port = address.rpartition(":")
    host, port = bind_host.strip("[]"), int(bind_port)
    addresses = bind_addresses(host)
    if not addresses:
        raise BindError(f"cannot listen on {address}: {host!r} is not an address of this machine; give the host "
                        "name or address of this node, or 0.0.0.0")
    if port and _endpoint_taken(addresses, port):  # the common case, without gRPC's error log
        raise BindError(f"cannot listen on {address}: the address is in use")
    credentials = server_credentials(tls) if tls is not None and tls.enabled else None
    limits = limits or Limits()
    rendezvous = Rendezvous(settings, clock, spec)

    def new_server() -> grpc.aio.Server:
        # The guard is outermost, so that it bounds every call, authenticated or not (daemon/rendezvous/limits.py).
        guard = GuardInterceptor(limits, clock, heartbeat_interval,
                                 lambda: rendezvous.spec.max_nodes if rendezvous.spec else None)
        return grpc.aio.server(
            interceptors=[guard, *([TokenInterceptor(token)] if token else [])],
            options=[("grpc.so_reuseport", 0), *server_options(limits)],
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs(),
        )

    server, port = await _listen(new_server, host, addresses, port, credentials)
    servicer = RendezvousServicer(rendezvous, clock, heartbeat_interval)
    pb_grpc.add_RendezvousServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    servicer.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Coordinator(server, port, servicer, health_servicer)


async def _listen(new_server: Callable[[], grpc.aio.Server], host: str, addresses: list[str], port: int,
                  credentials: grpc.ServerCredentials | None) -> tuple[grpc.aio.Server, int]:
    """A server listening on ``port`` of each of ``addresses`` (netutil.bind_addresses), or BindError.

    Port 0 takes the port the first address gets for all of them, and tries again with a fresh one when another
    address has it taken already.
    """
    for _ in range(5 if port == 0 else 1):
        server = new_server()
        try:
            return server, _add_ports(server, addresses, port, credentials)
        except _InUse:
            await _release(server)
        except BaseException:
            await _release(server)
            raise
    raise BindError(f"cannot listen on {host_port(host, port)}: the address is in use")


class _InUse(Exception):
    pass


def _endpoint_taken(addresses: list[str], port: int) -> bool:
    return any(port_taken(each, port) for each in addresses)


def _add_ports(server: grpc.aio.Server, addresses: list[str], port: int,
               credentials: grpc.ServerCredentials | None) -> int:
    """Binds each address in turn, on the port the first one got. Raises _InUse when one is taken."""
    for each in addresses:
        address = host_port(each, port)
        try:
            bound = int(server.add_secure_port(address, credentials) if credentials
                        else server.add_insecure_port(address))
            problem = "gRPC could not bind it"
        except RuntimeError as e:  # gRPC raises or returns 0, depending on its version
            bound, problem = 0, str(e)
        if not bound:
            if port and port_taken(each, port):
                raise _InUse(address)
            raise BindError(f"cannot listen on {address}: {problem}")
        port = bound
    return port


async def _release(server: grpc.aio.Server) -> None:
    """Closes what a server that failed to bind all its addresses did bind. One that never started keeps its
    sockets until the process ends, even when stopped or collected: start it, so that stop() closes them."""
    await server.start()
    await server.stop(None)
