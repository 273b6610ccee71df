"""The fast checkpoint tier against tf_keras's BackupAndRestore, on a model with ~406 MB of training state.

    python -m bench.checkpoint_tier [--steps 120] [--rounds 2] [--kills 3] [--variants none,sync20,fast20,fast]

One worker (``bench/tier_trainer.py``), no agent: the local tier is a directory under /dev/shm that the bench
passes as the agent would (``TFELASTIC_LOCAL_CHECKPOINT_DIR``), the shared tier a directory on disk.

- Overhead: the same ``--steps`` with each variant, the variants alternated for ``--rounds`` rounds (this
  machine's speed drifts over minutes); the time per step over the steps after the first ``--warmup`` (tracing,
  the first saves' allocations), its median over the rounds, and the overhead against ``none``.
- Steps redone: ``fast`` (fit_callbacks' defaults) is SIGKILLed ``--kills`` times at a random moment after
  step ``--warmup``, and restarted; steps redone = the last step it reported before the kill minus the step
  the next run restored.
Bounded: every run has a timeout; files stay under a temporary directory and /dev/shm/tfelastic-bench-*.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.cluster import wait_for
from tests.workers import worker_env

TRAINER = [sys.executable, str(Path(__file__).resolve().parent / "tier_trainer.py")]
STEP_LINE = re.compile(r"^step (\d+) ([\d.]+)$", re.M)


def run(variant: str, steps: int, work: Path, local: Path, timeout: float = 900) -> str:
    result = subprocess.run([*TRAINER, variant, str(steps), str(work / "backup")], capture_output=True, text=True,
                            env=worker_env({"TFELASTIC_LOCAL_CHECKPOINT_DIR": str(local)}), timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"{variant} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout


VMSTAT_KEYS = ("pgmajfault", "workingset_refault_file")


def vmstat() -> dict[str, int]:
    """The kernel's counters of major faults and refaulted file pages: pages the kernel (or a proactive reclaimer
    such as a VM's DAMON pageout scheme) took away, then read back from disk when touched again."""
    try:
        lines = Path("/proc/vmstat").read_text().splitlines()
    except OSError:
        return {}
    values = dict(line.split() for line in lines)
    return {k: int(values[k]) for k in VMSTAT_KEYS if k in values}


def slow_steps(output: str, warmup: int) -> int:
    """Steps after the warm-up that took more than 1.5 times the run's median step."""
    times = sorted((int(s), float(t)) for s, t in STEP_LINE.findall(output))
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(times) if a[0] >= warmup]
    if not gaps:
        return 0
    median = statistics.median(gaps)
    return sum(1 for g in gaps if g > 1.5 * median)


def seconds_per_step(output: str, warmup: int) -> float:
    times = {int(s): float(t) for s, t in STEP_LINE.findall(output)}
    last = max(times)
    return (times[last] - times[warmup]) / (last - warmup)


def overhead(variants: list[str], rounds: int, steps: int, warmup: int, root: Path, local_root: Path
             ) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for round_number in range(1, rounds + 1):
        for variant in variants:
            work, local = root / variant, local_root / variant
            before = vmstat()
            output = run(variant, steps, work, local)
            faults = {k: v - before.get(k, v) for k, v in vmstat().items()}
            samples[variant].append(seconds_per_step(output, warmup))
            done = json.loads(output.strip().splitlines()[-1])
            extra = (f"  stalls {done['stalls']} interval {done['interval']} interference per save "
                     f"{done['interference']}" if done["stalls"] else "")
            kernel = ", ".join(f"{k} {v}" for k, v in faults.items())
            print(f"round {round_number} {variant:>7}: {samples[variant][-1]:.3f} s/step; slow steps "
                  f"{slow_steps(output, warmup)}; {kernel}{extra}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
    return samples


def report_overhead(samples: dict[str, list[float]]) -> None:
    """The medians, and each variant's overhead against ``none`` of the same round: this machine's speed drifts
    over minutes, so a round's own baseline is the fairer one."""
    per_step = {v: statistics.median(s) for v, s in samples.items()}
    print("median s/step: " + ", ".join(f"{v} {t:.3f}" for v, t in per_step.items()))
    if "none" not in samples:
        return
    base = per_step["none"]
    costs = {v: per_step[v] / base - 1 for v in per_step if v != "none"}
    print("overhead against no checkpoints: " + ", ".join(f"{v} {c * 100:+.1f} %" for v, c in costs.items()))
    for v in costs:
        if v != "sync20" and "sync20" in costs and costs["sync20"] > 0:
            print(f"{v} / sync20 overhead: {costs[v] / costs['sync20']:.2f}")
    paired = {v: [t / b - 1 for t, b in zip(samples[v], samples["none"], strict=True)] for v in costs}
    print("overhead against no checkpoints of the same round: " + "; ".join(
        f"{v} " + ", ".join(f"{c * 100:+.1f} %" for c in cs) + f" (median {statistics.median(cs) * 100:+.1f} %)"
        for v, cs in paired.items()))


def steps_redone(kills: int, warmup: int, root: Path, local: Path, rng: random.Random) -> list[int]:
    redone: list[int] = []
    work = root / "kills"
    out = work / "out.log"
    work.mkdir(parents=True, exist_ok=True)
    last: int | None = None
    for attempt in range(kills + 1):
        with open(out, "w") as log:
            trainer = subprocess.Popen([*TRAINER, "fast", "100000", str(work / "backup")], stdout=log,
                                       stderr=subprocess.DEVNULL,
                                       env=worker_env({"TFELASTIC_LOCAL_CHECKPOINT_DIR": str(local)}))
        try:
            start = wait_for(lambda: re.search(r'^\{"initial_step": (\d+), "tier": "(\w+)"', out.read_text(), re.M),
                             300, "start")
            initial = int(start.group(1))
            if last is not None:
                redone.append(last - initial)
                print(f"kill {attempt}: last step {last}, restored {initial} from the {start.group(2)} tier: "
                      f"{last - initial} steps redone", flush=True)
            if attempt == kills:
                break
            target = f"step {initial + warmup} "
            wait_for(lambda: target in out.read_text(), 600, target)  # noqa: B023 - waited for at once
            time.sleep(rng.uniform(0, 30))
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            last = max(int(s) for s, _ in STEP_LINE.findall(out.read_text()))
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    return redone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--variants", default="none,sync20,fast20,fast")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tfelastic-bench-tier-"))
    local_root = Path(tempfile.mkdtemp(prefix="tfelastic-bench-", dir="/dev/shm"))
    try:
        variants = args.variants.split(",")
        if args.steps:
            report_overhead(overhead(variants, args.rounds, args.steps, args.warmup, root, local_root))
        if args.kills:
            redone = steps_redone(args.kills, args.warmup, root, local_root / "kills", random.Random(args.seed))
            print(f"steps redone per SIGKILL (fit_callbacks defaults): {redone}, mean "
                  f"{statistics.mean(redone):.1f}, max {max(redone)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(local_root, ignore_errors=True)


if __name__ == "__main__":
    main()
