"""Control-plane recovery and node-loss benchmarks (real agents on localhost, a trivial non-TF trainer).

    python -m bench.recovery [--faults 20]

* worker kill: SIGKILL one worker; time until every worker of the next generation has started.
* agent kill: SIGKILL an agent (its TCP connection resets); time until the survivors' next generation started.
* silent agent: SIGSTOP an agent (like a partition: no RST, only missing heartbeats), default node_timeout;
  time until the survivors' next generation started.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from bench.common import TRIVIAL, summary, wait_generation_started
from tests.cluster import Cluster, wait_for


def _cluster(tmp: Path, nodes: str, faults: int) -> Cluster:
    os.environ["BENCH_EVENTS"] = str(tmp / "bench-events.jsonl")
    return Cluster(tmp, Endpoint("127.0.0.1", free_port()), TRIVIAL, nodes=nodes,
                   # Every generation here is killed before it makes progress: without --restart-backoff 0 the
                   # backoff between failed generations (1 s, 2 s, ... up to 30 s) is what would be measured.
                   extra_args=["--max-restarts", str(faults + 5), "--restart-backoff", "0", "--log-level", "warning"])


def worker_kills(faults: int) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cluster = _cluster(tmp, "2", faults)
        events = tmp / "bench-events.jsonl"
        try:
            cluster.start("a")
            cluster.start("b")
            samples = []
            for generation in range(1, faults + 1):
                started = wait_generation_started(events, generation, 2)
                victim = started[generation % 2]["pid"]
                killed_at = time.time()
                os.kill(victim, signal.SIGKILL)
                nxt = wait_generation_started(events, generation + 1, 2)
                samples.append(max(e["time"] for e in nxt) - killed_at)
            return samples
        finally:
            cluster.stop()


def agent_losses(faults: int, sig: int) -> list[float]:
    samples = []
    for _ in range(faults):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            cluster = _cluster(tmp, "2:3", faults)
            events = tmp / "bench-events.jsonl"
            try:
                cluster.start("a")
                wait_for(cluster.status, 30, "the coordinator")
                cluster.start("b")
                victim = cluster.start("c")
                wait_generation_started(events, 1, 3)
                killed_at = time.time()
                victim.proc.send_signal(sig)
                nxt = wait_generation_started(events, 2, 2)
                samples.append(max(e["time"] for e in nxt) - killed_at)
                victim.proc.send_signal(signal.SIGKILL)
            finally:
                cluster.stop()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--node-faults", type=int, default=5)
    args = parser.parse_args()
    print(summary("worker kill -> next generation started (2 agents)", worker_kills(args.faults)))
    print(summary("agent SIGKILL -> survivors' next generation started (3 agents)",
                  agent_losses(args.node_faults, signal.SIGKILL)))
    print(summary("agent SIGSTOP (silent, like a partition) -> survivors' next generation started",
                  agent_losses(args.node_faults, signal.SIGSTOP)))


if __name__ == "__main__":
    main()
