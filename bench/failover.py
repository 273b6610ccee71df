"""Coordinator failover on etcd: real agents, a real 3-member etcd, the trivial trainer.

    python -m bench.failover [--runs 5] [--no-partition]

1. head node killed: a standalone coordinator leads; SIGKILL it while both workers run. Times: kill -> a new
   leader in etcd; kill -> the new leader's status shows the generation running with every member attached.
   The workers must not restart (checked: no second generation).
2. leading agent killed: 3 agents (2:3); SIGKILL the agent that leads (its worker dies with it). Time: kill ->
   every worker of the survivors' next generation started.
3. leader partitioned (needs root and `ip`): 3 hosts in network namespaces, one etcd member and one agent each;
   the leader's link goes down. Time: partition -> every worker of the majority's next generation started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tfelastic.daemon.endpoint import Endpoint

from bench.common import TRIVIAL, read_events, summary, wait_generation_started
from tests.cluster import FORM_WITH_ALL, Cluster, members, wait_for
from tests.etcd import EtcdCluster, leader_of

FAST = ["--stop-grace", "2", "--last-call", "0.5", "--settle", "1", "--log-level", "warning"]
NETNS = Path(__file__).resolve().parent.parent / "tests" / "netns-hosts.sh"
PREFIX, SUBNET = "tfeb", "10.231.11"
T = TypeVar("T")
NETNS_ENV = {"TFE_NETNS_PREFIX": PREFIX, "TFE_NETNS_SUBNET": SUBNET}


def _cluster(tmp: Path, etcd: EtcdCluster, nodes: str, extra: list[str] | None = None,
             token: str | None = None) -> Cluster:
    os.environ["BENCH_EVENTS"] = str(tmp / "bench-events.jsonl")
    return Cluster(tmp, Endpoint("127.0.0.1", 1), TRIVIAL, nodes=nodes, etcd=etcd.url, token=token,
                   extra_args=[*FAST, *(extra or [])])


def _with_etcd(run: Callable[[Path, EtcdCluster], T], **etcd_args: object) -> T:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "etcd").mkdir()
        etcd = EtcdCluster(tmp / "etcd", **etcd_args).start()  # type: ignore[arg-type]
        try:
            return run(tmp, etcd)
        finally:
            etcd.stop()


def head_node_killed(tmp: Path, etcd: EtcdCluster) -> tuple[float, float]:
    cluster = _cluster(tmp, etcd, "2")
    head = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen", "127.0.0.1:0",
                             "--rendezvous", etcd.url, "--node-id", "head-1", "--metrics-port", "off",
                             "--last-call", "0.5", "--log-level", "warning"])
    try:
        wait_for(lambda: (leader := leader_of(etcd.url)) is not None and leader.node == "head-1", 30, "the head")
        cluster.start("a")
        cluster.start("b")
        wait_generation_started(tmp / "bench-events.jsonl", 1, 2)
        cluster.wait_status(lambda d: d["state"] == "running" and all(n["worker_pid"] for n in members(d)), 30,
                            "both workers running")
        killed_at = time.time()
        head.kill()
        wait_for(lambda: (leader := leader_of(etcd.url)) is not None and leader.node != "head-1", 30,
                 "a new leader", interval=0.01)
        elected = time.time() - killed_at
        doc = cluster.wait_status(lambda d: d["coordinator"]["node"] != "head-1" and d["state"] == "running"
                                  and all(n["worker_pid"] for n in members(d)) and len(members(d)) == 2, 30,
                                  "the new leader to have every member attached")
        attached = time.time() - killed_at
        assert doc["generation"] == 1 and doc["restarts_total"] == 0, doc
        assert {e["generation"] for e in read_events(tmp / "bench-events.jsonl")} == {1}, "a worker restarted"
        return elected, attached
    finally:
        head.kill()
        head.wait()
        cluster.stop()


def leading_agent_killed(tmp: Path, etcd: EtcdCluster) -> float:
    cluster = _cluster(tmp, etcd, "2:3", FORM_WITH_ALL)
    try:
        agents = {n: cluster.start(n) for n in ("a", "b", "c")}
        wait_generation_started(tmp / "bench-events.jsonl", 1, 3)
        leader = wait_for(lambda: leader_of(etcd.url), 30, "a leader")
        killed_at = time.time()
        agents[leader.node].proc.send_signal(signal.SIGKILL)
        nxt = wait_generation_started(tmp / "bench-events.jsonl", 2, 2)
        return float(max(e["time"] for e in nxt)) - killed_at
    finally:
        cluster.stop()


def leader_partitioned() -> float:
    subprocess.run(["bash", str(NETNS), "down", "3"], env=NETNS_ENV, capture_output=True)
    try:
        subprocess.run(["bash", str(NETNS), "up", "3"], env=NETNS_ENV, check=True)
        subprocess.run(["ip", "addr", "add", f"{SUBNET}.254/24", "dev", f"{PREFIX}br0"], check=True)
        return _with_etcd(_partition, hosts=[f"{SUBNET}.{i}" for i in (1, 2, 3)],
                          netns=[f"{PREFIX}-h{i}" for i in (1, 2, 3)])
    finally:
        subprocess.run(["bash", str(NETNS), "down", "3"], env=NETNS_ENV, check=True)


def _partition(tmp: Path, etcd: EtcdCluster) -> float:
    token = tmp / "token"
    token.write_text("bench-secret\n")
    token.chmod(0o600)
    cluster = _cluster(tmp, etcd, "2:3", [*FORM_WITH_ALL, "--token-file", str(token)], token="bench-secret")
    try:
        for i in (1, 2, 3):
            cluster.start(f"n{i}", netns=f"{PREFIX}-h{i}")
        wait_generation_started(tmp / "bench-events.jsonl", 1, 3)
        leader = wait_for(lambda: leader_of(etcd.url), 30, "a leader")
        cut_at = time.time()
        subprocess.run(["ip", "-n", f"{PREFIX}-h{leader.node[1:]}", "link", "set", "eth0", "down"], check=True)
        nxt = wait_generation_started(tmp / "bench-events.jsonl", 2, 2)
        return float(max(e["time"] for e in nxt)) - cut_at
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-partition", action="store_true")
    args = parser.parse_args()
    case1 = [_with_etcd(head_node_killed) for _ in range(args.runs)]
    print(summary("1. head node SIGKILLed -> new leader in etcd (lease TTL 2 s)", [e for e, _ in case1]))
    print(summary("1. head node SIGKILLed -> new leader serves with every member attached, 0 restarts",
                  [a for _, a in case1]))
    print(summary("2. leading agent SIGKILLed -> survivors' next generation started",
                  [_with_etcd(leading_agent_killed) for _ in range(args.runs)]))
    if not args.no_partition:
        print(summary("3. leader's host partitioned -> majority's next generation started",
                      [leader_partitioned() for _ in range(args.runs)]))


if __name__ == "__main__":
    main()
