"""Agent, cluster and host metrics, each on a fresh CollectorRegistry, read back with get_sample_value."""

from __future__ import annotations

import os
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from tfelastic.daemon.metrics.agent import MAX_COUNTED_JUMP, AgentMetrics
from tfelastic.daemon.metrics.cluster import register_cluster_collector
from tfelastic.daemon.metrics.host import register_host_collector
from tfelastic.daemon.metrics.http import MAX_CONNECTIONS_PER_ADDRESS, serve_metrics
from tfelastic.daemon.rendezvous.api import ClusterStatus, JobState, NodeState, NodeStatus
from tfelastic.daemon.worker.states import WorkerState
from tfelastic.trainer.progress import ProgressMessage

from tests.cluster import wait_for


def agent_metrics() -> tuple[CollectorRegistry, AgentMetrics]:
    registry = CollectorRegistry()
    return registry, AgentMetrics(registry, "mnist", "gpu-01")


def test_info_names_job_and_node() -> None:
    registry, _ = agent_metrics()
    assert registry.get_sample_value("tfelastic_agent_info", {"tfelastic_job": "mnist", "node": "gpu-01"}) == 1


def test_step_counters_grow_by_the_progress_made_within_a_generation() -> None:
    registry, metrics = agent_metrics()
    metrics.new_generation(2, rank=1, world_size=3)
    metrics.progress(ProgressMessage(2, 1, step=100, examples=6400, loss=0.5), wall_time=1000.0)
    metrics.progress(ProgressMessage(2, 1, step=110, examples=7040, loss=0.4), wall_time=1001.0)
    value = registry.get_sample_value
    assert value("tfelastic_training_step") == 110
    assert value("tfelastic_training_steps_total") == 10  # resuming at step 100 is not training
    assert value("tfelastic_training_examples_total") == 640
    assert value("tfelastic_training_loss") == 0.4
    assert value("tfelastic_training_last_progress_timestamp_seconds") == 1001.0
    assert (value("tfelastic_generation"), value("tfelastic_rank"), value("tfelastic_world_size")) == (2, 1, 3)
    metrics.new_generation(3, rank=0, world_size=2)  # restored from step 100: no negative or double counting
    metrics.progress(ProgressMessage(3, 1, step=100), wall_time=1002.0)
    metrics.progress(ProgressMessage(3, 1, step=105), wall_time=1003.0)
    assert value("tfelastic_training_steps_total") == 15


def test_a_step_that_leaps_is_not_counted_as_training() -> None:
    """Two reports of a huge step once added 2^62 each to the counter, past where float64 can add 1 to it: a
    leap beyond MAX_COUNTED_JUMP counts nothing, and counting goes on from it."""
    registry, metrics = agent_metrics()
    metrics.new_generation(1, rank=0, world_size=1)
    for step, examples in ((0, 0), (10, 640), (2**53, 2**53), (2**53 + 5, 2**53 + 320), (0, 0), (2**40, 2**40),
                           (2**40 + 5, 2**40 + 320)):
        metrics.progress(ProgressMessage(1, 1, step=step, examples=examples), wall_time=1.0)
    assert registry.get_sample_value("tfelastic_training_steps_total") == 20
    assert registry.get_sample_value("tfelastic_training_examples_total") == 1280
    metrics.progress(ProgressMessage(1, 1, step=2**40 + 5 + MAX_COUNTED_JUMP), wall_time=1.0)  # the cap itself counts
    assert registry.get_sample_value("tfelastic_training_steps_total") == 20 + MAX_COUNTED_JUMP


