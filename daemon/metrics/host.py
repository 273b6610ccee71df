"""The worker's processes and the host, through psutil, read at scrape time (in the HTTP server's thread)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from tfelastic.daemon.worker.process import process_tree


class HostCollector(Collector):
    """``worker_pid`` returns the keeper's pid of the running worker, or None when there is none."""

    def __init__(self, worker_pid: Callable[[], int | None], backup_dir: str) -> None:
        self._worker_pid = worker_pid
        self._backup_dir = backup_dir

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # do not collect at registration

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._worker()
        memory = psutil.virtual_memory()
        yield GaugeMetricFamily("tfelastic_host_memory_total_bytes", "Host memory.", value=memory.total)
        yield GaugeMetricFamily("tfelastic_host_memory_available_bytes", "Host memory available.",
                                value=memory.available)
        with contextlib.suppress(OSError):  # not created yet: no sample rather than a wrong one
            yield GaugeMetricFamily("tfelastic_backup_dir_free_bytes", "Free space of the backup_dir's filesystem.",
                                    value=shutil.disk_usage(self._backup_dir).free)

    def _worker(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        pid = self._worker_pid()
        processes = _tree(pid) if pid else []
        cpu = rss = fds = 0.0
        for p in processes:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                cpu += times.user + times.system
                rss += p.memory_info().rss
                fds += p.num_fds()
        yield GaugeMetricFamily("tfelastic_worker_processes", "Processes of the worker tree (keeper included).",
                                value=len(processes))
        if processes:
            yield CounterMetricFamily("tfelastic_worker_cpu_seconds", "CPU time of the worker's live processes.",
                                      value=cpu)
            yield GaugeMetricFamily("tfelastic_worker_resident_memory_bytes", "RSS of the worker's processes.",
                                    value=rss)
            yield GaugeMetricFamily("tfelastic_worker_open_fds", "Open file descriptors of the worker's processes.",
                                    value=fds)


def _tree(pid: int) -> list[psutil.Process]:
    """The worker's processes for its metrics: none where they cannot be read."""
    try:
        return process_tree(pid)
    except psutil.Error:
        return []


def register_host_collector(registry: CollectorRegistry, worker_pid: Callable[[], int | None],
                            backup_dir: str) -> HostCollector:
    collector = HostCollector(worker_pid, backup_dir)
    registry.register(collector)
    return collector
