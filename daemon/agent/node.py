"""This node as the agent's shell reaches it: the host and GPU metrics, the GPU summary that reports carry, the
node check (off the loop, bounded, one at a time), the listener for the coordinator's probe, the snapshot steps
this node can restore, and the waits before a Join for what a stopped worker still holds (its port, its GPU
memory). I/O only: the core decides when each is needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

import psutil
from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.nodecheck import MATMUL_TIMEOUT_SECONDS, NodeCheck, PortListener
from tfelastic.daemon.agent.snapshot_scan import SnapshotScan
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.metrics.gpu import GpuProcess, register_gpu_collector, visible_gpus
from tfelastic.daemon.metrics.host import register_host_collector
from tfelastic.daemon.netutil import port_taken

log = logging.getLogger("tfelastic.agent")

NODE_CHECK_SECONDS = MATMUL_TIMEOUT_SECONDS + 30.0  # the matmul's own bound, and the rest of the check
# A killed trainer's port is free once all its threads have exited: a few hundred ms for a few GB to unmap, more
# for a host-memory-heavy model; past this the Join goes out anyway and the trainer's bind error says the rest.
PORT_FREE_SECONDS = 30.0
# A killed CUDA process gives its device memory back as the driver tears its context down, after the process is
# gone: usually well under a second, seconds for a large one. Memory still held after this is a GPU in trouble
# (the driver cannot reclaim it until the GPU is reset): a failed node check, which sets the node aside.
GPU_RELEASE_SECONDS = 30.0
GPU_POLL_SECONDS = 0.05


class Node:
    """``nvml``: the NVML library (pynvml, the default), or a stand-in with its functions."""

    def __init__(self, config: AgentConfig, registry: CollectorRegistry, trainer_env: dict[str, str],
                 live_pid: Callable[[], int | None], nvml: Any = None) -> None:
        backup_dir = config.resolved_backup_dir()
        register_host_collector(registry, live_pid, backup_dir)
        # The trainer's GPUs, not the node's: CUDA_VISIBLE_DEVICES as the trainer will see it.
        self.gpus = register_gpu_collector(registry, nvml=nvml,
                                           visible=visible_gpus(trainer_env.get("CUDA_VISIBLE_DEVICES")))
        self._check = NodeCheck(backup_dir, config.node.id, config.node.check_min_free_mb << 20,
                                gpu_problems=self.gpus.health_problems, gpu_count=lambda: self.gpus.utilization()[0])
        self.probe = PortListener()
        self.snapshots = SnapshotScan(config.local_tier(), backup_dir)

    async def check(self) -> str:
        """The node check's failures ("" if it passed), run in a thread and bounded: a hung mount must not keep
        the node out of the job silently (the thread it hangs in stays behind; the failure says why)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._check.run), NODE_CHECK_SECONDS)
        except asyncio.TimeoutError:
            return f"the node check did not finish within {NODE_CHECK_SECONDS:g}s (a hung mount of the backup dir " \
                   f"{self._check.backup_dir}? a wedged GPU?)"

    async def wait_port_free(self, port: int, timeout: float = PORT_FREE_SECONDS) -> bool:
        """Waits until ``port`` can be bound as the trainer's server binds it (all of this host's addresses,
        SO_REUSEADDR): the threads of a killed trainer hold its sockets for a while after its leader is a zombie,
        and a trainer started meanwhile could not bind it. False if it is still held after ``timeout``."""
        started = time.monotonic()
        while await asyncio.to_thread(port_taken, "0.0.0.0", port):
            waited = time.monotonic() - started
            if waited > timeout:
                log.error("the worker port %d is still held %.0fs after the old worker stopped (by another "
                          "process?): joining anyway", port, waited)
                return False
            await asyncio.sleep(0.01)
        if (waited := time.monotonic() - started) > 0.01:
            log.info("the worker port %d was free %.3fs after the old worker stopped", port, waited)
        return True

    async def wait_gpus_released(self, pids: Collection[int],
                                 timeout: float | None = None) -> tuple[float | None, str]:
        """Waits until NVML lists none of ``pids`` (a stopped worker's processes) on the trainer's GPUs. Returns
        how long it waited (None: NVML lists nothing here, no GPU or no driver) and, after ``timeout`` (default
        :data:`GPU_RELEASE_SECONDS`), what still holds memory ("" once all of it is back)."""
        timeout = GPU_RELEASE_SECONDS if timeout is None else timeout
        started = time.monotonic()
        said = False
        while True:
            held = await asyncio.to_thread(self._held_by, set(pids))
            waited = time.monotonic() - started
            if held is None:
                return None, ""
            if not held:
                if said:
                    log.info("the GPUs gave back the stopped worker's memory after %.3fs", waited)
                return waited, ""
            if waited > timeout:
                return waited, f"GPU memory of the stopped worker is still held {waited:.0f}s after it stopped " \
                               f"({_describe(held)}): reset the GPU, and replace it if this comes back"
            if not said:
                log.info("waiting for the GPUs to give back the stopped worker's memory (%s)", _describe(held))
                said = True
            await asyncio.sleep(GPU_POLL_SECONDS)

    def _held_by(self, pids: set[int]) -> list[GpuProcess] | None:
        """What NVML lists of ``pids``, less a pid that runs again (reused by another process since: the
        stopped worker's processes are all gone or zombies); None if NVML lists nothing here."""
        listed = self.gpus.processes()
        if listed is None:
            return None
        return [p for p in listed if p.pid in pids and not _running(p.pid)]

    async def gpu_summary(self) -> tuple[int, float]:
        """The GPU count and mean utilization, read off the loop: NVML calls may block."""
        return await asyncio.to_thread(self.gpus.utilization)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(held: list[GpuProcess]) -> str:
    return ", ".join(f"GPU {p.gpu}: pid {p.pid}" + (f" with {p.used_bytes / 2**20:.0f} MiB" if p.used_bytes else "")
                     for p in held)
