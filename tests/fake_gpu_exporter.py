"""A /metrics target for the dashboard test on machines without a GPU: the real GPU collector over the FAKE
NVML of tests/nvml_fake.py (a fake for hardware we lack), served like an agent's. Prints its port.

    python -m tests.fake_gpu_exporter [GPUS]
"""

from __future__ import annotations

import sys
import threading

from prometheus_client import CollectorRegistry
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.metrics.gpu import register_gpu_collector
from tfelastic.daemon.metrics.http import serve_metrics

from tests.nvml_fake import FakeGpu, FakeNvml


def main() -> None:
    registry = CollectorRegistry()
    AgentMetrics(registry, "default", "fake-gpu-node")  # what an agent with these GPUs would export beside them
    gpus = [FakeGpu(clocks_event_reasons=0x1) for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2)]  # idle
    register_gpu_collector(registry, nvml=FakeNvml(gpus), cache_seconds=1)
    server = serve_metrics(registry, "127.0.0.1", 0, None)
    print(server.port, flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
