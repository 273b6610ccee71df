"""Test harness for the examples and the trainer library: TensorFlow workers launched by hand, without agents.

:class:`WorkerSet` starts N workers of one command with a hand-made ``TF_CONFIG`` on free ports (what an agent
would set, minus the agent), logs each to ``worker-RANK.log``, and reads the JSON summary line the examples
print last. :func:`run_alone` runs one worker without ``TF_CONFIG``. Waits are conditions with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster import ROOT, wait_for
from tests.ports import free_ports

EXAMPLES = ROOT / "examples"


def example(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / f"{name}.py"), *args]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what an agent or a previous worker would have set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFELASTIC_") and k != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def summaries(text: str) -> list[dict[str, Any]]:
    """The examples' JSON summary lines in ``text`` (their own output, or an agent log that prefixes them)."""
    found = []
    for line in text.splitlines():
        start = line.find('{"')
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "example" in record:
            found.append(record)
    return found


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        found = summaries(self.output())
        assert found, f"worker {self.rank} printed no summary:\n{self.output()[-3000:]}"
        return found[-1]


@dataclass
class WorkerSet:
    tmp: Path
    command: Sequence[str]
    size: int = 2  # 0: one worker alone, without TF_CONFIG
    env: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    def start(self, tag: str = "") -> WorkerSet:
        addresses = [f"127.0.0.1:{port}" for port in free_ports(self.size)]
        for rank in range(max(1, self.size)):
            cluster = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
            tf_config = {"TF_CONFIG": json.dumps(cluster)} if self.size else {}
            log_path = self.tmp / f"worker{tag}-{rank}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                        env=worker_env({**tf_config, **self.env}))
            self.workers.append(Worker(rank, proc, log_path))
        return self

    def wait(self, timeout: float = 240) -> list[int]:
        try:
            return [w.proc.wait(timeout) for w in self.workers]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"workers still running after {timeout}s:\n{self.logs()}") from None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(sig)

    def kill(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()

    def logs(self) -> str:
        return "\n".join(f"===== worker {w.rank}\n{w.output()[-4000:]}" for w in self.workers)

    def summaries(self) -> list[dict[str, Any]]:
        return [w.summary() for w in self.workers]


def run_alone(tmp: Path, command: Sequence[str], timeout: float = 240) -> tuple[int, str, dict[str, Any] | None]:
    """Runs one worker without TF_CONFIG; returns its exit code, output and last summary."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=worker_env())
    output = result.stdout + result.stderr
    found = summaries(result.stdout)
    return result.returncode, output, found[-1] if found else None


def run_script_report(script: str, cwd: Path, timeout: float = 240) -> dict[str, Any]:
    """Runs a Python ``script`` (a test's cases, TensorFlow kept out of pytest) in ``cwd`` as a trainer would run;
    returns the JSON report it prints last."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=worker_env(),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def wait_for_file(path: Path, timeout: float, workers: WorkerSet | None = None) -> None:
    """Waits for ``path`` to exist, failing early (with the logs) if a worker exits first."""
    def ready() -> bool:
        if workers is not None and any(w.proc.poll() is not None for w in workers.workers):
            raise AssertionError(f"a worker exited before {path} appeared:\n{workers.logs()}")
        return path.exists()

    wait_for(ready, timeout, str(path), interval=0.1)
