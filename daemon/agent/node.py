"""This node as the agent's shell reaches it: the host and GPU metrics, the GPU summary that reports carry, the
node check (off the loop, bounded, one at a time), the listener for the coordinator's probe, and the snapshot
steps this node can restore. I/O only: the core decides when each is needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.nodecheck import MATMUL_TIMEOUT_SECONDS, NodeCheck, PortListener
from tfelastic.daemon.agent.snapshot_scan import SnapshotScan
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.metrics.gpu import register_gpu_collector, visible_gpus
from tfelastic.daemon.metrics.host import register_host_collector
from tfelastic.daemon.netutil import port_taken

log = logging.getLogger("tfelastic.agent")

NODE_CHECK_SECONDS = MATMUL_TIMEOUT_SECONDS + 30.0  # the matmul's own bound, and the rest of the check
# A killed trainer's port is free once all its threads have exited: a few hundred ms for a few GB to unmap, more
# for a host-memory-heavy model; past this the Join goes out anyway and the trainer's bind error says the rest.
PORT_FREE_SECONDS = 30.0


class Node:
    def __init__(self, config: AgentConfig, registry: CollectorRegistry, trainer_env: dict[str, str],
                 live_pid: Callable[[], int | None]) -> None:
        backup_dir = config.resolved_backup_dir()
        register_host_collector(registry, live_pid, backup_dir)
        # The trainer's GPUs, not the node's: CUDA_VISIBLE_DEVICES as the trainer will see it.
        self.gpus = register_gpu_collector(registry, visible=visible_gpus(trainer_env.get("CUDA_VISIBLE_DEVICES")))
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

    async def gpu_summary(self) -> tuple[int, float]:
        """The GPU count and mean utilization, read off the loop: NVML calls may block."""
        return await asyncio.to_thread(self.gpus.utilization)
