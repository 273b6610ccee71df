"""Idle agent cost: RSS and CPU of agents supervising a running trainer that reports progress 10 times a second.

    python -m bench.idle_agent [--seconds 30]

Two agents on localhost: one also hosts the coordinator, the other does not. The trainer is the counter test
trainer (no TensorFlow), so the numbers are the agents' own.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from tests.cluster import COUNTER, Cluster, wait_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        steps = str(int(args.seconds * 10 + 200))
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), [sys.executable, COUNTER],
                          env={"COUNTER_STEPS": steps, "COUNTER_STEP_SECONDS": "0.1"},
                          extra_args=["--log-level", "warning"])
        try:
            host = cluster.start("host")
            wait_for(lambda: cluster.status() is not None, 30, "the coordinator")
            other = cluster.start("other")
            cluster.wait_running(1, 2, step=10)
            time.sleep(2)  # let start-up settle before measuring
            agents = {"hosting agent": psutil.Process(host.proc.pid), "plain agent": psutil.Process(other.proc.pid)}
            before = {name: sum(p.cpu_times()[:2]) for name, p in agents.items()}
            started = time.monotonic()
            time.sleep(args.seconds)
            wall = time.monotonic() - started
            for name, process in agents.items():
                used = sum(process.cpu_times()[:2]) - before[name]
                rss = process.memory_info().rss / 2**20
                print(f"{name}: RSS {rss:.1f} MB, CPU {100 * used / wall:.2f}% of a core over {wall:.0f}s "
                      f"(supervising a trainer reporting 10 steps/s)")
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
