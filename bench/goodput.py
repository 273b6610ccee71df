"""Goodput under faults: a fixed number of steps of the keras_fit example, side by side with what users run
without us.

    python -m bench.goodput [--steps 6000] [--schedules minute,mixed] [--ledger-only]

Two workers (MultiWorkerMirroredStrategy on localhost) train the keras_fit CNN for ``--steps`` steps; (a) with
fit_callbacks' defaults (the fast tier, its interval adapted to a 1 % budget), (b) and (c) with a checkpoint every
100 steps. Goodput = the fault-free run's time (launched by hand: TensorFlow alone) / the run's
time, from the launch until every worker has exited 0 after the last step, evaluation and export included.

Variants:
  (a) tfelastic, default settings (warm start, learned hang detection, the fast checkpoint tier)
  (b) tfelastic with --warm-start off and the fast checkpoint tier off (the example's --fast-tier off: tf_keras'
      BackupAndRestore every 100 steps)
  (c) without us: the same MWMS script with only tf_keras' BackupAndRestore(save_freq=100), and a loop that
      relaunches every worker (fresh ports) when one exits, until all exit 0: what a shell loop does

Schedules (seconds from the launch; a fault falls wherever the job is then):
  minute  a worker SIGKILLed every 60 s
  mixed   a worker SIGKILLed at 30 s, a live hang at 60 s (SIGUSR1 to a worker: a handler installed by this
          bench's sitecustomize sleeps forever in the main thread, while TensorFlow's own threads run on), and at
          90 s an agent SIGKILLed and restarted 1 s later as systemd would; for (c), which has no agent, a
          worker SIGKILL stands in for the node's loss
The job's own goodput ledger (docs/goodput.md) is printed beside (a) and (b): its training / wall from the first
formation to the end, next to the same ratio measured from outside, "training goodput": the fault-free run's
training time (from its first step's end to its last step's, by hand, the example's own clock) over the run's time
from its first generation's launch to the job's verdict (the agents' log lines). A second outside measure takes
the fault-free training time from the run itself, so that the machine's drift between runs cancels: the
seconds the example's chief spent on new steps (past the furthest any earlier chief reached, each from the
previous step's end, a generation's first step left out), by its own clock, over the same window.
A run that is not done ``--cap`` seconds after the fault-free time is stopped and reported as stalled (the
loop of (c) has no hang detection: a live hang stalls it for good). Both variants (a) and (b) get
--max-restarts 10 so that the budget, which is not what is measured, does not end a run. ``--ledger-only`` runs
(a) and (b) alone and prints their ledgers beside the trainer's own clock (no fault-free runs, no (c)): the
ledger's check in a third of the time. Traffic stays on loopback; every loop is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port, free_ports

from bench.ledger_check import fresh_step_seconds, redone_from
from tests.cluster import ROOT, Cluster, members

EXAMPLE = str(ROOT / "examples" / "keras_fit.py")
SCHEDULES: dict[str, list[tuple[float, str]]] = {
    "minute": [(60.0 * i, "worker_kill") for i in range(1, 20)],
    "mixed": [(30.0, "worker_kill"), (60.0, "hang"), (90.0, "agent_kill")],
}
HANG_HOOK = """\
import signal, time


def _hang(signum, frame):  # a live hang: the main thread stops, TensorFlow's threads run on
    while True:
        time.sleep(3600)


signal.signal(signal.SIGUSR1, _hang)
"""


def example_args(steps: int, plain: bool = False, fast_tier: bool = True, reached: Path | None = None) -> list[str]:
    epochs = max(1, steps // 1000)
    saving = ["--save-every", "auto"] if fast_tier and not plain else ["--save-every", "100", "--fast-tier", "off"]
    return [EXAMPLE, "--epochs", str(epochs), "--steps-per-epoch", str(steps // epochs), *saving,
            *(["--plain-keras"] if plain else []), *(["--reached-file", str(reached)] if reached else [])]


def chief_starts(reached: Path) -> list[tuple[int, int]]:
    """(generation, the step its chief resumed at), from the example's --reached-file."""
    return [(int(g), int(s)) for g, s in (line.split() for line in reached.read_text().splitlines())] \
        if reached.exists() else []


