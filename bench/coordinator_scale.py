"""Coordinator at scale: one real `tfelastic coordinator` process, N simulated agents on N gRPC streams.

    python -m bench.coordinator_scale [--nodes 100 500 1000]

For each N it reports: the time from the last Join to the last Assignment received (round formation); the
time from one agent's failure report to the last StopWorkers received (restart fan-out); the time from the
rejoins to the last Assignment of the next generation (re-formation); and the coordinator's CPU while N agents
heartbeat every 0.5 s. The simulated agents share one client process, which limits how
fast they can read: the fan-out time is an upper bound on the coordinator's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from functools import partial

import grpc
import psutil
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port
from tfelastic.daemon.rendezvous.client import fetch_status
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

from tests.cluster import wait_for

HEARTBEAT = pb.AgentMessage(heartbeat=pb.Heartbeat())


class SimulatedAgent:
    def __init__(self, index: int, nodes: int) -> None:
        spec = pb.JobSpec(job="scale", command_digest=b"\x00" * 32, min_nodes=nodes, max_nodes=nodes,
                          max_restarts=3, restart_window_seconds=3600, stall_timeout_seconds=300)
        self.join = pb.AgentMessage(join=pb.Join(node_id=f"n{index:05d}", spec=spec, host="127.0.0.1",
                                                 worker_port=10000 + index))
        self.assigned = asyncio.Event()
        self.stopped = asyncio.Event()
        self.received_at: dict[str, float] = {}
        self.queue: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()

    async def run(self, channel: object) -> None:
        call = pb_grpc.RendezvousStub(channel).Session()  # type: ignore[no-untyped-call]
        await call.write(self.join)

        async def write() -> None:
            while True:
                await call.write(await self.queue.get())

        writer = asyncio.create_task(write())
        try:
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "assignment":
                    self.generation = message.assignment.generation
                    self.received_at["assignment"] = time.perf_counter()
                    self.assigned.set()
                elif kind == "stop":
                    self.received_at["stop"] = time.perf_counter()
                    self.stopped.set()
        finally:
            writer.cancel()


async def heartbeats(agents: list[SimulatedAgent], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for agent in agents:
            agent.queue.put_nowait(HEARTBEAT)
        await asyncio.sleep(0.5)


async def measure(nodes: int, endpoint: Endpoint, coordinator: psutil.Process) -> str:
    agents = [SimulatedAgent(i, nodes) for i in range(nodes)]
    async with contextlib.AsyncExitStack() as channels:
        # The coordinator allows 100 streams per connection (a real agent uses one): 50 agents per connection.
        # A local subchannel pool keeps gRPC from sharing one connection between the channels.
        sessions = []
        for i, agent in enumerate(agents):
            if i % 50 == 0:
                channel = await channels.enter_async_context(grpc.aio.insecure_channel(
                    str(endpoint), options=[("grpc.use_local_subchannel_pool", 1)]))
            sessions.append(asyncio.create_task(agent.run(channel)))
        stop = asyncio.Event()
        beating = asyncio.create_task(heartbeats(agents, stop))
        joined = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(a.assigned.wait() for a in agents)), 120)
        formed = max(a.received_at["assignment"] for a in agents) - joined
        await asyncio.sleep(2)
        cpu0, wall0 = sum(coordinator.cpu_times()[:2]), time.perf_counter()
        await asyncio.sleep(10)
        cpu = 100 * (sum(coordinator.cpu_times()[:2]) - cpu0) / (time.perf_counter() - wall0)
        failed_at = time.perf_counter()
        agents[-1].queue.put_nowait(pb.AgentMessage(report=pb.WorkerReport(
            generation=agents[-1].generation, status=pb.WORKER_STATUS_FAILED, exit_code=1)))
        await asyncio.wait_for(asyncio.gather(*(a.stopped.wait() for a in agents)), 120)
        fanout = max(a.received_at["stop"] for a in agents) - failed_at
        for a in agents:
            a.assigned.clear()
        rejoined_at, cpu_before = time.perf_counter(), sum(coordinator.cpu_times()[:2])
        for a in agents:  # every agent confirms its stop by joining again
            a.queue.put_nowait(a.join)
        await asyncio.wait_for(asyncio.gather(*(a.assigned.wait() for a in agents)), 300)
        reformed = max(a.received_at["assignment"] for a in agents) - rejoined_at
        reform_cpu = sum(coordinator.cpu_times()[:2]) - cpu_before
        status_started = time.perf_counter()
        await fetch_status(endpoint, None, timeout=30)
        status_time = time.perf_counter() - status_started
        stop.set()
        beating.cancel()
        for s in sessions:
            s.cancel()
    return (f"{nodes} agents: round formed {formed * 1000:.0f} ms after the joins were sent, restart fan-out "
            f"{fanout * 1000:.0f} ms, re-formed {reformed * 1000:.0f} ms after the rejoins "
            f"(coordinator CPU {reform_cpu * 1000:.0f} ms of it), "
            f"coordinator CPU {cpu:.1f}% of a core while they heartbeat, "
            f"status snapshot {status_time * 1000:.0f} ms, coordinator RSS "
            f"{coordinator.memory_info().rss / 2**20:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 500, 1000])
    args = parser.parse_args()
    for nodes in args.nodes:
        endpoint = Endpoint("127.0.0.1", free_port())
        proc = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen", str(endpoint),
                                 "--log-level", "warning", "--last-call", "0.2",
                                 "--metrics-port", "0"])
        try:
            wait_for(partial(_up, endpoint), 30, "the coordinator")
            print(asyncio.run(measure(nodes, endpoint, psutil.Process(proc.pid))), flush=True)
        finally:
            proc.kill()
            proc.wait()


def _up(endpoint: Endpoint) -> bool:
    try:
        asyncio.run(fetch_status(endpoint, None, timeout=1))
        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()
