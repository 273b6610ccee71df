"""What the node check costs (daemon/agent/nodecheck.py): each part timed on its own, on this machine.

    python -m bench.node_check [--runs 20]

* backup dir: create, write + fsync + remove a file, statvfs (on the local disk here; on NFS or Lustre it is a
  few round trips more);
* coordinator probe: a TCP connect to the node's listening worker port (loopback here; one RTT on a cluster);
* NVML health: through the named fake (no GPU here): the cost of tfelastic's own code around the NVML calls;
* matmul: the subprocess with TensorFlow's import, on the CPU (no GPU here; on a GPU node add CUDA's start-up).

The check runs before an agent's first Join and at re-admission, never on the recovery path.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable

from tfelastic.daemon.agent.nodecheck import NodeCheck, PortListener
from tfelastic.daemon.metrics.gpu import GpuCollector
from tfelastic.daemon.netutil import free_port

from bench.common import summary
from tests.nvml_fake import FakeNvml


def timed(action: Callable[[], object], runs: int) -> list[float]:
    """Milliseconds per call."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        times.append(1000 * (time.perf_counter() - started))
    return times


def probe_once(port: int) -> None:
    async def connect() -> None:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 3.0)
        writer.close()
        await writer.wait_closed()

    asyncio.run(connect())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as backup:
        check = NodeCheck(backup, "bench", min_free_bytes=1)
        print(summary("backup dir", timed(lambda: check.backup_dir_problems(), runs), unit="ms"))
    port = free_port()
    listener = PortListener()
    listener.open(port)
    print(summary("coordinator probe", timed(lambda: probe_once(port), runs), unit="ms"))
    listener.close()
    collector = GpuCollector(nvml=FakeNvml(8), cache_seconds=0.0)
    collector.health_problems()
    print(summary("NVML health, 8 fake GPUs", timed(collector.health_problems, runs), unit="ms"))
    matmul = NodeCheck("", "bench", matmul_devices="CPU")
    print(summary("matmul subprocess (CPU)", timed(matmul.matmul_problems, max(1, runs // 5)), unit="ms"))


if __name__ == "__main__":
    main()
