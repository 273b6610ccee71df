"""Cost of a /metrics scrape (generate_latest) with the GPU collector, against FakeNvml for 1 and 8 GPUs.

    python -m bench.gpu_scrape [--scrapes 500]

Cold: every scrape misses the cache and makes the full round of NVML calls (cache_seconds=0). Warm: every scrape
reads the cache. "collect() only" leaves out prometheus_client's text formatting. FakeNvml answers from Python
memory, so the cold numbers are the collector's own overhead: on a real GPU each NVML call adds the driver's time,
which this machine (no GPU) cannot measure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from tfelastic.daemon.metrics.gpu import register_gpu_collector

from bench.common import summary
from tests.nvml_fake import FakeNvml


def scrape_times_us(gpus: int, cache_seconds: float, scrapes: int, text: bool) -> tuple[list[float], float]:
    """Microseconds per scrape (``text``: generate_latest, else the collector's collect() alone), and the NVML
    calls the scrapes made on average."""
    nvml = FakeNvml(gpus)
    registry = CollectorRegistry()
    collector = register_gpu_collector(registry, nvml=nvml, cache_seconds=cache_seconds)
    generate_latest(registry)  # NVML init and discovery are once per process, not per scrape
    calls_before = nvml.total_calls
    samples = []
    scrape: Callable[[], object] = (lambda: generate_latest(registry)) if text else (lambda: list(collector.collect()))
    for _ in range(scrapes):
        start = time.perf_counter_ns()
        scrape()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples, (nvml.total_calls - calls_before) / scrapes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scrapes", type=int, default=500)
    args = parser.parse_args()
    for gpus in (1, 8):
        for label, cache_seconds in (("cold", 0.0), ("warm", 3600.0)):
            for text, what in ((True, "generate_latest"), (False, "collect() only")):
                samples, calls = scrape_times_us(gpus, cache_seconds, args.scrapes, text)
                name = f"{gpus} GPU(s) {label} {what}"
                print(f"{summary(name, samples, 'us')} nvml_calls/scrape={calls:.0f}")


if __name__ == "__main__":
    main()