def trainer_redone(reached: Path) -> int:
    """The example's own count of the steps its chiefs redid (its --reached-file)."""
    return redone_from(chief_starts(reached), lambda generation: Path(f"{reached}.{generation}"))


def trainer_fresh(reached: Path) -> float:
    """The seconds the chiefs spent on new steps, by the example's own clock (FILE.GENERATION.times)."""
    return fresh_step_seconds(chief_starts(reached), lambda generation: Path(f"{reached}.{generation}.times"))


@dataclass
class Run:
    seconds: float
    finished: bool
    faults: list[str] = field(default_factory=list)
    ledger: dict[str, Any] | None = None  # status's goodput object at the end (a job with us)
    window: float | None = None  # from the first generation's launch to the verdict, from the agents' logs
    trainer_redone: int | None = None  # the chiefs' own count of the steps they redid (a job with us)
    trainer_fresh: float | None = None  # the seconds the chiefs spent on new steps, by their own clock


@dataclass
class Reference:
    seconds: float  # the fault-free run by hand, launch to exit
    train_seconds: float  # its training: the chief's first step's end to its last step's


LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d{3}) ")


def log_time(line: str) -> float:
    found = LOG_TIME.match(line)
    assert found, line
    hours, minutes, seconds = found.groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def launch_to_verdict(logs: str) -> float | None:
    """Seconds from generation 1's first launch to the job's verdict, as the agents logged them."""
    lines = logs.splitlines()
    launched = [log_time(line) for line in lines if "generation 1: started worker" in line]
    verdict = [log_time(line) for line in lines if "tfelastic.agent: job succeeded" in line]
    if not launched or not verdict:
        return None
    return (max(verdict) - min(launched)) % 86400  # a run across midnight


class FaultClock:
    """Injects a schedule's faults at their times from the start; bounded by the schedule's length."""

    def __init__(self, schedule: list[tuple[float, str]], inject: Callable[[str], str | None]) -> None:
        self._pending = list(schedule)
        self._inject = inject
        self.start = time.monotonic()
        self.done: list[str] = []

    def tick(self) -> None:
        while self._pending and time.monotonic() - self.start >= self._pending[0][0]:
            at, kind = self._pending.pop(0)
            with contextlib.suppress(Exception):  # a fault that finds nothing to hit (between generations) is skipped
                what = self._inject(kind)
                if what:
                    self.done.append(f"{at:.0f}s {what}")


def hook_env(tmp: Path) -> dict[str, str]:
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HANG_HOOK)
    return {"PYTHONPATH": str(hook), "TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1"}


# ---------------------------------------------------------------------------------------- (c) without us


