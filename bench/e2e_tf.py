"""End-to-end recovery with a real TensorFlow trainer, set beside the floor.

    python -m bench.e2e_tf [--repeats 3]

* elastic: 2 agents run the demo trainer (MWMS + BackupAndRestore); SIGKILL rank 1's worker mid-training; time
  until the first training step of the next generation. With warm start (the default) the kill comes once both
  agents' standby interpreters are ready (``tfelastic_standby_ready``); "cold" is the same with
  ``--warm-start off``.
* floor: the same 2-worker cluster launched by hand (TF_CONFIG, no agents) from the same kind of checkpoint;
  time from launch to its first training step. No supervisor can beat this: it is TensorFlow's own start-up,
  restore and first step.

    python -m bench.e2e_tf --drain [--repeats 3]

* drain: 2 agents (``--nodes 1:2``) run examples/keras_fit.py (``fit_callbacks()``: the graceful stop and the
  fast tier); SIGTERM to rank 1's agent, as ``systemctl stop`` sends; time until the survivor's first step of the
  next generation, and how long the survivor's agent took to stop its trainer (from the SIGTERM it sent to the
  last process gone), by the agent's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from bench.common import read_events
from tests.cluster import FORM_WITH_ALL, TF_TRAINER, Cluster, members, scrape, wait_for
from tests.workers import example

# 30 epochs: still training when both standbys are ready (they are built 10 s into a generation).
TRAINER = [*TF_TRAINER, "--epochs", "30", "--steps-per-epoch", "100", "--save-every", "10"]


def _first_step(events: Path, generation: int) -> float:
    def found() -> float | None:
        times = [e["time"] for e in read_events(events) if e["event"] == "first_step" and e["generation"] == generation]
        return times[0] if times else None

    result: float = wait_for(found, 120, f"the first step of generation {generation}", interval=0.01)
    return result


def _standby_ready(cluster: Cluster) -> bool:
    return all(scrape(f"http://{a.metrics_address()}/metrics")[1].get(("tfelastic_standby_ready", ())) == 1.0
               for a in cluster.agents)


def elastic_once(warm: bool, fixed_ports: bool = False) -> float:
    """``fixed_ports``: each agent gives its trainer the same port in every generation (``--worker-port``), as a
    site with firewall rules does."""
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), TRAINER,
                          extra_args=["--warm-start", "on" if warm else "off"])
        try:
            for node in ("a", "b"):
                cluster.start(node, extra=["--worker-port", str(free_port())] if fixed_ports else [])
            doc = cluster.wait_running(1, 2, timeout=120, step=60)
            if warm:
                wait_for(lambda: _standby_ready(cluster), 120, "both standby interpreters ready", interval=0.2)
                doc = cluster.wait_running(1, 2, timeout=120, step=60)
            killed_at = time.time()
            os.kill(members(doc)[1]["worker_pid"], signal.SIGKILL)
            return _first_step(cluster.events_path, 2) - killed_at
        finally:
            cluster.stop()


def drain_once() -> tuple[float, float, bool]:
    """Seconds from the SIGTERM to rank 1's agent to the survivor's first step of the next generation, the
    seconds the survivor's agent took to stop its trainer, and whether it ended the trainer's teardown."""
    with tempfile.TemporaryDirectory() as d:
        reached = Path(d) / "reached"
        trainer = example("keras_fit", "--epochs", "40", "--steps-per-epoch", "100", "--save-every", "50",
                          "--step-seconds", "0.02", "--reached-file", str(reached))
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), trainer, nodes="1:2",
                          extra_args=["--stop-grace", "120", *FORM_WITH_ALL])
        try:
            cluster.start_host("a")
            drained = cluster.start("b")
            wait_for(lambda: _standby_ready(cluster), 180, "both standby interpreters ready", interval=0.2)
            cluster.wait_running(1, 2, timeout=120, step=60)
            sent = time.monotonic()
            drained.proc.send_signal(signal.SIGTERM)
            times = Path(f"{reached}.2.times")
            first = wait_for(lambda: times.exists() and times.read_text().split("\n", 1)[0].split(), 300,
                             "the survivor's first step of generation 2", interval=0.02)
            log = cluster.agents[0].log()
            stopped = re.search(r"worker stopped in ([0-9.]+)s", log)
            assert stopped is not None, log
            return float(first[1]) - sent, float(stopped.group(1)), "SIGKILLed after it announced" in log
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
    parser.add_argument("--fixed-ports", action="store_true", help="also the warm case with a fixed --worker-port")
    parser.add_argument("--drain", action="store_true", help="only the drain case")
    args = parser.parse_args()
    if args.drain:
        drains = [drain_once() for _ in range(args.repeats)]
        print("drain, SIGTERM to an agent -> the survivor's first step:", _row([d[0] for d in drains]))
        print("  of which the survivor's trainer stopping:             ", _row([d[1] for d in drains]))
        print(f"median {statistics.median(d[0] for d in drains):.2f}s, the stop "
              f"{statistics.median(d[1] for d in drains):.2f}s; the teardown cut short in "
              f"{sum(d[2] for d in drains)} of {len(drains)}")
        return
    results: dict[str, list[float]] = {"warm": [], "cold": [], "floor": [], "fixed": []}
    for _ in range(args.repeats):
        results["warm"].append(elastic_once(warm=True))
        if args.fixed_ports:
            results["fixed"].append(elastic_once(warm=True, fixed_ports=True))
        results["cold"].append(elastic_once(warm=False))
        results["floor"].append(floor_once())
    warm, cold, floor = (statistics.median(results[k]) for k in ("warm", "cold", "floor"))
    print("elastic, warm start, kill -> first step of the next generation:", _row(results["warm"]))
    if args.fixed_ports:
        print("elastic, warm start, a fixed --worker-port per agent:          ", _row(results["fixed"]))
    print("elastic, --warm-start off:                                     ", _row(results["cold"]))
    print("floor, launch by hand -> first step:                           ", _row(results["floor"]))
    print(f"median warm {warm:.2f}s, cold {cold:.2f}s, floor {floor:.2f}s; ratio warm/floor {warm / floor:.3f} "
          f"(target <= 0.6), cold/floor {cold / floor:.3f}")
    if args.fixed_ports:
        fixed = statistics.median(results["fixed"])
        print(f"median with a fixed port {fixed:.2f}s; ratio fixed/floor {fixed / floor:.3f}")


def _row(samples: list[float]) -> str:
    return " ".join(f"{s:.2f}" for s in samples)


if __name__ == "__main__":
    main()