def test_fast_tier_save_stalls_restores_by_tier_and_steps_redone() -> None:
    registry, metrics = agent_metrics()
    value = registry.get_sample_value
    metrics.new_generation(1, rank=0, world_size=2)
    metrics.progress(ProgressMessage(1, 1, step=0, restored_tier="none"), wall_time=1.0)
    assert value("tfelastic_checkpoint_restores_total", {"tier": "none"}) == 1
    assert value("tfelastic_restore_steps_redone_count") == 0  # a first generation redoes nothing
    metrics.progress(ProgressMessage(1, 1, step=20, checkpoint_step=20, stall=0.004), wall_time=2.0)
    metrics.progress(ProgressMessage(1, 1, step=40, checkpoint_step=40, stall=0.3), wall_time=3.0)
    metrics.progress(ProgressMessage(1, 1, step=47), wall_time=4.0)
    assert value("tfelastic_checkpoint_save_stall_seconds_count") == 2
    assert value("tfelastic_checkpoint_save_stall_seconds_bucket", {"le": "0.005"}) == 1
    assert value("tfelastic_checkpoint_save_stall_seconds_sum") == pytest.approx(0.304)
    metrics.new_generation(2, rank=0, world_size=2)
    metrics.progress(ProgressMessage(2, 1, step=40, restored_tier="local", restored_step=40), wall_time=5.0)
    assert value("tfelastic_checkpoint_restores_total", {"tier": "local"}) == 1
    assert (value("tfelastic_restore_steps_redone_count"), value("tfelastic_restore_steps_redone_sum")) == (1, 7)
    metrics.new_generation(3, rank=0, world_size=2)  # killed before any report: 40 is still the last step
    metrics.new_generation(4, rank=0, world_size=2)
    metrics.progress(ProgressMessage(4, 1, step=20, restored_tier="shared", restored_step=20), wall_time=6.0)
    assert value("tfelastic_restore_steps_redone_sum") == 7 + 20


def test_checkpoint_and_worker_state() -> None:
    registry, metrics = agent_metrics()
    metrics.checkpoint(50, wall_time=123.0)
    metrics.set_worker_state(WorkerState.RUNNING)
    value = registry.get_sample_value
    assert (value("tfelastic_checkpoint_step"), value("tfelastic_checkpoint_timestamp_seconds")) == (50, 123.0)
    assert {s.value: value("tfelastic_worker_state", {"state": s.value}) for s in WorkerState} == {
        s.value: (1.0 if s is WorkerState.RUNNING else 0.0) for s in WorkerState}


def test_cluster_collector_reads_the_published_status() -> None:
    snap = ClusterStatus(
        job="mnist", state=JobState.RUNNING, reason="", generation=4, world_size=2, min_nodes=2, max_nodes=3,
        max_restarts=3, restarts_total=3, restarts_by_reason={"worker_exit": 2, "scale_up": 1},
        nodes=(NodeStatus("a", 0, "h", 1, NodeState.RUNNING, 10, None),
               NodeStatus("b", 1, "h", 2, NodeState.RUNNING, 11, None),
               NodeStatus("c", -1, "h", 3, NodeState.WAITING, 0, None)))
    registry = CollectorRegistry()
    register_cluster_collector(registry, lambda: snap)
    value = registry.get_sample_value
    assert value("tfelastic_cluster_generation") == 4
    assert value("tfelastic_cluster_members") == 2
    assert value("tfelastic_cluster_desired_nodes", {"bound": "min"}) == 2
    assert value("tfelastic_cluster_desired_nodes", {"bound": "max"}) == 3
    assert value("tfelastic_cluster_nodes", {"state": "running"}) == 2
    assert value("tfelastic_cluster_nodes", {"state": "waiting"}) == 1
    assert value("tfelastic_cluster_job_state", {"state": "running"}) == 1
    assert value("tfelastic_cluster_job_state", {"state": "failed"}) == 0
    assert value("tfelastic_cluster_restarts_total", {"reason": "worker_exit"}) == 2
    assert value("tfelastic_cluster_restarts_total", {"reason": "node_lost"}) == 0
    assert value("tfelastic_cluster_info", {"tfelastic_job": "mnist"}) == 1


def test_cluster_collector_exports_the_goodput_ledger_by_category() -> None:
    from tfelastic.daemon.rendezvous.api import GoodputView
    from tfelastic.daemon.rendezvous.goodput import CATEGORIES

    seconds = {c: float(i) for i, c in enumerate(CATEGORIES)}
    snap = ClusterStatus(job="mnist", state=JobState.RUNNING, reason="", generation=1, world_size=1, min_nodes=1,
                           max_nodes=1, max_restarts=3, restarts_total=0, restarts_by_reason={},
                           goodput=GoodputView(seconds))
    registry = CollectorRegistry()
    register_cluster_collector(registry, lambda: snap)
    assert {c: registry.get_sample_value("tfelastic_job_seconds_total", {"category": c}) for c in CATEGORIES} == \
        seconds


