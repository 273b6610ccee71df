"""A live hang with default settings: how long until it is caught and the job trains again.

    python -m bench.hang_detection [--repeats 3]

2 agents with every setting at its default (so the stall limit is learned from the step times) run the demo
trainer (MultiWorkerMirroredStrategy, BackupAndRestore every 10 steps, about 0.1 s per step here); the last
rank wedges at step 200 in the first generation (alive, TensorFlow's heartbeats going on: only hang detection
catches it). Printed: from the wedge to the agent's stall verdict (the silence it logged, the limit it named and
where the trainer hung, from its Python stacks), and from the wedge to the first training step of the next
generation.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from bench.common import read_events
from tests.cluster import TF_TRAINER, Cluster, wait_for

TRAINER = [*TF_TRAINER, "--epochs", "4", "--steps-per-epoch", "100", "--save-every", "10", "--wedge-at-step", "200"]
STALLED = re.compile(r"trainer stalled: no progress for ([\d.]+)s \(([^)]*)\); (.*)$", re.MULTILINE)


def once() -> tuple[float, float, str, str]:
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), TRAINER)
        try:
            cluster.start("a")
            cluster.start("b")
            events = cluster.events_path

            def event(kind: str, generation: int) -> float | None:
                found = [e["time"] for e in read_events(events) if e["event"] == kind
                         and e.get("generation", 1) == generation]
                return found[0] if found else None

            wedged: float = wait_for(lambda: event("wedged", 1), 180, "the wedge", interval=0.05)
            resumed: float = wait_for(lambda: event("first_step", 2), 180, "generation 2's first step", interval=0.05)
            verdict = wait_for(lambda: STALLED.search(cluster.logs()), 10, "the stall verdict")
            return float(verdict.group(1)), resumed - wedged, verdict.group(2), verdict.group(3)
        finally:
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    silences, recoveries = [], []
    for _ in range(args.repeats):
        silence, recovery, limit, site = once()
        silences.append(silence)
        recoveries.append(recovery)
        print(f"silence at the verdict {silence:5.1f}s ({limit}); wedge -> first step of the next generation "
              f"{recovery:5.1f}s; {site}")
    print(f"median: verdict after {statistics.median(silences):.1f}s of silence, training again "
          f"{statistics.median(recoveries):.1f}s after the wedge (target: caught in <= 30 s; "
          "the old default stall_timeout was 300 s)")


if __name__ == "__main__":
    main()
