"""What etcd sees of a job: one `tfelastic coordinator --rendezvous etcd://...` (a head node), N simulated agents
heartbeating on gRPC every 0.5 s (bench/coordinator_scale.py), a real 3-member etcd on loopback.

    python -m bench.etcd_load [--nodes 100 1000]

For each N it counts the requests etcd's members received (their own `grpc_server_msg_received_total`, summed
over every method and member) while the agents heartbeat, and for one failure and the re-formation after it,
and compares them with the heartbeats the coordinator received meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families
from tfelastic.daemon.netutil import free_port
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

from bench.coordinator_scale import SimulatedAgent, heartbeats
from tests.cluster import wait_for
from tests.etcd import EtcdCluster, leader_of

STEADY_SECONDS = 10.0


def etcd_requests(etcd: EtcdCluster) -> float:
    """Every gRPC message etcd's members received so far (unary requests and stream messages alike)."""
    total = 0.0
    for member in etcd.members:
        with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=5) as response:
            text = response.read().decode()
        total += sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                     if s.name == "grpc_server_msg_received_total")
    return total


async def measure(nodes: int, address: str, etcd: EtcdCluster) -> str:
    agents = [SimulatedAgent(i, nodes) for i in range(nodes)]
    async with contextlib.AsyncExitStack() as channels:
        sessions = []
        for i, agent in enumerate(agents):
            if i % 50 == 0:  # 100 streams per connection at most; a real agent uses one
                channel = await channels.enter_async_context(grpc.aio.insecure_channel(
                    address, options=[("grpc.use_local_subchannel_pool", 1)]))
            sessions.append(asyncio.create_task(agent.run(channel)))
        stop = asyncio.Event()
        beating = asyncio.create_task(heartbeats(agents, stop))
        await asyncio.wait_for(asyncio.gather(*(a.assigned.wait() for a in agents)), 180)
        await asyncio.sleep(2)
        before, started = etcd_requests(etcd), time.perf_counter()
        await asyncio.sleep(STEADY_SECONDS)
        elapsed = time.perf_counter() - started
        steady = (etcd_requests(etcd) - before) / elapsed
        beats = nodes / 0.5
        before = etcd_requests(etcd)
        agents[-1].queue.put_nowait(pb.AgentMessage(report=pb.WorkerReport(
            generation=agents[-1].generation, status=pb.WORKER_STATUS_FAILED, exit_code=1)))
        await asyncio.wait_for(asyncio.gather(*(a.stopped.wait() for a in agents)), 180)
        for a in agents:
            a.assigned.clear()
            a.queue.put_nowait(a.join)
        await asyncio.wait_for(asyncio.gather(*(a.assigned.wait() for a in agents)), 300)
        restart = etcd_requests(etcd) - before
        stop.set()
        beating.cancel()
        for s in sessions:
            s.cancel()
    return (f"{nodes} agents: etcd received {steady:.1f} requests/s while they sent the coordinator {beats:.0f} "
            f"heartbeats/s; one failure and the re-formation of {nodes} nodes cost etcd {restart:.0f} requests")


def run(nodes: int) -> str:
    with tempfile.TemporaryDirectory() as d:
        etcd = EtcdCluster(Path(d)).start()
        address = f"127.0.0.1:{free_port()}"
        head = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen", address,
                                 "--rendezvous", etcd.url, "--job", "scale", "--node-id", "head-1",
                                 "--metrics-port", "off", "--last-call", "0.2", "--log-level", "warning"])
        try:
            wait_for(lambda: (leader := leader_of(etcd.url, "scale")) is not None and leader.node == "head-1", 30,
                     "the head node to lead")
            return asyncio.run(measure(nodes, address, etcd))
        finally:
            head.kill()
            head.wait()
            etcd.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    args = parser.parse_args()
    for nodes in args.nodes:
        print(run(nodes), flush=True)


if __name__ == "__main__":
    main()