def test_cluster_collector_names_each_quarantined_node_and_counts_quarantines_by_kind() -> None:
    snap = ClusterStatus(
        job="mnist", state=JobState.RUNNING, reason="", generation=3, world_size=2, min_nodes=2, max_nodes=3,
        max_restarts=3, restarts_total=2, restarts_by_reason={"worker_exit": 2},
        nodes=(NodeStatus("a", 0, "h", 1, NodeState.RUNNING, 10, None),
               NodeStatus("c", -1, "h", 3, NodeState.QUARANTINED, 0, None, quarantine_reason="x",
                            quarantined_until=700.0, quarantine_kind="worker_failures")),
        quarantines_by_kind={"worker_failures": 1})
    registry = CollectorRegistry()
    register_cluster_collector(registry, lambda: snap)
    value = registry.get_sample_value
    assert value("tfelastic_cluster_node_quarantined", {"node": "c", "kind": "worker_failures"}) == 1
    assert value("tfelastic_cluster_node_quarantined", {"node": "a", "kind": ""}) is None
    assert value("tfelastic_cluster_nodes", {"state": "quarantined"}) == 1
    assert value("tfelastic_cluster_quarantines_total", {"kind": "worker_failures"}) == 1
    assert value("tfelastic_cluster_quarantines_total", {"kind": "node_check"}) == 0


def test_host_collector_measures_the_worker_tree(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    register_host_collector(registry, os.getpid, str(tmp_path))

    def value(name: str) -> float:
        sample = registry.get_sample_value(name)
        assert sample is not None, name
        return sample

    assert value("tfelastic_worker_processes") >= 1
    assert value("tfelastic_worker_resident_memory_bytes") > 10 * 2**20  # this very Python process
    assert value("tfelastic_worker_open_fds") > 0
    assert value("tfelastic_worker_cpu_seconds_total") > 0
    assert 0 < value("tfelastic_host_memory_available_bytes") <= value("tfelastic_host_memory_total_bytes")
    assert value("tfelastic_backup_dir_free_bytes") > 0


def test_host_collector_without_a_worker_or_backup_dir(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    register_host_collector(registry, lambda: None, str(tmp_path / "not-yet"))
    assert registry.get_sample_value("tfelastic_worker_processes") == 0
    assert registry.get_sample_value("tfelastic_worker_resident_memory_bytes") is None
    assert registry.get_sample_value("tfelastic_backup_dir_free_bytes") is None


@pytest.mark.parametrize("token", [None, "scrape-secret"])
def test_metrics_listener_and_its_bearer_token(token: str | None) -> None:
    registry, _ = agent_metrics()
    server = serve_metrics(registry, "127.0.0.1", 0, token)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        if token:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url, timeout=10)
            assert refused.value.code == 401
            wrong = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(wrong, timeout=10)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert 'tfelastic_agent_info{node="gpu-01",tfelastic_job="mnist"} 1.0' in response.read().decode()
    finally:
        server.close()


def scrape(port: int, token: str, source: str) -> str:
    """One GET /metrics from ``source`` (a loopback address of ours), with the bearer token."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(f"GET /metrics HTTP/1.0\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_idle_connections_to_metrics_hold_neither_threads_nor_the_door() -> None:
    """Connections that never send a request: at most MAX_CONNECTIONS_PER_ADDRESS from one address get a thread,
    the rest are closed at once, the silent ones are closed after the read timeout, and a scrape from another
    address is served all the while."""
    registry, _ = agent_metrics()
    server = serve_metrics(registry, "127.0.0.1", 0, "scrape-secret", read_timeout=1.0)
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(300)]
    try:
        def closed(s: socket.socket) -> bool:
            s.settimeout(0.001)
            try:
                return s.recv(1) == b""
            except (TimeoutError, BlockingIOError):
                return False
            except ConnectionResetError:
                return True

        wait_for(lambda: sum(closed(s) for s in idle) >= 300 - MAX_CONNECTIONS_PER_ADDRESS, 20,
                 "the connections beyond the bound to be closed")
        assert threading.active_count() <= threads_before + MAX_CONNECTIONS_PER_ADDRESS
        assert "tfelastic_agent_info" in scrape(server.port, "scrape-secret", "127.0.0.2")
        wait_for(lambda: all(closed(s) for s in idle), 20, "the silent connections to time out")
        wait_for(lambda: threading.active_count() <= threads_before, 10, "their threads to end")
    finally:
        for s in idle:
            s.close()
        server.close()
