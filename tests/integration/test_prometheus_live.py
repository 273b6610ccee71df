"""A real Prometheus scrapes a running local cluster: every dashboard query returns data, and a fault fires the
right alert in /api/v1/alerts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import COUNTER, kill, members, wait_for
from tests.conftest import ClusterFactory
from tests.prometheus import Prometheus

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")]

MONITORING = Path(__file__).resolve().parent.parent.parent / "monitoring"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel, with Grafana's variables set as Grafana would: all jobs, all nodes."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    values = {"$__rate_interval": "30s", "$__range": "5m", "$job": ".*", "$node": ".*"}
    queries = []
    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                queries.append((panel["title"], re.sub(r"\$\w+", lambda m: values[m.group(0)], expr)))
    return queries


@pytest.fixture
def fake_gpu_target() -> Iterator[str]:
    """The GPU panels need GPUs: the real collector over the fake NVML, as its own scrape target."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_gpu_exporter", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"127.0.0.1:{proc.stdout.readline().strip()}"
    finally:
        proc.kill()
        proc.wait()


def test_every_dashboard_query_returns_data(make_cluster: ClusterFactory, tmp_path: Path,
                                            fake_gpu_target: str) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="2", extra_args=["--failure-stop-grace", "0.25"],
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05", "COUNTER_FAIL_AT": "150"})
    host = cluster.start_host("a")
    agents = [host, cluster.start("b")]
    addresses = [a.metrics_address() for a in agents]
    prometheus = Prometheus(tmp_path / "prom", {"tfelastic-agents": [*addresses, fake_gpu_target],
                                                "tfelastic-coordinator": addresses[:1]},
                            rule_files=[MONITORING / "alerts.yml"])
    try:
        # A failure at step 150, while Prometheus watches: the restart and recovery panels get data.
        cluster.wait_running(2, 2, timeout=60, step=155)
        queries = dashboard_queries()
        assert len(queries) > 20

        def empty() -> list[tuple[str, str]]:
            return [(title, expr) for title, expr in queries if not prometheus.query(expr)]

        wait_for(lambda: not empty(), 90, "every dashboard query to return data", interval=2)
    except AssertionError:
        raise AssertionError(f"dashboard queries without data: {empty()}") from None
    finally:
        prometheus.stop()


def test_a_killed_worker_fires_the_job_failed_alert(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="2", extra_args=["--max-restarts", "0",
                                                                             "--metrics-linger", "5"],
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05"})
    agents = [cluster.start("a"), cluster.start("b")]
    doc = cluster.wait_running(1, 2, step=5)
    addresses = [a.metrics_address() for a in agents]
    host = next(address for agent, address in zip(agents, addresses, strict=True)
                if "hosting the coordinator" in agent.log())
    prometheus = Prometheus(tmp_path / "prom", {"tfelastic-agents": addresses, "tfelastic-coordinator": [host]},
                            rule_files=[MONITORING / "alerts.yml"])
    try:
        wait_for(lambda: prometheus.query('tfelastic_cluster_job_state{state="running"} == 1'), 30,
                 "Prometheus to see the running job")
        assert not [a for a in prometheus.firing() if a["labels"]["alertname"] == "TfelasticJobFailed"]
        kill(members(doc)[1]["worker_pid"])  # with max_restarts 0, one failure fails the job
        assert cluster.wait_all(60) == [1, 1], cluster.logs()
        alert = wait_for(lambda: [a for a in prometheus.firing() if a["labels"]["alertname"] == "TfelasticJobFailed"],
                         60, "TfelasticJobFailed to fire", interval=1)[0]
        assert alert["labels"]["tfelastic_job"] == "default" and alert["labels"]["severity"] == "critical"
    finally:
        prometheus.stop()
