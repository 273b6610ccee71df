"""The goodput ledger end to end: real agents, a killed worker, `tfelastic report` from the coordinator while the
job runs, and from etcd after a job on etcd ended (no coordinator leads it any more)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.ledger_check import LEDGER_TRAINER, trainer_fresh_seconds, trainer_redone
from tests.cluster import COUNTER, kill, members, scrape, wait_for
from tests.conftest import ClusterFactory
from tests.etcd import EtcdCluster

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


def report(rendezvous: str, *extra: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--json", "--rendezvous",
                             rendezvous, *extra], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_a_running_jobs_report_and_metrics_account_for_a_killed_worker(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "100000"})
    cluster.start_host("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=20)
    kill(members(doc)[0]["worker_pid"])  # the chief
    doc = cluster.wait_running(2, 2, step=doc["nodes"][0]["step"] + 20, timeout=60)
    ledger = report(str(cluster.endpoint))
    assert ledger["source"] == "coordinator"
    first, second = ledger["generations"]
    assert first["ended"].startswith("worker_exit: a: trainer was killed by SIGKILL"), first
    assert (first["restored_step"], second["ended"]) == (1, "")  # its first report after start-up
    assert second["restored_step"] is not None and second["restored_step"] > 0  # from the counter's step file
    goodput = ledger["goodput"]
    assert 0.0 < goodput["ratio"] < 1.0
    assert goodput["seconds"]["startup"] > 0 and goodput["seconds"]["training"] > 0
    assert abs(sum(goodput["seconds"].values()) - goodput["wall_seconds"]) < 1e-2
    _, samples = scrape(f"http://{cluster.agents[0].metrics_address()}/metrics")
    metric = {c: samples.get(("tfelastic_job_seconds_total", (("category", c),))) for c in goodput["seconds"]}
    assert all(value is not None for value in metric.values()), metric
    assert metric["training"] >= goodput["seconds"]["training"] * 0.5  # scraped a moment apart
    cluster.stop()


def test_steps_redone_count_the_steps_a_killed_chief_made_after_its_last_report(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """The chief reports once a second, steps 50 times a second, and is SIGKILLed with steps its agent never heard
    of: the step file makes the coordinator's count of redone steps the trainer's own."""
    events = tmp_path / "ledger-events.jsonl"
    began = time.time()
    cluster = make_cluster([sys.executable, LEDGER_TRAINER], extra_args=FAST, env={
        "LEDGER_EVENTS": str(events), "LEDGER_STEPS": "100000", "LEDGER_STEP_SECONDS": "0.02",
        "LEDGER_REPORT_INTERVAL": "1.0", "LEDGER_SAVE_EVERY": "100000"})
    cluster.start_host("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=30)
    chief = members(doc)[0]
    reached = tmp_path / f"{events.name}.reached-1-0"

    def ahead_of_its_report() -> bool:
        status = cluster.status()
        step = members(status)[0]["step"] if status else None
        return step is not None and int(reached.read_text()) >= step + 10

    wait_for(ahead_of_its_report, 30, "the chief 10 steps past its last report")
    kill(chief["worker_pid"])
    doc = cluster.wait_running(2, 2, step=5, timeout=60)
    furthest = int(reached.read_text())
    assert doc["goodput"]["steps_redone"] == trainer_redone(events) == furthest, doc["goodput"]  # restored 0
    # The chief's own clock, which the chaos soak sets beside the ledger: every new step took its 0.02 s at least
    # (the first has no previous end; the kill may land between the step's mark and its time).
    assert 0.02 * (furthest - 2) <= trainer_fresh_seconds(events) < time.time() - began
    cluster.stop()


def test_the_report_of_an_ended_job_on_etcd_comes_from_etcd(make_cluster: ClusterFactory, etcd: EtcdCluster) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "80"}, etcd=etcd.url)
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=10)
    kill(members(doc)[1]["worker_pid"])
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    ledger = report(etcd.url)
    assert ledger["source"] == "etcd" and ledger["state"] == "succeeded"
    assert [g["generation"] for g in ledger["generations"]] == [1, 2]
    assert ledger["generations"][-1]["ended"] == "succeeded: every trainer of generation 2 exited 0"
    assert 0.0 < ledger["goodput"]["ratio"] < 1.0
    text = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--rendezvous", etcd.url],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "goodput " in text.stdout and "  training " in text.stdout, text


def test_the_time_after_the_chiefs_training_is_other(make_cluster: ClusterFactory, etcd: EtcdCluster,
                                                     tmp_path: Path) -> None:
    """The trainers report their training done, then spend 4 s before they exit (an evaluation, an export, the
    teardown of an input pipeline): the ledger books those seconds as other, not as training."""
    events = tmp_path / "ledger-events.jsonl"
    cluster = make_cluster([sys.executable, LEDGER_TRAINER], extra_args=FAST, etcd=etcd.url, env={
        "LEDGER_EVENTS": str(events), "LEDGER_STEPS": "40", "LEDGER_STEP_SECONDS": "0.02",
        "LEDGER_AFTER_SECONDS": "4"})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    seconds = report(etcd.url)["goodput"]["seconds"]
    assert seconds["other"] >= 3.5, seconds  # the done report read at once, both exits 4 s later
    assert seconds["training"] <= trainer_fresh_seconds(events) + 1.0, seconds
