"""No single point of failure: the coordinator fails over on etcd. A real 3-member etcd on loopback,
real agents with the counter trainer, a standalone head-node coordinator where a case needs one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import (
    COUNTER,
    FORM_WITH_ALL,
    Cluster,
    assert_no_stale_workers,
    fail_the_job_under,
    members,
    scrape,
    wait_for,
)
from tests.conftest import ClusterFactory
from tests.etcd import EtcdCluster, leader_of

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stop-grace", "2", "--last-call", "0.5", "--settle", "1"]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    folder = tmp_path / "etcd"
    folder.mkdir()
    cluster = EtcdCluster(folder).start()
    yield cluster
    cluster.stop()


def starts(cluster: Cluster) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e["event"] == "start"]


def watched_coordinators(output: Path) -> list[str | None]:
    """The coordinator node of every screen that `status --json --watch` drew (None on a screen with an error)."""
    screens = [screen for screen in output.read_text().split("\033[2J\033[H") if screen.strip()]
    documents = [json.loads(screen) for screen in screens[:-1]]  # the last one may be half written
    return [(doc.get("coordinator") or {}).get("node") for doc in documents]


def head_node(cluster: Cluster, etcd: EtcdCluster, name: str = "head-1",
              metrics: Sequence[str] = ("--metrics-port", "off")) -> subprocess.Popen[bytes]:
    log = open(cluster.tmp / f"coordinator-{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
    return subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen", "127.0.0.1:0",
                             "--rendezvous", etcd.url, "--node-id", name, *metrics, "--last-call", "0.5", "--settle",
                             "1"], stdout=log, stderr=subprocess.STDOUT, cwd=cluster.tmp)


def test_a_job_runs_on_etcd_and_status_names_its_coordinator(make_cluster: ClusterFactory,
                                                             etcd: EtcdCluster) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "60"}, etcd=etcd.url)
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=5)
    leader = leader_of(etcd.url)
    assert leader is not None and doc["coordinator"]["node"] == leader.node in ("a", "b")
    assert doc["coordinator"]["address"] == leader.address
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    assert "used without authentication" in cluster.logs()  # anyone who can write to this etcd gets the token
    status = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "status", "--rendezvous", etcd.url],
                            capture_output=True, text=True, timeout=60)
    # The job is over and its coordinator gave the key back: exit 1 and a message saying so, not a traceback.
    assert status.returncode == 1 and "no coordinator leads job 'default' in etcd" in status.stderr, status
    assert "Traceback" not in status.stderr, status.stderr


def test_the_head_node_coordinator_dies_and_training_goes_on_without_a_restart(
        make_cluster: ClusterFactory, etcd: EtcdCluster) -> None:
    """Case 1: a standalone coordinator is SIGKILLed while every worker trains. An agent takes the job over
    from etcd within the lease TTL, the members attach with their workers running: 0 restarts."""
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "300"}, etcd=etcd.url)
    coordinator = head_node(cluster, etcd)
    watch: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (leader := leader_of(etcd.url)) is not None and leader.node == "head-1", 30,
                 "the head node to lead")
        cluster.start("a")
        cluster.start("b")
        before = cluster.wait_running(1, 2, step=10)
        watch_output = cluster.tmp / "status-watch.out"
        with watch_output.open("wb") as out:
            watch = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "status", "--json", "--watch", "0.3",
                                      "--rendezvous", etcd.url], stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: "head-1" in watch_output.read_text(), 30, "the watch to show the head node")
        coordinator.kill()
        coordinator.wait(10)
        after = cluster.wait_status(
            lambda d: d["coordinator"] is not None and d["coordinator"]["node"] in ("a", "b")
            and d["state"] == "running" and min(n["step"] or 0 for n in members(d)) > max(
                n["step"] for n in members(before)), 30, "an agent to take the job over, training on")
        assert (after["generation"], after["restarts_total"]) == (1, 0), after
        wait_for(lambda: watched_coordinators(watch_output)[-1:] == [after["coordinator"]["node"]], 30,
                 "the watch to follow the coordinator to its new node")
        watch.kill()
        watch.wait(10)
        assert watched_coordinators(watch_output)[0] == "head-1", watch_output.read_text()[-2000:]
        assert cluster.wait_all(60) == [0, 0], cluster.logs()
        assert [e["generation"] for e in starts(cluster)] == [1, 1], starts(cluster)  # no worker restarted
        assert "fencing" not in cluster.logs()
    finally:
        for process in (coordinator, watch):  # the watch polls etcd until it is ended, whatever the test's outcome
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)


def test_a_head_node_coordinator_keeps_a_failed_jobs_verdict_on_metrics_for_the_linger(
        make_cluster: ClusterFactory, etcd: EtcdCluster) -> None:
    """The agents exit at a failure; the standalone coordinator that led the job keeps /metrics up with the verdict
    for --metrics-linger, so that a scrape records the failure (TfelasticJobFailed, not TfelasticDaemonDown), then
    exits 1."""
    cluster = make_cluster(TRAINER, extra_args=[*FAST, "--max-restarts", "0"],
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05"}, etcd=etcd.url)
    coordinator = head_node(cluster, etcd, metrics=("--metrics-port", "0", "--metrics-linger", "30"))
    log = cluster.tmp / "coordinator-head-1.log"
    try:
        wait_for(lambda: (leader := leader_of(etcd.url)) is not None and leader.node == "head-1", 30,
                 "the head node to lead")
        assert fail_the_job_under(cluster, log) == [1.0]  # every agent is gone: the coordinator still answers
        assert coordinator.poll() is None
        coordinator.send_signal(signal.SIGTERM)  # ends the linger, as systemd's stop would
        assert coordinator.wait(30) == 1, log.read_text()[-3000:]
        assert "keeping its metrics up for 30s" in log.read_text()
    finally:
        if coordinator.poll() is None:
            coordinator.kill()


def test_a_head_node_that_arrives_takes_the_job_over_from_the_agent_that_leads(
        make_cluster: ClusterFactory, etcd: EtcdCluster) -> None:
    """Head nodes win over agents: the agent that leads hands the job over (it resigns, so the head node waits
    the usual grace for every member), and the running generation goes on."""
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "300"}, etcd=etcd.url)
    cluster.start("a")
    cluster.start("b")
    before = cluster.wait_running(1, 2, step=10)
    assert before["coordinator"]["node"] in ("a", "b")
    coordinator = head_node(cluster, etcd)
    try:
        after = cluster.wait_status(
            lambda d: d["coordinator"] is not None and d["coordinator"]["node"] == "head-1"
            and d["state"] == "running" and min(n["step"] or 0 for n in members(d)) > max(
                n["step"] for n in members(before)), 30, "the head node to lead, training on")
        assert (after["generation"], after["restarts_total"]) == (1, 0), after
        assert "handing the job over" in cluster.logs()
        assert cluster.wait_all(60) == [0, 0], cluster.logs()
        assert [e["generation"] for e in starts(cluster)] == [1, 1], starts(cluster)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()


def test_the_agent_that_leads_dies_and_the_survivors_go_on_at_once(make_cluster: ClusterFactory,
                                                                   etcd: EtcdCluster) -> None:
    """Case 2: the leading agent is SIGKILLed, its worker with it. The survivors elect another leader and run the
    next generation, without waiting for join_timeout."""
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, *FORM_WITH_ALL],
                           env={"COUNTER_STEPS": "300"}, etcd=etcd.url)
    agents = {n: cluster.start(n) for n in ("a", "b", "c")}
    cluster.wait_running(1, 3, step=5)
    leader = leader_of(etcd.url)
    assert leader is not None
    agents[leader.node].proc.send_signal(signal.SIGKILL)
    doc = cluster.wait_status(lambda d: d["generation"] >= 2 and d["state"] == "running"
                              and d["world_size"] == 2, 30, "the survivors' next generation")
    assert doc["restarts_by_reason"].get("node_lost", 0) >= 1, doc
    assert leader.node not in [n["node_id"] for n in members(doc)]
    assert_no_stale_workers(cluster.events())  # the next generation waited for the old one to be gone
    survivors = [a for n, a in agents.items() if n != leader.node]
    seen = [scrape(f"http://{a.metrics_address()}/metrics")[1] for a in survivors]
    assert [s[("tfelastic_coordinator_leader_changes_total", ())] for s in seen] == [1.0, 1.0]
    assert sorted(s[("tfelastic_coordinator_elections_won_total", ())] for s in seen) == [0.0, 1.0]
    assert sorted(s[("tfelastic_coordinator_leading", ())] for s in seen) == [0.0, 1.0]
    assert [a.wait(90) for a in survivors] == [0, 0], cluster.logs()


def test_one_etcd_member_dies_and_nothing_happens_to_training(make_cluster: ClusterFactory,
                                                              etcd: EtcdCluster) -> None:
    """Case 4, first half: quorum holds, the job does not notice."""
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "200"}, etcd=etcd.url)
    cluster.start("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=5)
    etcd.kill(0)
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    assert [e["generation"] for e in starts(cluster)] == [1, 1]


def test_without_quorum_the_generation_trains_on_and_a_failure_waits_for_etcd(make_cluster: ClusterFactory,
                                                                             etcd: EtcdCluster) -> None:
    """Case 4, second half: two of three members die. The running generation trains on; a worker failure then
    stops the set, but the next generation waits until etcd can record it, and status says so. Quorum back:
    the job goes on by itself."""
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "400", "COUNTER_FAIL_AT": "150"},
                           etcd=etcd.url)
    cluster.start("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=5)
    etcd.kill(1)
    etcd.kill(2)
    doc = cluster.wait_status(lambda d: "waiting for etcd" in d["reason"], 60, "the restart to wait for etcd")
    assert doc["state"] == "waiting" and f"generation {doc['generation']} formed" in doc["reason"], doc
    assert [e["generation"] for e in starts(cluster)] == [1, 1]  # nothing started that etcd does not know
    etcd.restart(1)
    etcd.restart(2)
    cluster.wait_running(2, 2, step=155, timeout=60)
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
