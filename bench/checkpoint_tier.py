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
from dataclasses import dataclass
from pathlib import Path

from tests.cluster import wait_for
from tests.workers import worker_env

TRAINER = [sys.executable, str(Path(__file__).resolve().parent / "tier_trainer.py")]
STEP_LINE = re.compile(r"^step (\d+) ([\d.]+) ([\d.]+) ([\d.]+) ([01]) ([01]) (-?\d+)$", re.M)
SLOW = 1.5  # a step over this many times the run's median is slow


@dataclass(frozen=True, order=True)
class Step:
    """One line of tier_trainer's per-step log: when the step ended and what ran beside it."""
    step: int
    end: float  # monotonic seconds
    cpu: float  # the trainer's CPU seconds so far
    stolen: float  # the host's stolen CPU seconds so far
    writing: bool  # a snapshot written in the background at the step's end
    copying: bool  # a copy to the shared tier ran during the step
    saved: int  # the newest snapshot begun (-1: none)


def parse_steps(output: str) -> list[Step]:
    return sorted(Step(int(n), float(t), float(c), float(st), w == "1", k == "1", int(sv))
                  for n, t, c, st, w, k, sv in STEP_LINE.findall(output))


@dataclass(frozen=True)
class SlowStep:
    step: Step
    seconds: float
    cpu: float  # the trainer's CPU seconds during the step
    stolen: float

    def line(self, median: float, median_cpu: float) -> str:
        since = self.step.step - self.step.saved if self.step.saved >= 0 else None
        beside = [what for what, on in (("writing", self.step.writing), ("copying", self.step.copying)) if on]
        return (f"step {self.step.step}: {self.seconds:.2f} s ({self.seconds / median:.1f}x), cpu {self.cpu:.2f} s "
                f"(median {median_cpu:.2f}), stolen {self.stolen:.2f} s, "
                f"{'no save yet' if since is None else f'{since} after the save of step {self.step.saved}'}"
                f"{', ' + ' and '.join(beside) if beside else ''}")


def slow_steps(output: str, warmup: int) -> tuple[list[SlowStep], float, float]:
    """Steps after the warm-up that took more than SLOW times the run's median step, with the median step and the
    median CPU time of a step."""
    pairs = [(a, b) for a, b in itertools.pairwise(parse_steps(output)) if a.step >= warmup]
    if not pairs:
        return [], 0.0, 0.0
    median = statistics.median(b.end - a.end for a, b in pairs)
    median_cpu = statistics.median(b.cpu - a.cpu for a, b in pairs)
    slow = [SlowStep(b, b.end - a.end, b.cpu - a.cpu, b.stolen - a.stolen) for a, b in pairs
            if b.end - a.end > SLOW * median]
    return slow, median, median_cpu


def phase_of(before: Step, step: Step) -> str:
    """What ran beside a step: a save begun in it (its stall), a snapshot written or copied in the background,
    or nothing (quiet)."""
    if step.saved != before.saved:
        return "save"
    return "writing" if step.writing else "copying" if step.copying else "quiet"


def phases(output: str, warmup: int) -> str:
    """The steps after the warm-up by what ran beside them: how many, their mean seconds and CPU seconds."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for a, b in itertools.pairwise(parse_steps(output)):
        if a.step >= warmup:
            groups.setdefault(phase_of(a, b), []).append((b.end - a.end, b.cpu - a.cpu))
    return "; ".join(f"{name} {len(rows)} x {statistics.fmean(s for s, _ in rows):.3f} s "
                     f"(cpu {statistics.fmean(c for _, c in rows):.2f})" for name, rows in sorted(groups.items()))


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


def seconds_per_step(output: str, warmup: int) -> float:
    times = {s.step: s.end for s in parse_steps(output)}
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
                     f"{done['interference']} cost per copy {done.get('copy_cost')} copies every "
                     f"{done.get('copy_seconds')} s" if done["stalls"] else "")
            kernel = ", ".join(f"{k} {v}" for k, v in faults.items())
            slow, median, median_cpu = slow_steps(output, warmup)
            print(f"round {round_number} {variant:>7}: {samples[variant][-1]:.3f} s/step (median {median:.3f} s, "
                  f"cpu {median_cpu:.2f} s); slow steps {len(slow)}; {kernel}{extra}", flush=True)
            for step in slow:
                print(f"    {step.line(median, median_cpu)}", flush=True)
            print(f"    steps by what ran beside them: {phases(output, warmup)}", flush=True)
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
            last = max(s.step for s in parse_steps(out.read_text()))
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
