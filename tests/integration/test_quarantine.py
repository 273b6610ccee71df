"""Bad nodes set aside, with real agents: a node whose trainer always fails, a node whose check fails, and an
operator's `tfelastic readmit`. Real gRPC, real processes, the coordinator's real /metrics."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import COUNTER, FORM_WITH_ALL, Cluster, members, scrape, wait_for
from tests.conftest import ClusterFactory
from tests.integration.test_operator_commands import operator
from tests.integration.test_security import write_token

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stall-timeout", "10", "--stop-grace", "3", "--settle", "0.5", "--restart-backoff", "0"]
BAD = "its worker failed first in 2 generations within 3600s; last: trainer exited with code 1: RuntimeError: " \
      "CUDA error: an illegal memory access was encountered (a bad GPU)"


def quarantine_of(doc: dict[str, Any], node_id: str) -> dict[str, Any] | None:
    node = next((n for n in doc["nodes"] if n["node_id"] == node_id), None)
    return node["quarantine"] if node is not None and node["state"] == "quarantined" else None


def start_with_a_bad_node(cluster: Cluster, tmp_path: Path) -> Path:
    """a, b and c with --nodes 2:3; c's trainer fails a moment after it starts while the returned file exists."""
    bad = tmp_path / "c-has-a-bad-gpu"
    bad.touch()
    cluster.start_host("a")
    cluster.start("b")
    cluster.start("c", env={"COUNTER_BAD_WHILE": str(bad)})
    return bad


def test_a_node_whose_trainer_always_fails_is_set_aside_and_the_job_succeeds(make_cluster: ClusterFactory,
                                                                             tmp_path: Path) -> None:
    """The issue's case: before quarantine the job spent its budget on the bad node and failed."""
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, *FORM_WITH_ALL],
                           env={"COUNTER_STEPS": "100", "COUNTER_STEP_SECONDS": "0.05"})
    start_with_a_bad_node(cluster, tmp_path)
    doc = cluster.wait_status(lambda d: quarantine_of(d, "c") is not None and d["world_size"] == 2
                              and d["state"] == "running", 60, "c quarantined and a, b running")
    quarantine = quarantine_of(doc, "c")
    assert quarantine is not None
    assert quarantine == {"kind": "worker_failures", "reason": BAD, "seconds_left": pytest.approx(600, abs=30),
                          "until": pytest.approx(time.time() + quarantine["seconds_left"], abs=30)}
    assert [n["node_id"] for n in members(doc)] == ["a", "b"]
    assert doc["restarts_by_reason"] == {"worker_exit": 2} and doc["quarantines_by_kind"] == {"worker_failures": 1}
    url = f"http://{cluster.agents[0].metrics_address()}/metrics"
    quarantined = ("tfelastic_cluster_node_quarantined", (("kind", "worker_failures"), ("node", "c")))
    samples = wait_for(lambda: (found := scrape(url)[1]).get(quarantined) and found, 5,  # republished each heartbeat
                       "the quarantine on /metrics")
    assert samples[quarantined] == 1
    assert samples[("tfelastic_cluster_quarantines_total", (("kind", "worker_failures"),))] == 1
    assert samples[("tfelastic_cluster_nodes", (("state", "quarantined"),))] == 1

    assert cluster.wait_all(90) == [0, 0, 0], cluster.logs()  # the quarantined agent ends with the job
    assert "job succeeded" in cluster.agents[0].log()
    assert f"node c quarantined for 600s: {BAD}" in cluster.agents[0].log()
    assert sum(1 for e in cluster.events() if e["event"] == "bad") == 2  # set aside after its second failure


def test_an_operator_readmits_a_repaired_node_and_the_job_grows_to_take_it_in(make_cluster: ClusterFactory,
                                                                              tmp_path: Path) -> None:
    token = write_token(tmp_path / "token", "readmit-secret")
    cluster = make_cluster(TRAINER, nodes="2:3", token="readmit-secret",
                           extra_args=[*FAST, *FORM_WITH_ALL, "--token-file", token],
                           env={"COUNTER_STEPS": "600", "COUNTER_STEP_SECONDS": "0.05"})
    bad = start_with_a_bad_node(cluster, tmp_path)
    cluster.wait_status(lambda d: quarantine_of(d, "c") is not None and d["world_size"] == 2, 60, "c quarantined")

    unauthenticated = operator(cluster, "readmit", "c")
    assert unauthenticated.returncode == 1 and "UNAUTHENTICATED" in unauthenticated.stderr
    healthy = operator(cluster, "readmit", "a", "--token-file", token)
    assert healthy.returncode == 1
    assert "FAILED_PRECONDITION: node 'a' is not quarantined (quarantined nodes: c)" in healthy.stderr

    bad.unlink()  # the GPU was replaced
    readmitted = operator(cluster, "readmit", "c", "--token-file", token)
    assert readmitted.returncode == 0, readmitted.stderr
    assert "node c is readmitted: its agent checks the node now" in readmitted.stdout
    doc = cluster.wait_status(lambda d: d["state"] == "running" and d["world_size"] == 3
                              and all(n["step"] for n in members(d)), 60, "the job grown back to 3")
    assert [n["node_id"] for n in members(doc)] == ["a", "b", "c"]
    assert doc["restarts_by_reason"] == {"worker_exit": 2, "scale_up": 1}
    assert "operator readmits node c" in cluster.agents[0].log()
    assert "checking this node: readmitted by an operator" in cluster.agents[2].log()
    assert cluster.wait_all(90) == [0, 0, 0], cluster.logs()


def test_a_node_that_fails_its_check_is_set_aside_at_its_first_join(make_cluster: ClusterFactory,
                                                                    tmp_path: Path) -> None:
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, "--last-call", "2"],
                           env={"COUNTER_STEPS": "200", "COUNTER_STEP_SECONDS": "0.05"})
    cluster.start_host("a")
    cluster.start("b")
    cluster.start("c", extra=["--check-min-free-mb", "100000000"])  # more than this disk has: its check fails
    doc = cluster.wait_status(lambda d: quarantine_of(d, "c") is not None and d["world_size"] == 2
                              and d["state"] == "running", 60, "a and b running, c set aside")
    quarantine = quarantine_of(doc, "c")
    assert quarantine is not None and quarantine["kind"] == "node_check"
    assert quarantine["reason"].startswith(f"node check failed: backup dir {tmp_path / 'backup'} has ")
    assert quarantine["reason"].endswith("MiB free, less than the 100000000 MiB a checkpoint needs")
    assert doc["restarts_total"] == 0  # nothing was started on it, so nothing had to restart

    readmitted = operator(cluster, "readmit", "c")  # the disk is still full: the check fails again
    assert readmitted.returncode == 0, readmitted.stderr
    doc = cluster.wait_status(lambda d: d["quarantines_by_kind"] == {"node_check": 2}, 30, "c checked again")
    quarantine = quarantine_of(doc, "c")
    # The readmit forgot the node's history (the operator meant to have fixed it): a fresh first cooldown.
    assert quarantine is not None and quarantine["seconds_left"] == pytest.approx(600, abs=30)
    assert "node check failed: backup dir" in cluster.agents[2].log()
    assert cluster.wait_all(90) == [0, 0, 0], cluster.logs()
