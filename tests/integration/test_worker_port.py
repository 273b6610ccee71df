"""A fixed --worker-port (what a site with firewall rules gives) across restarts: each generation's trainer must
find its port free. A SIGKILLed process's leader is a zombie within milliseconds, while its other threads, which
hold its sockets, take a few hundred ms more to exit (more with more memory to unmap): no generation may start on
a port the previous one still holds."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import kill, members, wait_for
from tests.conftest import ClusterFactory
from tests.ports import free_ports

pytestmark = pytest.mark.integration

KILLS = 5
COUNTER = [sys.executable, str(Path(__file__).resolve().parents[1] / "trainers" / "counter.py")]


def next_generation_training(generation: int) -> Callable[[dict[str, Any]], bool]:
    return lambda d: d["generation"] > generation and d["world_size"] == 2 and \
        all(n["step"] is not None and n["step"] >= 1 for n in members(d))


def test_restarts_with_fixed_worker_ports_find_them_free(make_cluster: ClusterFactory) -> None:
    ports = dict(zip("ab", free_ports(2), strict=True))
    cluster = make_cluster(COUNTER, extra_args=["--last-call", "0.5", "--max-restarts", "8", "--warm-start", "off",
                                                "--stop-grace", "1"],
                           env={"COUNTER_STEPS": "100000", "COUNTER_HOLD_PORT_MB": "1000",
                                "COUNTER_IGNORE_TERM": "1"})
    host = cluster.start("a", extra=["--worker-port", str(ports["a"])])
    wait_for(lambda: "hosting the coordinator" in host.log(), 20, "agent a to host")
    cluster.start("b", extra=["--worker-port", str(ports["b"])])
    doc = cluster.wait_running(1, 2, step=1)
    for _ in range(KILLS):
        kill(members(doc)[1]["worker_pid"])  # rank 1's trainer: rank 0's is stopped (SIGTERM, then SIGKILL)
        doc = cluster.wait_status(next_generation_training(doc["generation"]), 60,
                                  "the next generation running with 2 workers")
    failed = [(e["generation"], e["rank"], e["error"]) for e in cluster.events() if e["event"] == "bind_failed"]
    assert failed == [], cluster.logs()
    assert doc["restarts_total"] == KILLS, doc  # one per kill: no generation failed to start
    cluster.stop()
