"""The coordinator's gRPC servicer: a thin adapter that feeds the rendezvous state machine from one event loop.

Each agent session is one bidirectional stream. Incoming messages are converted to API types at the border
(:mod:`~tfelastic.daemon.rendezvous.convert`) and become calls on :class:`Rendezvous`; the orders it returns are
queued on the target sessions' streams. A ticker fires the state machine's timers and sends coordinator
heartbeats. Because everything runs on one asyncio loop, the state machine needs no lock, and one thread serves
thousands of streams. :func:`tfelastic.daemon.rendezvous.host.create_server` puts it on a gRPC server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from tfelastic.daemon.aio import within
from tfelastic.daemon.netutil import host_port
from tfelastic.daemon.rendezvous import api, bounds, convert
from tfelastic.daemon.rendezvous.bounds import printable
from tfelastic.daemon.rendezvous.cluster_status import while_unrecorded
from tfelastic.daemon.rendezvous.durable import JobStore
from tfelastic.daemon.rendezvous.limits import LimitExceededError
from tfelastic.daemon.rendezvous.persistence import Persistence
from tfelastic.daemon.rendezvous.state import Clock, Rendezvous
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

log = logging.getLogger("tfelastic.coordinator")

SERVICE_NAME = "tfelastic.v1.Rendezvous"
MIN_PROBE_SECONDS = 0.2  # below this (a job whose liveness timing leaves no room) no probe is tried
MAX_PROBES = 32  # at once, for the whole coordinator: each may resolve a name on the default thread pool

_ERROR_CODES: dict[type[api.RendezvousError], grpc.StatusCode] = {
    api.SpecMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    api.ProtocolVersionError: grpc.StatusCode.FAILED_PRECONDITION,
    api.DuplicateNodeError: grpc.StatusCode.ALREADY_EXISTS,
    api.JobClosedError: grpc.StatusCode.ABORTED,
    api.ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
    LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    api.UnknownNodeError: grpc.StatusCode.NOT_FOUND,
    api.OperatorRefusedError: grpc.StatusCode.FAILED_PRECONDITION,
}
_HEARTBEAT = convert.order_to_proto(api.Heartbeat())


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
    def __init__(self, rendezvous: Rendezvous, clock: Clock, heartbeat_interval: float, *,
                 store: JobStore | None = None, info: api.CoordinatorInfo | None = None) -> None:
        self.rendezvous = rendezvous
        self.info = info
        self.persistence = Persistence(store, rendezvous, clock, self._deliver) if store is not None else None
        self._persisting: asyncio.Task[None] | None = None
        self._clock = clock
        self._heartbeat_interval = heartbeat_interval
        self._sessions: dict[str, _Session] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._ticking = True  # False: the ticker ends at its next turn (a stop, a hand-over)
        self._ticked_at = clock()  # the ticker's last turn, for systemd's watchdog
        self._timers_changed = asyncio.Event()
        self._assignment_template: pb.Assignment | None = None
        # What other threads (the /metrics server) may read: republished by the ticker, never mutated.
        self.published = rendezvous.status()
        self.finished = asyncio.Event()
        self._probes = asyncio.Semaphore(MAX_PROBES)
        self._deciding = True  # False once the job is handed over: a successor decides from what etcd holds

    def start(self) -> None:
        if self.rendezvous.state.is_terminal:  # a job taken over from etcd after its verdict: nothing to run
            self.finished.set()
        self._ticker = asyncio.create_task(self._tick_forever())
        if self.persistence is not None:
            self._persisting = asyncio.create_task(self.persistence.run())
            self._persisting.add_done_callback(self._persistence_ended)

    def _persistence_ended(self, task: asyncio.Task[None]) -> None:
        """A coordinator that can no longer write the job's state must not go on leading it."""
        if task.cancelled() or task.exception() is None or self.persistence is None:
            return
        log.error("writing the job's state failed: %r; stepping down", task.exception())
        self.persistence.deposed.set()

    def stop_deciding(self) -> None:
        """The job goes to a successor: no message, timer or command changes its state here any more. An order
        decided after the last write would reach no agent before the sessions close, and the successor, taking
        over what etcd holds, would count its members lost."""
        self._deciding = False
        self._stop_ticking()

    def close_sessions(self, details: str) -> None:
        for session in self._sessions.values():
            session.outbox.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE, details))

    def ticked_within(self, max_age: float) -> bool:
        """For systemd's watchdog: the ticker (node timeouts, heartbeats) turned within ``max_age`` seconds, or was
        stopped on purpose (a hand-over, the end)."""
        return not self._ticking or self._clock() - self._ticked_at <= max_age

    def _stop_ticking(self) -> None:
        self._ticking = False
        self._timers_changed.set()
        if self._ticker is not None:
            self._ticker.cancel()

    async def stop(self) -> None:
        self._stop_ticking()
        for task in (self._ticker, self._persisting):
            if task is not None:
                task.cancel()
                # Raised again here, a task's error stopped the shutdown before the gRPC server's, whose finalizer
                # then ran after the event loop had closed. The persistence task's was logged when it ended.
                outcome = (await asyncio.gather(task, return_exceptions=True))[0]
                if task is self._ticker and isinstance(outcome, Exception):
                    log.error("the coordinator's timers had stopped: %r", outcome)

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
        return convert.status_to_proto(self.status(), self._clock())

    def status(self) -> api.ClusterStatus:
        """The job now, with who serves it, and what waits for etcd."""
        snap = dataclasses.replace(self.rendezvous.status(), coordinator=self.info)
        persistence = self.persistence
        if persistence is None:
            return snap
        return while_unrecorded(snap, persistence.problem, holding=persistence.holding,
                                holding_assignments=persistence.holding_assignments)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.OperatorReply:
        drain = convert.drain_from_proto(request)
        node_id = printable(drain.node_id, bounds.MAX_NAME_CHARS)
        reason = printable(drain.reason, bounds.SHOWN_REASON_CHARS) or "drained by an operator"
        await self._operator(context, lambda: self.rendezvous.drain(node_id, reason, force=drain.force))
        log.info("operator drains node %s (%s)", node_id, reason)
        return pb.OperatorReply(detail=f"node {node_id} is draining: its trainer checkpoints and stops, the node "
                                       "leaves, and the job re-forms without it")

    async def RestartJob(self, request: pb.RestartJobRequest,
                         context: grpc.aio.ServicerContext[Any, Any]) -> pb.OperatorReply:
        reason = printable(request.reason, bounds.SHOWN_REASON_CHARS) or "requested by an operator"
        told: list[str] = []

        def restart() -> list[api.Send]:
            sends, said = self.rendezvous.restart_job(reason)
            told.append(said)
            return sends

        await self._operator(context, restart)
        log.info("operator restarts the job (%s): %s", reason, told[0])
        return pb.OperatorReply(detail=told[0])

    async def Readmit(self, request: pb.ReadmitRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pb.OperatorReply:
        node_id = printable(request.node_id, bounds.MAX_NAME_CHARS)
        await self._operator(context, lambda: self.rendezvous.readmit(node_id))
        connected = node_id in self._sessions
        return pb.OperatorReply(detail=f"node {node_id} is readmitted: " + (
            "its agent checks the node now and, if the check passes, the node joins again" if connected else
            "it is not connected now; it joins once its agent is back and its node check passes"))

    async def _operator(self, context: grpc.aio.ServicerContext[Any, Any],
                        command: Callable[[], list[api.Send]]) -> None:
        """Run an operator command on the state machine; a refusal becomes the call's status."""
        if not self._deciding:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is handing the job over to another; "
                                                              "try again in a few seconds")
        try:
            sends = command()
        except api.RendezvousError as e:
            log.warning("refused an operator command from %s: %s", context.peer(), e)
            await context.abort(_ERROR_CODES.get(type(e), grpc.StatusCode.FAILED_PRECONDITION), str(e))
        self._dispatch(sends)

    async def _read(self, requests: AsyncIterator[pb.AgentMessage], session: _Session) -> None:
        try:
            async for wire in requests:
                if not session.node_id and not wire.HasField("join"):
                    raise api.ProtocolError("the first message of a session must be a Join")
                message = convert.agent_message_from_proto(wire, self._clock())
                probe = self.rendezvous.probe_for(message) if isinstance(message, api.Join) else None
                unreachable = await self._probe(probe) if probe is not None else ""
                self._handle(session, message, unreachable)
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

    async def _probe(self, probe: api.ProbeWorkerPort) -> str:
        """Tries to reach the node's trainer port, where its agent listens until the Join is answered, so that a
        firewall or a dead NIC shows up as a quarantine that names the address, not as a TensorFlow start-up that
        hangs. Returns what failed ("" if nothing, or if no try fitted in its time)."""
        deadline = asyncio.get_running_loop().time() + probe.timeout
        try:  # the wait for a slot counts against the same deadline: many probes at once must not add up
            await asyncio.wait_for(self._probes.acquire(), probe.timeout)
        except asyncio.TimeoutError:
            log.warning("no probe of %s: %d others are under way", probe.node_id, MAX_PROBES)
            return ""
        try:
            left = deadline - asyncio.get_running_loop().time()
            return "" if left < MIN_PROBE_SECONDS else await self._connect(probe, left)
        finally:
            self._probes.release()

    @staticmethod
    async def _connect(probe: api.ProbeWorkerPort, timeout: float) -> str:
        address = host_port(probe.host, probe.port)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(probe.host, probe.port), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            problem = f"no answer within {timeout:.2g}s" if isinstance(e, asyncio.TimeoutError) \
                else (e.strerror or str(e))
            return f"{probe.node_id} cannot be reached at {address} from the coordinator: {problem} (a " \
                   "firewall, a dead NIC, or a wrong --advertise-address?)"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return ""

    def _handle(self, session: _Session, message: api.AgentMessage, unreachable: str = "") -> None:
        """``message`` came within bounds: the guard checked its wire form (bounds.check_message) first."""
        if not self._deciding:
            return  # handed over: the agent tells the successor again
        if isinstance(message, api.Join):
            self._join(session, dataclasses.replace(message, check_failure=unreachable) if unreachable else message)
            return
        if self._sessions.get(session.node_id) is not session:
            return  # evicted or replaced: it is being closed, and nothing it says counts any more
        node_id, rdzv = session.node_id, self.rendezvous
        rdzv.heartbeat(node_id)
        if isinstance(message, api.WorkerReport):
            detail = printable(message.detail, bounds.SHOWN_DETAIL_CHARS)
            self._dispatch(rdzv.report(node_id, dataclasses.replace(message, detail=detail)))
        elif isinstance(message, api.Leave):
            reason = printable(message.reason, bounds.SHOWN_REASON_CHARS)
            log.info("node %s leaves: %s", node_id, reason)
            self._dispatch(rdzv.leave(node_id, reason))

    def _join(self, session: _Session, join: api.Join) -> None:
        node_id = join.node.node_id
        if session.node_id and node_id != session.node_id:
            raise api.ProtocolError(f"node id {node_id!r} differs from this session's {session.node_id!r}")
        if session.node_id and self._sessions.get(session.node_id) is not session:
            return  # evicted or replaced
        rejoin = bool(session.node_id)
        sends = self.rendezvous.join(join.node, join.spec, rejoin=rejoin, restart_count=join.restart_count,
                                     attached_generation=join.attached_generation, checked=join.checked,
                                     check_failure=printable(join.check_failure, bounds.SHOWN_CHECK_FAILURE_CHARS))
        if not rejoin:  # taken in on this session: one the node had before is over (the core counted it lost)
            replaced = self._sessions.get(node_id)
            if replaced is not None:
                replaced.outbox.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE,
                                                  f"replaced by a newer session of node {node_id}"))
            session.node_id = node_id
            self._sessions[node_id] = session
            log.info("node %s joined from %s", node_id, session.peer)
        self._dispatch(sends)

    def _end(self, session: _Session) -> None:
        if session.node_id and self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
            log.info("node %s disconnected", session.node_id)
            if self._deciding:
                self._dispatch(self.rendezvous.disconnect(session.node_id))

    def _dispatch(self, sends: Sequence[api.Send]) -> None:
        if self.persistence is not None:
            self.persistence.dispatch(sends)  # delivered now, or once etcd holds the state that names them
        else:
            self._deliver(sends)

    def _deliver(self, sends: Sequence[api.Send]) -> None:
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
            succeeded = self.rendezvous.state is api.JobState.SUCCEEDED
            log.log(logging.INFO if succeeded else logging.ERROR, "job %s: %s", self.rendezvous.state.value,
                    self.rendezvous.reason)
            self.published = self.status()
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
        next_heartbeat = 0.0
        while self._ticking:
            self._ticked_at = self._clock()
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
                    session.outbox.put_nowait(_HEARTBEAT)
                next_heartbeat = now + self._heartbeat_interval
                self.published = self.status()
            self._timers_changed.clear()
            wake = min(next_heartbeat, deadline if deadline is not None else next_heartbeat)
            await within(self._timers_changed.wait(), max(0.001, wake - self._clock() + 0.001))
