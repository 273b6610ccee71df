"""Operator commands against real agents: `tfelastic drain NODE` and `tfelastic restart`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import COUNTER, FORM_WITH_ALL, Cluster, members, scrape, wait_for
from tests.conftest import ClusterFactory
from tests.integration.test_security import job_summary, write_token

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stall-timeout", "5", "--stop-grace", "3", "--last-call", "0.5", "--settle", "0.5"]
SLOW_COUNTER = {"COUNTER_STEPS": "300", "COUNTER_STEP_SECONDS": "0.05", "COUNTER_EXIT_ON_TERM": "1"}


def operator(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tfelastic.daemon", *args, "--rendezvous", str(cluster.endpoint)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_drain_removes_the_node_without_spending_the_budget(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, *FORM_WITH_ALL, "--max-restarts", "0"],
                           env=SLOW_COUNTER)
    cluster.start_host("a")
    cluster.start("b")
    drained = cluster.start("c")
    cluster.wait_running(1, 3, step=5)

    result = operator(cluster, "drain", "c", "--reason", "disk swap")
    assert result.returncode == 0, result.stderr
    assert "node c is draining" in result.stdout

    assert drained.wait(30) == 0, drained.log()  # a drained agent leaves cleanly: systemd will not restart it
    assert "drained by an operator (disk swap)" in drained.log()
    doc = cluster.wait_running(2, 2, step=1)
    assert [n["node_id"] for n in members(doc)] == ["a", "b"]
    assert doc["restarts_by_reason"] == {"node_left": 1}  # with --max-restarts 0, a failure would have ended it
    assert "node c leaves: drained: disk swap" in cluster.agents[0].log()
    assert cluster.agents[0].wait(60) == 0 and cluster.agents[1].wait(60) == 0, cluster.logs()


def test_restart_reforms_the_same_nodes_without_spending_the_budget(make_cluster: ClusterFactory) -> None:
    """The trainers save on the restart's SIGTERM, announce their exit, and would then tear down for 600 s: their
    agents end them a second after the announcement, not at the end of the 300 s stop grace."""
    cluster = make_cluster(TRAINER, nodes="2", extra_args=[*FAST, "--max-restarts", "0", "--stop-grace", "300"],
                           env={"COUNTER_STEPS": "300", "COUNTER_STEP_SECONDS": "0.05",
                                "COUNTER_CHECKPOINT_ON_TERM": "1", "COUNTER_TEARDOWN_SECONDS": "600"})
    cluster.start_host("a")
    cluster.start("b")
    before = [n["node_id"] for n in members(cluster.wait_running(1, 2, step=5))]  # b may have joined first

    command = [sys.executable, "-m", "tfelastic.daemon", "restart", "--reason", "new learning rate", "--rendezvous",
               str(cluster.endpoint)]
    both = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [process.communicate(timeout=60) for process in both]  # two terminals at once: one restart
    assert [process.returncode for process in both] == [0, 0], results
    said = sorted(stdout for stdout, _ in results)
    assert said[0].startswith("absorbed into the restart of job default from generation 1"), said
    assert said[1].startswith("restarting job default from generation 1"), said
    doc = cluster.wait_running(2, 2, step=1, timeout=60)  # the stop grace would take 300 s
    assert [n["node_id"] for n in members(doc)] == before and sorted(before) == ["a", "b"]  # same nodes, same ranks
    assert doc["restarts_by_reason"] == {"operator_restart": 1}
    for agent in cluster.agents:  # ended by SIGKILL, counted as the exit 42 it announced: a checkpointed stop
        samples = scrape(f"http://{agent.metrics_address()}/metrics")[1]
        assert samples.get(("tfelastic_worker_graceful_stops_total", (("outcome", "checkpointed"),))) == 1.0, \
            agent.log()
        assert "the trainer was SIGKILLed after it announced exit 42 with its state saved" in agent.log()
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    assert "operator restarts the job (new learning rate)" in cluster.agents[0].log()


def test_operator_commands_find_their_job_from_its_file_or_the_environment(make_cluster: ClusterFactory,
                                                                           tmp_path: Path) -> None:
    """An operator on a node gives the job's own file (or TFELASTIC_* variables), not the rendezvous and token."""
    token = write_token(tmp_path / "token", "s3cret-operator")
    cluster = make_cluster(TRAINER, nodes="2", token="s3cret-operator",
                           extra_args=[*FAST, "--token-file", token, "--max-restarts", "0"], env=SLOW_COUNTER)
    cluster.start_host("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=1)
    job_file = tmp_path / "job.toml"
    job_file.write_text(f'[job]\nname = "default"\ncommand = ["python", "train.py"]\nmin_nodes = 2\n\n'
                        f'[rendezvous]\nendpoint = "{cluster.endpoint}"\ntoken_file = "{token}"\n')
    tfelastic = [sys.executable, "-m", "tfelastic.daemon"]

    status = subprocess.run([*tfelastic, "status", "--json", "--config", str(job_file)], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["job"] == "default"
    environment = {**os.environ, "TFELASTIC_RENDEZVOUS": str(cluster.endpoint), "TFELASTIC_TOKEN_FILE": token}
    restart = subprocess.run([*tfelastic, "restart", "--reason", "from the environment"], capture_output=True,
                             text=True, timeout=60, env=environment)
    assert restart.returncode == 0, restart.stderr
    assert restart.stdout.startswith("restarting job default from generation 1"), restart.stdout
    doc = cluster.wait_running(2, 2, step=1)
    assert doc["restarts_by_reason"] == {"operator_restart": 1}
    assert cluster.wait_all(60) == [0, 0], cluster.logs()


def test_refusals_name_the_problem_and_change_nothing(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    token = write_token(tmp_path / "token", "s3cret-operator")
    cluster = make_cluster(TRAINER, nodes="2", token="s3cret-operator", extra_args=[*FAST, "--token-file", token],
                           env=SLOW_COUNTER)
    cluster.start_host("a")
    cluster.start("b")
    before = job_summary(cluster.wait_running(1, 2, step=1))

    unauthenticated = operator(cluster, "drain", "b")
    assert unauthenticated.returncode == 1
    assert "UNAUTHENTICATED" in unauthenticated.stderr and unauthenticated.stderr.count("--token-file") == 1

    below_min = operator(cluster, "drain", "b", "--token-file", token)
    assert below_min.returncode == 1
    assert "FAILED_PRECONDITION" in below_min.stderr and "below min_nodes=2" in below_min.stderr
    assert "--force" in below_min.stderr

    unknown = operator(cluster, "drain", "zz", "--token-file", token)
    assert unknown.returncode == 1
    assert "NOT_FOUND" in unknown.stderr and "(nodes: a, b)" in unknown.stderr

    after = cluster.status()
    assert after is not None and job_summary(after) == before
    assert "s3cret" not in cluster.logs()


def test_drained_node_keeps_hosting_the_coordinator_until_the_job_ends(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="1:2", extra_args=[*FAST, *FORM_WITH_ALL],
                           env={**SLOW_COUNTER, "COUNTER_STEPS": "120"})
    host = cluster.start_host("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=5)

    assert operator(cluster, "drain", "a").returncode == 0
    doc = cluster.wait_running(2, 1, step=1)
    assert [n["node_id"] for n in members(doc)] == ["b"]
    wait_for(lambda: "hosting it until the job ends" in host.log(), 10, "the drained host to keep hosting it")
    assert host.proc.poll() is None  # b still needs the coordinator it hosts
    assert cluster.agents[1].wait(60) == 0, cluster.logs()
    assert host.wait(30) == 0, host.log()
