"""What a failure of a mirrored job costs with the survivors' save (trainer/survivors.py), and without it.

    python -m bench.survivors [--kills 10] [--node-losses 5] [--survivors-save on|off]

* kills: 2 agents run examples/keras_fit.py (``fit_callbacks()``, a snapshot every 20 steps); each kill SIGKILLs
  the trainer of a random rank at a random moment; a node loss SIGKILLs that rank's agent with its trainer (its
  agent is started again for the next generation). Per failure: the steps the next generation redid (from the
  coordinator's ledger, which counts from the furthest step any trainer marked), where it restored from (the
  survivors' step or a snapshot) and the time from the kill to the next generation's first step.

    python -m bench.survivors --state [--kills 10] [--width 5800]

* state: tests/trainers/survivor.py, 2 workers without agents, a model of ``--width`` (5800: about 420 MB of
  weights and Adam slots), rank 0 SIGKILLed at a random moment of a step: whether rank 1 saved the step it held,
  how long the save took, and whether a new process restores it bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from tests.cluster import FORM_WITH_ALL, ROOT, Cluster, members, wait_for
from tests.workers import WorkerSet, example, worker_env

SAVE_EVERY = 20


def _ledger(cluster: Cluster) -> list[dict[str, Any]]:
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--json", "--rendezvous",
                             str(cluster.endpoint)], capture_output=True, text=True, timeout=60, check=True)
    generations: list[dict[str, Any]] = json.loads(result.stdout)["generations"]
    return generations


def _first_step_after(times: Path, timeout: float = 300) -> float:
    """The monotonic time the chief's first step of a generation ended (keras_fit's --reached-file)."""
    line = wait_for(lambda: times.exists() and times.read_text().split("\n", 1)[0].split(), timeout,
                    f"a first step in {times}", interval=0.02)
    return float(line[1])


def failures(kills: int, node_losses: int, survivors_save: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    kinds = ["kill"] * kills + ["node"] * node_losses
    rng.shuffle(kinds)
    with tempfile.TemporaryDirectory() as d:
        reached = Path(d) / "reached"
        trainer = example("keras_fit", "--epochs", "100", "--steps-per-epoch", "100", "--save-every", str(SAVE_EVERY),
                          "--step-seconds", "0.05", "--reached-file", str(reached), "--survivors-save",
                          survivors_save)
        cluster = Cluster(Path(d), Endpoint("127.0.0.1", free_port()), trainer, nodes="2",
                          extra_args=["--max-restarts", "100", *FORM_WITH_ALL])
        results: list[dict[str, Any]] = []
        try:
            cluster.start_host("a")
            cluster.start("b")
            for generation, kind in enumerate(kinds, start=1):
                doc = cluster.wait_running(generation, 2, timeout=180, step=1)
                steps_file = Path(f"{reached}.{generation}.times")
                wait_for(steps_file.exists, 180, "the chief's steps")
                time.sleep(rng.uniform(1.0, 3.0))  # a random moment, some steps in
                # A node loss takes node b (node a's agent hosts the coordinator); a kill either rank.
                rank = rng.randrange(2) if kind == "kill" else \
                    next(i for i, m in enumerate(members(doc)) if m["node_id"] == "b")
                victim = members(doc)[rank]
                killed_at = time.monotonic()
                if kind == "kill":
                    os.kill(victim["worker_pid"], signal.SIGKILL)
                else:
                    agent = [a for a in cluster.agents if a.node_id == victim["node_id"]][-1]
                    agent.proc.kill()
                    os.kill(victim["worker_pid"], signal.SIGKILL)
                    agent.proc.wait()
                    cluster.start(victim["node_id"])
                first = _first_step_after(Path(f"{reached}.{generation + 1}.times"))
                results.append({"kind": kind, "rank": rank, "recovery": first - killed_at})
            cluster.wait_running(len(kinds) + 1, 2, timeout=180, step=1)
            lines = _ledger(cluster)
            log = cluster.logs()
            stops = [float(x) for x in re.findall(r"worker stopped in ([0-9.]+)s \((?:worker_exit|node_lost)\)", log)]
            for result, line in zip(results, lines[1:], strict=False):
                result["redone"] = line["steps_redone"]
                result["restored"] = line["restored_step"]
                result["survivor_stop"] = max(stops.pop(0), stops.pop(0)) if len(stops) >= 2 else None
                result["from"] = "survivors" if re.search(
                    rf"failed; it saves step {line['restored_step']},", log) else "snapshot"
        finally:
            cluster.stop()
        return results


def state_once(width: int, seed: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        command = [sys.executable, str(ROOT / "tests" / "trainers" / "survivor.py"), "train", "loop",
                   str(tmp / "store"), str(seed), str(tmp / "chain.jsonl")]
        workers = WorkerSet(tmp, command, env={"SURVIVOR_WIDTH": str(width)}).start()
        workers.wait(600)
        lines = [json.loads(line) for line in (tmp / "chain.jsonl").read_text().splitlines()]
        held = max(line["step"] for line in lines if "step" in line)
        chain = {line["step"]: line["checksum"] for line in lines if "step" in line}
        saved = lines[-1].get("survivors", [])
        out = {"held": held, "saved": bool(saved), "save_seconds": None, "exact": None}
        match = re.search(r"for the next generation to \S+ \(([0-9.]+)s\)", workers.workers[1].output())
        if match:
            out["save_seconds"] = float(match.group(1))
        if saved:
            back = subprocess.run([sys.executable, command[1], "restore", "loop", str(tmp / "store")],
                                  capture_output=True, text=True, timeout=600, cwd=tmp,
                                  env=worker_env({"SURVIVOR_WIDTH": str(width)}))
            report = json.loads(back.stdout.splitlines()[-1])
            out["exact"] = report["step"] == held and report["checksum"] == chain[held]
        return out


def _row(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}s, max {max(values):.2f}s" if values else "none"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--node-losses", type=int, default=5)
    parser.add_argument("--survivors-save", choices=["on", "off"], default="on")
    parser.add_argument("--state", action="store_true", help="the survivor's save of a large state, alone")
    parser.add_argument("--width", type=int, default=5800)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.state:
        rng = random.Random(args.seed)
        runs = [state_once(args.width, rng.uniform(6.0, 20.0)) for _ in range(args.kills)]
        for run in runs:
            print(json.dumps(run))
        saves = [r["save_seconds"] for r in runs if r["save_seconds"] is not None]
        print(f"width {args.width}: saved {sum(r['saved'] for r in runs)} of {len(runs)}, restored bit for bit "
              f"{sum(bool(r['exact']) for r in runs)}; the save {_row(saves)}")
        return
    results = failures(args.kills, args.node_losses, args.survivors_save, args.seed)
    for result in results:
        print(json.dumps(result))
    for kind in ("kill", "node"):
        mine = [r for r in results if r["kind"] == kind]
        if not mine:
            continue
        redone = [r.get("redone", -1) for r in mine]
        print(f"{kind} ({len(mine)}), survivors' save {args.survivors_save}: steps redone {redone} (max "
              f"{max(redone)}), from the survivors' step {sum(r.get('from') == 'survivors' for r in mine)}; kill -> "
              f"next first step {_row([r['recovery'] for r in mine])}")


if __name__ == "__main__":
    main()