def _launch_by_hand(tmp: Path, steps: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    procs = []
    for rank in range(2):
        tf_config = json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})
        procs.append(subprocess.Popen(
            [sys.executable, *example_args(steps, plain=True), "--backup-dir", str(tmp / "backup"),
             "--summary-file", str(tmp / "summary.jsonl")],
            env=dict(os.environ, **env, TF_CONFIG=tf_config), cwd=tmp, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True))
    return procs


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def without_us(steps: int, schedule: list[tuple[float, str]], cap: float,
               summaries: list[dict[str, Any]] | None = None) -> Run:
    """The relaunch loop: start both workers; when one exits non-zero, kill all and start again."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = hook_env(tmp)
        procs = _launch_by_hand(tmp, steps, env)
        victim = [0]

        def inject(kind: str) -> str:
            victim[0] ^= 1
            target = procs[victim[0]]
            os.kill(target.pid, signal.SIGUSR1 if kind == "hang" else signal.SIGKILL)
            return f"{'hang' if kind == 'hang' else 'worker SIGKILL'} of rank {victim[0]}"

        faults = FaultClock(schedule, inject)
        try:
            while time.monotonic() - faults.start < cap:
                faults.tick()
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    if summaries is not None and (tmp / "summary.jsonl").exists():
                        summaries += [json.loads(line) for line in (tmp / "summary.jsonl").read_text().splitlines()]
                    return Run(time.monotonic() - faults.start, True, faults.done)
                if any(c not in (None, 0) for c in codes):
                    _kill_all(procs)
                    procs[:] = _launch_by_hand(tmp, steps, env)
                time.sleep(0.05)
            return Run(time.monotonic() - faults.start, False, faults.done)
        finally:
            _kill_all(procs)


# ---------------------------------------------------------------------------------------------- (a), (b)


def with_us(steps: int, schedule: list[tuple[float, str]], cap: float, defaults: bool) -> Run:
    """``defaults``: warm start and the fast tier on (a); both off (b)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        reached = tmp / "reached"
        cluster = Cluster(tmp, Endpoint("127.0.0.1", free_port()),
                          [sys.executable, *example_args(steps, fast_tier=defaults, reached=reached)],
                          extra_args=["--max-restarts", "10", "--warm-start", "on" if defaults else "off"],
                          env=dict(hook_env(tmp)))
        victim = [0]

        def inject(kind: str) -> str | None:
            doc = cluster.status()
            if kind == "agent_kill":
                agent = cluster.agents[1]
                agent.proc.kill()
                agent.proc.wait()
                time.sleep(1.0)  # systemd's RestartSec
                cluster.agents.remove(agent)
                cluster.start(agent.node_id)
                return f"agent {agent.node_id} SIGKILLed and restarted"
            workers = members(doc) if doc else []
            if len(workers) < 2 or any(w["worker_pid"] is None for w in workers):
                return None
            victim[0] ^= 1
            os.kill(workers[victim[0]]["worker_pid"], signal.SIGUSR1 if kind == "hang" else signal.SIGKILL)
            return f"{'hang' if kind == 'hang' else 'worker SIGKILL'} of rank {victim[0]}"

        faults = FaultClock(schedule, inject)
        cluster.start_host("a", timeout=60)
        cluster.start("b")
        ledger: dict[str, Any] | None = None
        polled = 0.0
        try:
            while time.monotonic() - faults.start < cap:
                faults.tick()
                if time.monotonic() - polled >= 0.5:  # the ledger as the coordinator last told it
                    polled = time.monotonic()
                    doc = cluster.status()
                    ledger = doc["goodput"] if doc is not None and doc.get("goodput") else ledger
                if all(a.proc.poll() is not None for a in cluster.agents):
                    finished = all(a.proc.returncode == 0 for a in cluster.agents)
                    return Run(time.monotonic() - faults.start, finished, faults.done, ledger,
                               launch_to_verdict(cluster.logs()), trainer_redone(reached), trainer_fresh(reached))
                time.sleep(0.05)
            return Run(time.monotonic() - faults.start, False, faults.done)
        finally:
            cluster.stop()


def fault_free(steps: int) -> Reference:
    summaries: list[dict[str, Any]] = []
    run = without_us(steps, [], cap=3600, summaries=summaries)
    assert run.finished, "the fault-free run did not finish"
    [chief] = [s for s in summaries if s["rank"] == 0 and not s["preempted"]]
    return Reference(run.seconds, chief["train_seconds"])


