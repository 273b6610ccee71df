"""End-to-end recovery with a real TensorFlow trainer, set beside the floor.

    python -m bench.e2e_tf [--repeats 3]

* elastic: 2 agents run the demo trainer (MWMS + BackupAndRestore); SIGKILL rank 1's worker mid-training; time
  until the first training step of the next generation.
* floor: the same 2-worker cluster launched by hand (TF_CONFIG, no agents) from the same kind of checkpoint;
  time from launch to its first training step. No supervisor can beat this: it is TensorFlow's own start-up,
  restore and first step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from bench.common import read_events
from tests.cluster import TF_TRAINER, Cluster, members, wait_for

TRAINER = [*TF_TRAINER, "--epochs", "4", "--steps-per-epoch", "100", "--save-every", "10"]


def _first_step(events: Path, generation: int) -> float:
    def found() -> float | None:
        times = [e["time"] for e in read_events(events) if e["event"] == "first_step" and e["generation"] == generation]
        return times[0] if times else None

    result: float = wait_for(found, 120, f"the first step of generation {generation}", interval=0.01)
    return result


def elastic_once() -> float:
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), TRAINER, extra_args=["--log-level", "warning"])
        try:
            cluster.start("a")
            cluster.start("b")
            doc = cluster.wait_running(1, 2, timeout=120, step=60)
            killed_at = time.time()
            os.kill(members(doc)[1]["worker_pid"], signal.SIGKILL)
            return _first_step(cluster.events_path, 2) - killed_at
        finally:
            cluster.stop()


def _launch_by_hand(tmp: Path, generation: int) -> list[subprocess.Popen[bytes]]:
    ports = [free_port(), free_port()]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for rank in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}}),
                   TFELASTIC_BACKUP_DIR=str(tmp / "backup"), TFELASTIC_DEMO_EVENTS=str(tmp / "events.jsonl"),
                   TFELASTIC_RANK=str(rank), TFELASTIC_GENERATION=str(generation), TF_CPP_MIN_LOG_LEVEL="2",
                   TF_USE_LEGACY_KERAS="1")
        procs.append(subprocess.Popen(TRAINER, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def floor_once() -> float:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        first = _launch_by_hand(tmp, 1)
        wait_for(lambda: list((tmp / "backup").rglob("ckpt-*.index")), 120, "a checkpoint", interval=0.05)
        for p in first:
            p.kill()
            p.wait()
        launched = time.time()
        second = _launch_by_hand(tmp, 2)
        try:
            return _first_step(tmp / "events.jsonl", 2) - launched
        finally:
            for p in second:
                p.kill()
                p.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, Any] = {"elastic": [], "floor": []}
    for _ in range(args.repeats):
        results["elastic"].append(elastic_once())
        results["floor"].append(floor_once())
    elastic, floor = statistics.median(results["elastic"]), statistics.median(results["floor"])
    print("elastic, kill -> first step of the next generation:", " ".join(f"{s:.2f}" for s in results["elastic"]))
    print("floor, launch by hand -> first step:              ", " ".join(f"{s:.2f}" for s in results["floor"]))
    print(f"median elastic {elastic:.2f}s, median floor {floor:.2f}s, ratio {elastic / floor:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
