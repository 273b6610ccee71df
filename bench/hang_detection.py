"""A live hang with default settings: how long until it is caught and the job trains again.

    python -m bench.hang_detection [--repeats 3]

2 agents with every setting at its default (so the stall limit is learned from the step times) run the demo
trainer (MultiWorkerMirroredStrategy, BackupAndRestore every 10 steps, about 0.03 s per step here); the last
rank wedges at step 1200 in the first generation (alive, TensorFlow's heartbeats going on: only hang detection
catches it). Printed, from the restart's record (the report the coordinator took first): the silence at the
verdict, the limit it named, whose report it was (the wedged rank's, or the other's, which waits for it in a
collective) and where that trainer hung, from its Python stacks; and from the wedge to the next generation's start
and to its first training step. Target: the next generation within 10 s of the wedge (median).

    python -m bench.hang_detection --varying-steps

The false-verdict run: the same 2 agents and defaults, no wedge, step times that vary five-fold (0.7 s of extra
time per step, 3.5 s every 25th step: the hang watch's warm-up sees only the fast ones), two epochs of 60 steps
with a save every 10. Printed: the stall limit each agent learned (the highest its gauge showed), the stall
verdicts and restarts (target: none).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import tempfile
import time
from pathlib import Path

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from bench.common import read_events
from tests.cluster import TF_TRAINER, Cluster, members, scrape, wait_for

# The wedge comes about 30 s into training, once the standby for the next generation is ready (it is built 10 s
# after the first progress report on a node of fewer than 4 cores and imports for about 9 s here): a hang sooner
# than that relaunches cold, about 10 s later than warm here.
TRAINER = [*TF_TRAINER, "--epochs", "4", "--steps-per-epoch", "500", "--save-every", "10", "--wedge-at-step", "1200"]
STALL_ALLOWANCE = 300.0  # the limit before the learned one applies (start-up, saves)
STALLED = re.compile(r"trainer stalled: no progress for ([\d.]+)s \(([^)]*)\); (.*)$", re.MULTILINE)
RECORDED = re.compile(r"^stalled: (\S+): no progress for ([\d.]+)s \(([^)]*)\); (.*)$")


VARYING = [*TF_TRAINER, "--epochs", "2", "--steps-per-epoch", "60", "--save-every", "10", "--step-seconds", "0.7",
           "--slow-every", "25", "--slow-step-seconds", "3.5"]


def once() -> tuple[float, float, float, str, str]:
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

            wedged_node = members(cluster.wait_running(1, 2, timeout=180))[-1]["node_id"]  # the demo's: the last rank
            wedged: float = wait_for(lambda: event("wedged", 1), 180, "the wedge", interval=0.05)
            started: float = wait_for(lambda: event("start", 2), 180, "generation 2's start", interval=0.05)
            resumed: float = wait_for(lambda: event("first_step", 2), 180, "generation 2's first step", interval=0.05)
            # The restart's record (the first report the coordinator took), not the first verdict in the logs:
            # the rank that waited for the wedged one in a collective logs its own verdict too.
            ended = cluster.wait_status(lambda d: d["generation"] >= 2, 10, "the restart")["last_restart"]["ended"]
            verdict = RECORDED.search(ended)
            assert verdict is not None, ended
            site = f"recorded as {verdict.group(1)}'s (the wedged rank's: {verdict.group(1) == wedged_node}): " \
                   f"{verdict.group(4)}"
            return float(verdict.group(2)), started - wedged, resumed - wedged, verdict.group(3), site
        finally:
            cluster.stop()


def varying_steps() -> None:
    """No wedge: every stall verdict is a false one."""
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), VARYING)
        try:
            agents = [cluster.start("a"), cluster.start("b")]
            urls = [f"http://{agent.metrics_address()}/metrics" for agent in agents]
            learned = [0.0, 0.0]
            while any(agent.proc.poll() is None for agent in agents):
                for i, url in enumerate(urls):
                    with contextlib.suppress(OSError):
                        limit = scrape(url)[1].get(("tfelastic_stall_limit_seconds", ()), 0.0)
                        learned[i] = max(learned[i], limit if limit < STALL_ALLOWANCE else 0.0)
                time.sleep(0.5)
            logs = cluster.logs()
            generations = {e["generation"] for e in read_events(cluster.events_path) if e["event"] == "start"}
        finally:
            cluster.stop()
    print(f"step times 0.7 s + compute, every 25th 3.5 s; learned stall limits {learned[0]:.1f}s and "
          f"{learned[1]:.1f}s (the allowance's 300 s left out); stall verdicts: {len(STALLED.findall(logs))}; "
          f"generations: {sorted(generations)} (target: no verdict, one generation)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--varying-steps", action="store_true", help="the false-verdict run (above)")
    args = parser.parse_args()
    if args.varying_steps:
        varying_steps()
        return
    silences, launches, recoveries = [], [], []
    for _ in range(args.repeats):
        silence, launch, recovery, limit, site = once()
        silences.append(silence)
        launches.append(launch)
        recoveries.append(recovery)
        print(f"silence at the verdict {silence:5.1f}s ({limit}); wedge -> the next generation's start "
              f"{launch:5.1f}s, its first step {recovery:5.1f}s; {site}")
    print(f"median: verdict after {statistics.median(silences):.1f}s of silence, the next generation "
          f"{statistics.median(launches):.1f}s after the wedge (target: <= 10 s), training again "
          f"{statistics.median(recoveries):.1f}s after it")


if __name__ == "__main__":
    main()
