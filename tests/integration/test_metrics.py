"""/metrics of real agents, scraped over HTTP through a fault, and checked by promtool."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.cluster import COUNTER, scrape
from tests.conftest import ClusterFactory

pytestmark = pytest.mark.integration


def test_agents_export_training_control_plane_host_and_cluster_metrics(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="2",
                           extra_args=["--failure-stop-grace", "0.25"],
                           env={"COUNTER_STEPS": "200", "COUNTER_FAIL_AT": "20"})  # runs on while scraped
    host = cluster.start_host("a")
    other = cluster.start("b")
    urls = {name: f"http://{agent.metrics_address()}/metrics" for name, agent in (("a", host), ("b", other))}
    cluster.wait_running(2, 2, step=25)

    _, a = scrape(urls["a"])
    _, b = scrape(urls["b"])
    for samples in (a, b):
        assert samples[("tfelastic_generation", ())] == 2
        assert samples[("tfelastic_world_size", ())] == 2
        assert samples[("tfelastic_worker_state", (("state", "running"),))] == 1
        assert samples[("tfelastic_restarts_total", (("reason", "worker_exit"),))] == 1
        assert samples[("tfelastic_training_step", ())] >= 25
        assert samples[("tfelastic_training_steps_total", ())] > 0
        assert samples[("tfelastic_rendezvous_duration_seconds_count", ())] == 2
        assert samples[("tfelastic_recovery_seconds_count", ())] == 1  # the failure, then the first step
        assert samples[("tfelastic_worker_processes", ())] >= 2  # keeper and trainer
        assert samples[("tfelastic_worker_resident_memory_bytes", ())] > 0
        assert samples[("tfelastic_gpu_nvml_up", ())] == 0  # no GPU or driver here: said cleanly, nothing invented
        assert samples[("tfelastic_gpus", ())] == 0
    failed_node = a if a[("tfelastic_rank", ())] == 0 else b  # the counter's fault hits the chief
    assert failed_node[("tfelastic_failure_detection_seconds_count", ())] == 1
    assert a[("tfelastic_cluster_members", ())] == 2  # the hosting agent also exports the cluster's view
    assert a[("tfelastic_cluster_restarts_total", (("reason", "worker_exit"),))] == 1
    assert ("tfelastic_cluster_members", ()) not in b
    assert cluster.wait_all(60) == [0, 0], cluster.logs()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed")
def test_promtool_finds_nothing_to_complain_about(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster([sys.executable, COUNTER], nodes="1", env={"COUNTER_STEPS": "400"})
    agent = cluster.start("a")
    url = f"http://{agent.metrics_address()}/metrics"
    cluster.wait_running(1, 1, step=2)
    text, _ = scrape(url)
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and check.stdout == "" and check.stderr == "", check.stdout + check.stderr
