"""`tfelastic demo`: 2-3 real agents on localhost train a small model with MWMS + BackupAndRestore on the
CPU; the demo kills a worker mid-training and shows that the set restarts and resumes from the checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.netutil import free_port
from tfelastic.daemon.rendezvous.client import fetch_status
from tfelastic.daemon.status import status_to_json

EPOCHS, STEPS_PER_EPOCH, SAVE_EVERY = 4, 50, 10
TARGET_STEP = EPOCHS * STEPS_PER_EPOCH
DEADLINE_SECONDS = 240


@dataclass
class DemoResult:
    ok: bool
    nodes: int
    faults_injected: int
    restarts_total: int
    target_step: int
    final_step: int | None
    resumed_from_step: list[int] = field(default_factory=list)
    recovery_seconds: list[float] = field(default_factory=list)
    agent_exit_codes: list[int | None] = field(default_factory=list)
    workdir: str = ""
    problems: list[str] = field(default_factory=list)


def run_demo(nodes: int = 2, faults: int = 1, as_json: bool = False, workdir: str = "") -> int:
    base = Path(workdir or tempfile.mkdtemp(prefix="tfelastic-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda _text: None) if as_json else (lambda text: print(text, flush=True))
    result = _Demo(base, nodes, faults, say).run()
    if as_json:
        print(json.dumps(asdict(result)))
    else:
        _print_summary(result)
    return ExitCode.SUCCEEDED if result.ok else ExitCode.FAILED


class _Demo:
    def __init__(self, base: Path, nodes: int, faults: int, say: Any) -> None:
        self.base, self.nodes, self.faults, self.say = base, nodes, faults, say
        self.events = base / "events.jsonl"
        self.endpoint = Endpoint("127.0.0.1", free_port())
        # Spread the faults over training; each kills the worker of another rank, the chief included.
        self.kill_at = [TARGET_STEP * (i + 1) // (faults + 1) for i in range(faults)]

    def run(self) -> DemoResult:
        self.say(f"tfelastic demo: {self.nodes} agents on {self.endpoint}, {TARGET_STEP} steps, "
                 f"checkpoint every {SAVE_EVERY}, {self.faults} worker kill(s); logs in {self.base}")
        agents = [self._start_agent(i) for i in range(self.nodes)]
        kills: list[float] = []
        restarts = 0
        problems: list[str] = []
        deadline = time.monotonic() + DEADLINE_SECONDS
        try:
            while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
                doc = self._status()
                if doc is not None:
                    restarts = max(restarts, doc["restarts_total"])
                    if len(kills) < self.faults and self._maybe_kill(doc, len(kills)):
                        kills.append(time.time())
                time.sleep(0.1)
            if time.monotonic() >= deadline:
                problems.append(f"the job did not finish within {DEADLINE_SECONDS}s")
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.send_signal(signal.SIGTERM)
            for agent in agents:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(30)
        return self._result(agents, kills, restarts, problems)

    def _start_agent(self, index: int) -> subprocess.Popen[bytes]:
        trainer = [sys.executable, "-m", "tfelastic.trainer.demo_trainer", "--epochs", str(EPOCHS),
                   "--steps-per-epoch", str(STEPS_PER_EPOCH), "--save-every", str(SAVE_EVERY)]
        command = [sys.executable, "-m", "tfelastic.daemon", "run", "--job", "demo",
                   "--nodes", str(self.nodes), "--rendezvous", str(self.endpoint),
                   "--node-id", f"node-{index}", "--backup-dir", str(self.base / "backup"),
                   "--stall-timeout", "60", "--max-restarts", str(self.faults + 1), "--metrics-port", "0",
                   "--metrics-linger", "0", "--", *trainer]
        env = dict(os.environ, TFELASTIC_DEMO_EVENTS=str(self.events), TF_CPP_MIN_LOG_LEVEL="2")
        log = open(self.base / f"agent-{index}.log", "wb")  # noqa: SIM115 (the child keeps it)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.base)

    def _status(self) -> dict[str, Any] | None:
        try:
            return status_to_json(asyncio.run(fetch_status(self.endpoint, None, timeout=1.0)))
        except Exception:
            return None  # not up yet, or gone at the end

    def _maybe_kill(self, doc: dict[str, Any], fault: int) -> bool:
        if doc["state"] != "running" or doc["generation"] != fault + 1:
            return False
        ranked = sorted((n for n in doc["nodes"] if n["rank"] is not None), key=lambda n: n["rank"])
        if len(ranked) < 2 or any(n["step"] is None for n in ranked):
            return False
        if max(n["step"] for n in ranked) < self.kill_at[fault]:
            return False
        victim = ranked[(fault + 1) % len(ranked)]
        pid = victim["worker_pid"]
        if not pid or not _is_demo_trainer(pid):
            return False
        os.kill(pid, signal.SIGKILL)
        # status shows the last step the trainer reported; it may have trained and saved a few more since.
        self.say(f"  last reported step {victim['step']}: SIGKILL the worker of rank {victim['rank']} "
                 f"({victim['node_id']}, pid {pid})")
        return True

    def _result(self, agents: list[subprocess.Popen[bytes]], kills: list[float], restarts: int,
                problems: list[str]) -> DemoResult:
        events = _read_events(self.events)
        starts = [e for e in events if e["event"] == "start" and e["generation"] > 1]
        firsts = {e["generation"]: e["time"] for e in events if e["event"] == "first_step"}
        ends = [e for e in events if e["event"] == "end"]
        resumed = [int(e["initial_step"]) for e in starts]
        recovery = []
        for kill_time, start in zip(kills, starts, strict=False):
            if start["generation"] in firsts:
                recovery.append(round(firsts[start["generation"]] - kill_time, 2))
        final = int(ends[-1]["final_step"]) if ends else None
        codes = [a.poll() for a in agents]
        if any(code != 0 for code in codes):
            problems.append(f"agents exited with {codes}")
        if final != TARGET_STEP:
            problems.append(f"final step {final} is not the target {TARGET_STEP}")
        if len(kills) != self.faults:
            problems.append(f"injected {len(kills)} of {self.faults} faults")
        if len(resumed) < len(kills) or any(step <= 0 for step in resumed):
            problems.append(f"training did not resume from a checkpoint after every fault: {resumed}")
        return DemoResult(
            ok=not problems, nodes=self.nodes, faults_injected=len(kills), restarts_total=restarts,
            target_step=TARGET_STEP, final_step=final, resumed_from_step=resumed, recovery_seconds=recovery,
            agent_exit_codes=codes, workdir=str(self.base), problems=problems,
        )


def _print_summary(r: DemoResult) -> None:
    print()
    print(f"{'OK' if r.ok else 'FAILED'}: {r.nodes} nodes, {r.faults_injected} worker(s) killed, "
          f"{r.restarts_total} restart(s)")
    for i, step in enumerate(r.resumed_from_step):
        took = f" after {r.recovery_seconds[i]:.1f}s (kill to first step)" if i < len(r.recovery_seconds) else ""
        print(f"  restart {i + 1}: resumed from checkpoint at step {step}{took}")
    print(f"  final step {r.final_step} of {r.target_step}")
    for problem in r.problems:
        print(f"  problem: {problem}")
    print(f"  logs: {r.workdir}")


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _is_demo_trainer(pid: int) -> bool:
    try:
        return "tfelastic.trainer.demo_trainer" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
