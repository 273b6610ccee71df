"""What tfelastic costs inside the trainer: steps/s of examples/keras_fit.py with and without tfelastic.

Three variants, each launched the same way (one worker, the same flags and environment, a live progress socket
read by this process, as an agent would), alternating so that drift on the machine hits all of them alike:

- ``plain``: ``--plain-keras``: tf_keras' own BackupAndRestore only (the baseline);
- ``callbacks``: ``tfelastic.trainer.fit_callbacks`` (BackupAndRestore, progress reports, graceful stop);
- ``instrumented``: ``--plain-keras`` plus the automatic instrumentation the agent injects for unmodified
  scripts (the progress callback added to ``model.fit`` through sitecustomize).

steps/s = optimizer steps / the time ``model.fit`` took (from the example's JSON summary). The ratio is a
variant's median over the baseline's median. Target: >= 0.99.

    .venv/bin/python -m bench.trainer_overhead [--rounds 5] [--steps 600]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tfelastic.daemon.worker.instrument import instrumentation_env

from tests.workers import example, summaries, worker_env

VARIANTS = ("plain", "callbacks", "instrumented")


class ProgressSink:
    """A datagram socket like the agent's, counting the reports it receives."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.received = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            self._sock.recv(4096)
            self.received += 1


def run_once(variant: str, steps: int, work: Path, sink: ProgressSink) -> tuple[float, int]:
    """(steps/s, progress reports received) of one run."""
    backup = tempfile.mkdtemp(dir=work)
    flags = ["--epochs", "1", "--steps-per-epoch", str(steps), "--save-every", "100", "--backup-dir", backup]
    if variant != "callbacks":
        flags.append("--plain-keras")
    # Fixed thread pools: with TensorFlow's defaults, runs of the same variant here differ by up to 2x.
    env = worker_env({"TFELASTIC_PROGRESS_SOCKET": sink.path, "TFELASTIC_GENERATION": "0",
                      "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "2"})
    env.update(instrumentation_env(env, instrument=variant == "instrumented"))
    before = sink.received
    result = subprocess.run(example("keras_fit", *flags), env=env, cwd=work, capture_output=True, text=True,
                            timeout=600)
    found = summaries(result.stdout)
    if result.returncode != 0 or not found:
        raise SystemExit(f"{variant} failed ({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    summary = found[-1]
    return summary["final_step"] / summary["fit_seconds"], sink.received - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    reports: dict[str, list[int]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sink = ProgressSink(str(work / "progress.sock"))
        for round_number in range(args.rounds):
            order = VARIANTS if round_number % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                rate, received = run_once(variant, args.steps, work, sink)
                rates[variant].append(rate)
                reports[variant].append(received)
                print(f"round {round_number + 1} {variant}: {rate:.1f} steps/s, {received} progress reports",
                      flush=True)
    baseline = statistics.median(rates["plain"])
    result = {"steps": args.steps, "rounds": args.rounds, "cpu_count": os.cpu_count(),
              "median_steps_per_second": {v: round(statistics.median(r), 2) for v, r in rates.items()},
              "ratio_to_plain": {v: round(statistics.median(r) / baseline, 4) for v, r in rates.items()},
              "progress_reports_per_run": {v: statistics.median(r) for v, r in reports.items()}}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