def ledger_line(run: Run, reference: Reference) -> str:
    """The ledger's goodput beside the same ratio measured from outside."""
    if run.ledger is None or run.ledger.get("ratio") is None or run.window is None:
        return "no ledger read"
    outside = reference.train_seconds / run.window
    ledger = run.ledger["ratio"]
    top = ", ".join(f"{b['category']} {100 * b['share']:.1f}%" for b in run.ledger["badput"][:4])
    own = f"{run.trainer_fresh / run.window:.3f} ({100 * (ledger - run.trainer_fresh / run.window):+.1f} pp)" \
        if run.trainer_fresh is not None else "-"
    return (f"ledger goodput {ledger:.3f} vs training goodput from outside {outside:.3f} "
            f"({100 * (ledger - outside):+.1f} pp), by the trainer's own step clock {own}; ledger's badput: {top}\n"
            f"      steps redone: report {run.ledger.get('steps_redone')}, "
            f"the trainer's own count {run.trainer_redone}")


def check_ledgers(name: str, schedule: list[tuple[float, str]], steps: int) -> None:
    """(a) and (b) under ``schedule``, each ledger beside the trainer's own clock; each capped at 15 minutes."""
    for label, defaults in (("(a) tfelastic defaults", True), ("(b) tfelastic, warm start and fast tier off", False)):
        run = with_us(steps, schedule, 900.0, defaults=defaults)
        if run.ledger is None or run.window is None or run.trainer_fresh is None:
            print(f"schedule {name} {label}: no ledger read (finished: {run.finished})", flush=True)
            continue
        ledger, own = run.ledger["ratio"], run.trainer_fresh / run.window
        print(f"schedule {name} {label}: {run.seconds:.1f}s; ledger goodput {ledger:.3f}, by the trainer's own "
              f"step clock {own:.3f} ({100 * (ledger - own):+.1f} pp); steps redone: report "
              f"{run.ledger.get('steps_redone')}, the trainer's own count {run.trainer_redone}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--schedules", default="minute,mixed")
    parser.add_argument("--cap", type=float, default=150.0, help="seconds past the fault-free time")
    parser.add_argument("--ledger-only", action="store_true", help="(a) and (b) only, their ledgers beside the "
                        "trainer's own clock")
    args = parser.parse_args()
    for name in args.schedules.split(","):
        schedule = SCHEDULES[name]
        if args.ledger_only:
            check_ledgers(name, schedule, args.steps)
            continue
        # This machine's speed drifts by up to 1.5x over minutes: the fault-free time is measured before and
        # after the variants, and their mean is the reference.
        before = fault_free(args.steps)
        cap = before.seconds + args.cap
        runs = {"(a) tfelastic defaults": with_us(args.steps, schedule, cap, defaults=True),
                "(b) tfelastic, warm start and fast tier off": with_us(args.steps, schedule, cap, defaults=False),
                "(c) MWMS + BackupAndRestore(100) + relaunch loop": without_us(args.steps, schedule, cap)}
        after = fault_free(args.steps)
        reference = (before.seconds + after.seconds) / 2
        training = Reference(reference, (before.train_seconds + after.train_seconds) / 2)
        print(f"schedule {name}: fault-free by hand {before.seconds:.1f}s before, {after.seconds:.1f}s after "
              f"({args.steps} steps; training {before.train_seconds:.1f}s and {after.train_seconds:.1f}s of them)",
              flush=True)
        for label, run in runs.items():
            verdict = (f"{run.seconds:6.1f}s  goodput {reference / run.seconds:.3f}" if run.finished
                       else f"stalled: not done after {run.seconds:.0f}s (goodput < {reference / run.seconds:.3f})")
            print(f"  {label:50s} {verdict}   faults: {'; '.join(run.faults)}", flush=True)
            if label.startswith(("(a)", "(b)")) and run.finished:
                print(f"      {ledger_line(run, training)}", flush=True)
        a, c = runs["(a) tfelastic defaults"], runs["(c) MWMS + BackupAndRestore(100) + relaunch loop"]
        print(f"  (a)/(c) goodput ratio: {c.seconds / a.seconds:.2f}{'' if c.finished else ' (at least)'}",
              flush=True)


if __name__ == "__main__":
    main()
