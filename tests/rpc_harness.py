"""A real coordinator with a formed job, for tests that throw bad input at it (tests/integration/test_limits.py,
tests/integration/test_fuzz_rpc.py).

The coordinator and two legitimate agents (raw Session streams that join and heartbeat) run on an event loop in
a background thread, so that a test, and every Hypothesis example, can make blocking gRPC calls from the test
thread and then read the coordinator's state on its own loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.client import call_metadata, open_channel
from tfelastic.daemon.rendezvous.host import CoordinatorHost, create_server
from tfelastic.daemon.rendezvous.limits import Limits
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

from tests.cluster import wait_for

T = TypeVar("T")
TOKEN = "harness-token"
SESSION = "/tfelastic.v1.Rendezvous/Session"
GET_STATUS = "/tfelastic.v1.Rendezvous/GetStatus"
SPEC = api.JobSpec(job="fuzz", command_digest=b"\x42" * 32, min_nodes=2, max_nodes=2, max_restarts=3,
                   restart_window_seconds=3600, stall_timeout_seconds=0, backup_dir="/shared/fuzz",
                   heartbeat_interval_seconds=0.5, node_timeout_seconds=2.0)
# Leases far longer than any test: a legitimate agent starved of CPU by the test thread must not be lost.
SETTINGS = api.RendezvousSettings(last_call_seconds=0.0, node_timeout_seconds=60.0)


def join_message(node_id: str, spec: api.JobSpec = SPEC, **fields: Any) -> pb.AgentMessage:
    values: dict[str, Any] = dict(node_id=node_id, spec=convert.spec_to_proto(spec), host="127.0.0.1",
                                  worker_port=2222, incarnation=f"inc-{node_id}", last_rank=-1)
    values.update(fields)
    return pb.AgentMessage(join=pb.Join(**values))


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="coordinator-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class LegitAgent:
    """Joins, heartbeats every 0.1 s (or as fast as it can while ``flooding``), and counts what the
    coordinator sends it."""

    node_id: str
    flooding: bool = False
    received: int = 0
    kinds: list[str] = field(default_factory=list)
    assigned: asyncio.Event = field(default_factory=asyncio.Event)
    ended: str = ""  # how the session ended, if it did

    async def run(self, endpoint: Endpoint) -> None:
        async with open_channel(endpoint) as channel:
            call = pb_grpc.RendezvousStub(channel).Session(metadata=call_metadata(TOKEN))  # type: ignore[no-untyped-call]
            await call.write(join_message(self.node_id))
            beating = asyncio.create_task(self._heartbeat(call))
            try:
                async for message in call:
                    self.received += 1
                    self.kinds.append(message.WhichOneof("kind"))
                    if message.HasField("assignment"):
                        self.assigned.set()
                self.ended = "OK"
            except grpc.aio.AioRpcError as e:
                self.ended = f"{e.code().name}: {e.details()}"
            finally:
                beating.cancel()

    async def _heartbeat(self, call: Any) -> None:
        heartbeat = pb.AgentMessage(heartbeat=pb.Heartbeat())
        while True:
            if not self.flooding:
                await asyncio.sleep(0.1)
            await call.write(heartbeat)


@dataclass
class FormedJob:
    loop: LoopThread
    coordinator: CoordinatorHost
    endpoint: Endpoint
    agents: list[LegitAgent]
    channel: grpc.Channel  # blocking, for the test thread

    def summary(self) -> dict[str, Any]:
        """What bad input must not change: the job's state, generation, restarts and members."""

        async def read() -> api.ClusterStatus:
            return self.coordinator.status()

        snap = self.loop.run(read())
        return {"state": snap.state, "generation": snap.generation, "restarts_total": snap.restarts_total,
                "restarts_by_reason": dict(snap.restarts_by_reason),
                "members": [(n.node_id, n.rank, n.state) for n in snap.nodes if n.rank >= 0]}

    def nodes(self) -> list[str]:
        async def read() -> list[str]:
            return [n.node_id for n in self.coordinator.status().nodes]

        return self.loop.run(read())

    def assert_healthy(self) -> None:
        """Health says SERVING, and both legitimate sessions are alive and still get heartbeats."""
        check = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        for agent in self.agents:
            assert agent.ended == "", f"{agent.node_id}'s session ended: {agent.ended}"
            seen = agent.received
            wait_for(lambda a=agent, s=seen: a.received > s, 30, f"a heartbeat to {agent.node_id}")  # type: ignore[misc]

    def session(self, payloads: Iterable[bytes], timeout: float = 30.0) -> Outcome:
        """A blocking Session that sends ``payloads`` (serialized messages, or any bytes), then hangs up."""
        call = self.channel.stream_stream(SESSION, request_serializer=_identity, response_deserializer=_identity)
        kinds: list[str] = []
        try:
            for raw in call(iter(list(payloads)), metadata=call_metadata(TOKEN), timeout=timeout):
                kinds.append(pb.CoordinatorMessage.FromString(raw).WhichOneof("kind") or "")
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details() or "", kinds)
        return Outcome(grpc.StatusCode.OK, "", kinds)

    def get_status(self, payload: bytes) -> Outcome:
        call = self.channel.unary_unary(GET_STATUS, request_serializer=_identity, response_deserializer=_identity)
        try:
            call(payload, metadata=call_metadata(TOKEN), timeout=30)
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details() or "", [])
        return Outcome(grpc.StatusCode.OK, "", [])


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    kinds: list[str]  # what the coordinator sent before the end

    @property
    def waited_as_standby(self) -> bool:
        """Told to wait, then sent nothing but heartbeats: the coordinator heartbeats every session, so on a
        loaded machine one may come before it reads the hang-up."""
        return self.kinds[:1] == ["waiting"] and set(self.kinds[1:]) <= {"heartbeat"}


def _identity(data: bytes) -> bytes:
    return data


@contextmanager
def formed_job(limits: Limits | None = None) -> Iterator[FormedJob]:
    """A coordinator whose job runs generation 1 with two members, "a" and "b"."""
    loop = LoopThread()

    async def start() -> tuple[CoordinatorHost, list[LegitAgent], list[asyncio.Task[None]]]:
        coordinator = await create_server("127.0.0.1:0", SETTINGS, token=TOKEN, spec=SPEC, heartbeat_interval=0.2,
                                          limits=limits)
        endpoint = Endpoint("127.0.0.1", coordinator.port)
        agents = [LegitAgent("a"), LegitAgent("b")]
        tasks = [asyncio.create_task(agent.run(endpoint)) for agent in agents]
        await asyncio.wait_for(asyncio.gather(*(agent.assigned.wait() for agent in agents)), 30)
        return coordinator, agents, tasks

    async def stop(coordinator: CoordinatorHost, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await coordinator.close(grace=0.1)

    coordinator, agents, tasks = loop.run(start())
    endpoint = Endpoint("127.0.0.1", coordinator.port)
    channel = grpc.insecure_channel(str(endpoint))
    try:
        yield FormedJob(loop, coordinator, endpoint, agents, channel)
    finally:
        channel.close()
        loop.run(stop(coordinator, tasks))
        loop.close()
