"""Shared pieces of the benchmarks: they reuse the test harness's Cluster to run real agents."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from tests.cluster import wait_for

BENCH = Path(__file__).resolve().parent
TRIVIAL = [sys.executable, str(BENCH / "trivial_trainer.py")]


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_generation_started(path: Path, generation: int, world: int, timeout: float = 60) -> list[dict[str, Any]]:
    """Every worker of ``generation`` has run its first line; returns their events."""
    def started() -> list[dict[str, Any]] | None:
        events = [e for e in read_events(path) if e["generation"] == generation]
        return events if len({e["rank"] for e in events}) == world else None

    result: list[dict[str, Any]] = wait_for(started, timeout, f"generation {generation} to start", interval=0.01)
    return result


def summary(name: str, samples: list[float], unit: str = "s") -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (f"{name}: n={len(samples)} median={statistics.median(samples):.3f}{unit} p95={p95:.3f}{unit} "
            f"min={ordered[0]:.3f}{unit} max={ordered[-1]:.3f}{unit}")
