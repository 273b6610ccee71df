"""A real Prometheus scrapes a running local cluster: every dashboard query returns data (with the coordinator
hosted by an agent, and with an etcd rendezvous, where the coordinator is whichever agent leads and every agent
is scraped alike), a fault fires the right alert in /api/v1/alerts, and a job's end, success or failure, raises
no TfelasticDaemonDown."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import COUNTER, Cluster, kill, members, wait_for
from tests.conftest import ClusterFactory
from tests.etcd import EtcdCluster, leader_of
from tests.prometheus import Prometheus

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")]

MONITORING = Path(__file__).resolve().parent.parent.parent / "monitoring"
ETCD_ROW = "etcd and the coordinator's election"  # its panels have data only on an etcd rendezvous
DAEMON_DOWN = 'ALERTS{alertname="TfelasticDaemonDown"}'  # pending or firing


def dashboard_queries(with_etcd: bool) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel, with Grafana's variables set as Grafana would: all jobs, all nodes."""
    def panels(items: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
        row = ""
        for panel in items:
            row = panel["title"] if panel.get("type") == "row" else row
            yield row, panel
            for inner in panel.get("panels", []):
                yield panel["title"], inner

    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    values = {"$__rate_interval": "30s", "$__range": "5m", "$job": ".*", "$node": ".*"}
    queries = []
    for row, panel in panels(dashboard["panels"]):
        if row == ETCD_ROW and not with_etcd:
            continue
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                queries.append((panel["title"], re.sub(r"\$\w+", lambda m: values[m.group(0)], expr)))
    return queries


def operator(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tfelastic.daemon", *args, "--rendezvous", cluster.rendezvous]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


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


@pytest.mark.parametrize("rendezvous", ["hosted", "etcd"])
def test_every_dashboard_query_returns_data(rendezvous: str, make_cluster: ClusterFactory, tmp_path: Path,
                                            fake_gpu_target: str) -> None:
    (tmp_path / "etcd").mkdir()
    etcd = EtcdCluster(tmp_path / "etcd", size=1).start() if rendezvous == "etcd" else None
    env = {"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05", "COUNTER_FAIL_AT": "150",
           "COUNTER_TIERED": "1"}  # restores and save stalls, as a trainer on the fast tier reports them
    cluster = make_cluster([sys.executable, COUNTER], nodes="2", extra_args=["--failure-stop-grace", "0.25"],
                           env=env, etcd=etcd.url if etcd else "")
    prometheus = None
    try:
        agents = [cluster.start("a"), cluster.start("b")] if etcd else [cluster.start_host("a"), cluster.start("b")]
        addresses = [a.metrics_address() for a in agents]
        # On etcd the coordinator moves between the agents: scrape them all alike, and no fixed coordinator target.
        targets: dict[str, Sequence[str]] = {"tfelastic-agents": [*addresses, fake_gpu_target]}
        if not etcd:
            targets["tfelastic-coordinator"] = addresses[:1]
        prometheus = Prometheus(tmp_path / "prom", targets, rule_files=[MONITORING / "alerts.yml"])
        # A failure at step 150, while Prometheus watches: the restart, recovery and restore panels get data;
        # then an operator's restart, a planned stop: the stop outcomes get theirs.
        cluster.wait_running(2, 2, timeout=60, step=155)
        result = operator(cluster, "restart", "--reason", "the dashboard test")
        assert result.returncode == 0, result.stderr
        cluster.wait_running(3, 2, timeout=60, step=1)
        queries = dashboard_queries(with_etcd=etcd is not None)
        assert len(queries) > 40

        def empty() -> list[tuple[str, str]]:
            assert prometheus is not None
            return [(title, expr) for title, expr in queries if not prometheus.query(expr)]

        wait_for(lambda: not empty(), 90, "every dashboard query to return data", interval=2)
    except AssertionError:
        raise AssertionError(f"dashboard queries without data: {empty() if prometheus else '(no Prometheus)'}\n"
                             f"{cluster.logs()[-3000:]}") from None
    finally:
        if prometheus is not None:
            prometheus.stop()
        if etcd is not None:
            cluster.stop()
            etcd.stop()


def test_on_etcd_prometheus_finds_the_job_on_whichever_agent_leads_after_a_failover(make_cluster: ClusterFactory,
                                                                                      tmp_path: Path) -> None:
    """The scrape docs/alerts.md gives for a coordinator that moves: every agent in tfelastic-agents, no coordinator
    target. The leading agent is SIGKILLed; the job's metrics, and the goodput rule over them, then come from the
    agent that took the job over."""
    (tmp_path / "etcd").mkdir()
    etcd = EtcdCluster(tmp_path / "etcd", size=1).start()
    cluster = make_cluster([sys.executable, COUNTER], nodes="2:3", extra_args=["--last-call", "30"],
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05"}, etcd=etcd.url)
    prometheus = None
    try:
        agents = {name: cluster.start(name) for name in ("a", "b", "c")}
        addresses = {name: agent.metrics_address() for name, agent in agents.items()}
        prometheus = Prometheus(tmp_path / "prom", {"tfelastic-agents": list(addresses.values())},
                                rule_files=[MONITORING / "alerts.yml"])
        cluster.wait_running(1, 3, step=5)

        def instances(expr: str) -> set[str]:
            assert prometheus is not None
            return {r["metric"]["instance"] for r in prometheus.query(expr)}

        running, leading = 'tfelastic_cluster_job_state{state="running"} == 1', "tfelastic_coordinator_leading == 1"
        first = wait_for(lambda: (leader := leader_of(etcd.url)) is not None and instances(running) == instances(
            leading) == {addresses[leader.node]} and leader.node, 30, "Prometheus to see the job on its leader")

        def ledger_seconds(node: str) -> float:
            assert prometheus is not None
            found = prometheus.query(f'sum(tfelastic_job_seconds_total{{instance="{addresses[node]}"}})')
            return float(found[0]["value"][1]) if found else 0.0

        wait_for(lambda: ledger_seconds(first) >= 20.0, 60, "the leader's ledger to hold 20 s of the job")
        before = ledger_seconds(first)  # the last the old leader said, read just before its end
        agents[first].proc.send_signal(signal.SIGKILL)
        cluster.wait_running(2, 2, timeout=60, step=1)
        second = wait_for(lambda: (leader := leader_of(etcd.url)) is not None and leader.node != first and
                          instances(running) == instances(leading) == {addresses[leader.node]} and leader.node, 30,
                          "Prometheus to see the job on the agent that took it over")
        # The ledger lives in the job's state in etcd: the new leader's counters go on from the old one's, where a
        # ledger begun afresh would show only the seconds since the take-over (a few, against 20 or more).
        carried = wait_for(lambda: ledger_seconds(second), 30, "the new leader's ledger")
        assert carried >= before, (carried, before)
    finally:
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()
        etcd.stop()


def _all_down(prometheus: Prometheus, targets: int) -> bool:
    return len(prometheus.query('up{job=~"tfelastic-agents|tfelastic-coordinator"} == 0')) == targets


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
        # The agents are gone, as a failed job's are: JobFailed speaks for them, not DaemonDown.
        wait_for(lambda: _all_down(prometheus, 3), 30, "Prometheus to see every target down", interval=1)
        wait_for(lambda: len(prometheus.query("tfelastic:target_finished")) == 3, 15,
                 "every target to be known as finished", interval=1)
        # The alerts are evaluated apart from the recording rule they read: one evaluation may lag.
        wait_for(lambda: not prometheus.query(DAEMON_DOWN), 10, "no TfelasticDaemonDown, pending or firing")
        assert _all_down(prometheus, 3)
    finally:
        prometheus.stop()


def test_a_job_that_succeeds_raises_no_alert(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """The hosting agent keeps /metrics up for --metrics-linger after the verdict, the other agent exits at once;
    Prometheus records the verdict, and neither target's exit is a TfelasticDaemonDown. Scrapes every 5 s, far
    apart against the moment between the verdict and the hosting agent's exit, as in production (15 s)."""
    cluster = make_cluster([sys.executable, COUNTER], nodes="2", extra_args=["--metrics-linger", "12"],
                           env={"COUNTER_STEPS": "500", "COUNTER_STEP_SECONDS": "0.05"})
    agents = [cluster.start_host("a"), cluster.start("b")]
    addresses = [a.metrics_address() for a in agents]
    prometheus = Prometheus(tmp_path / "prom", {"tfelastic-agents": addresses,
                                                "tfelastic-coordinator": addresses[:1]},
                            rule_files=[MONITORING / "alerts.yml"], interval="5s")
    try:
        wait_for(lambda: prometheus.query('tfelastic_cluster_job_state{state="running"} == 1'), 30,
                 "Prometheus to see the running job")
        assert cluster.wait_all(90) == [0, 0], cluster.logs()
        wait_for(lambda: _all_down(prometheus, 3), 30, "Prometheus to see every target down", interval=1)
        finished = wait_for(lambda: len(prometheus.query("tfelastic:target_finished")) == 3, 20,
                            "every target to be known as finished", interval=1)
        assert finished
        wait_for(lambda: not prometheus.query(DAEMON_DOWN), 20, "no TfelasticDaemonDown, pending or firing")
        assert _all_down(prometheus, 3)  # still down: quiet because the job finished, not because they came back
        assert not [a for a in prometheus.firing() if a["labels"]["alertname"] in ("TfelasticDaemonDown",
                                                                                   "TfelasticJobFailed")]
    finally:
        prometheus.stop()
