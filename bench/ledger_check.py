"""The job's goodput ledger against what a soak sees from outside (bench/chaos.py): its goodput beside the seconds
the ledger trainer's chiefs spent on new steps by their own clock, and beside the time the job's steps need without
faults, each over the job's time; its steps redone beside the ledger trainer's own count (tests/trainers/ledger.py
keeps the furthest step each rank applied, and each step's end, per generation)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfelastic.daemon.netutil import free_port

from bench.common import read_events

LEDGER_TRAINER = str(Path(__file__).resolve().parent.parent / "tests" / "trainers" / "ledger.py")
FAULT_FREE_STEPS = 200


@dataclass(frozen=True)
class LedgerCheck:
    ledger_goodput: float
    outside_goodput: float  # fault-free step time x final step, over the job's time
    trainer_goodput: float  # the chiefs' seconds on new steps by their own clock, over the job's time
    ledger_redone: int
    trainer_redone: int
    badput: list[tuple[str, float]]

    def lines(self) -> list[str]:
        top = ", ".join(f"{c} {100 * s:.1f}%" for c, s in self.badput[:4])
        return [f"goodput: ledger {self.ledger_goodput:.3f}; the trainer's clock {self.trainer_goodput:.3f} "
                f"({100 * (self.ledger_goodput - self.trainer_goodput):+.1f} pp); fault-free step time x steps "
                f"{self.outside_goodput:.3f} ({100 * (self.ledger_goodput - self.outside_goodput):+.1f} pp); "
                f"ledger's badput: {top}",
                f"steps redone: report {self.ledger_redone}, the trainer's own count {self.trainer_redone}"]


def report_of(etcd_url: str, job: str = "default") -> dict[str, Any]:
    """`tfelastic report --json`, read from etcd once the job has ended."""
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--json", "--rendezvous", etcd_url,
                             "--job", job], capture_output=True, text=True, timeout=60, check=True)
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def fresh_step_seconds(starts: list[tuple[int, int]], times: Callable[[int], Path]) -> float:
    """The seconds the chiefs spent on new steps, by their own clock: each step past the furthest step an earlier
    chief reached, from the previous step's end to its own. A generation's first step has no previous end in it
    (it follows the restore, traces and compiles): start-up, as in the ledger. ``times(generation)``: the file of
    'STEP TIME' lines its chief wrote at each step's end (differences only: any clock)."""
    furthest, fresh = -1, 0.0
    for generation, start in sorted(starts):
        path = times(generation)
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # the last, unended one may be torn
        rows = [(int(step), float(at)) for step, at in (line.split() for line in lines)]
        for (_, before), (step, at) in itertools.pairwise(rows):
            if step > furthest:
                fresh += at - before
        furthest = max([furthest, start, *(step for step, _ in rows)])
    return fresh


def redone_from(starts: list[tuple[int, int]], reached: Callable[[int], Path]) -> int:
    """The steps the chiefs applied again: for each generation after the first, the furthest step a chief of an
    earlier generation applied, less the step this generation's chief started from. ``starts``: (generation, the
    step its chief started from); ``reached(generation)``: the file holding the furthest step its chief applied."""
    furthest, redone = -1, 0
    for generation, start in sorted(starts):
        redone += max(0, furthest - start)
        path = reached(generation)
        if path.exists() and (text := path.read_text().strip()):
            furthest = max(furthest, int(text))
        furthest = max(furthest, start)
    return redone


def chief_starts(events_path: Path) -> list[tuple[int, int]]:
    """(generation, the step its chief started from) of every generation whose chief started."""
    return [(e["generation"], e["step"]) for e in read_events(events_path) if e["event"] == "start" and e["rank"] == 0]


def trainer_redone(events_path: Path) -> int:
    """The ledger trainer's own count of the steps redone (tests/trainers/ledger.py)."""
    return redone_from(chief_starts(events_path), lambda generation: Path(f"{events_path}.reached-{generation}-0"))


def trainer_fresh_seconds(events_path: Path) -> float:
    """The seconds the ledger trainer's chiefs spent on new steps, by their own clock."""
    return fresh_step_seconds(chief_starts(events_path), lambda generation: Path(f"{events_path}.times-{generation}-0"))


def fault_free_step_seconds(workers: int, step_seconds: float) -> float:
    """The ledger trainer's seconds per step on ``workers`` ranks launched by hand, with no fault."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(workers)]
        env = {**os.environ, "TFELASTIC_BACKUP_DIR": str(tmp / "backup"), "TFELASTIC_NODE_ID": "n",
               "TFELASTIC_GENERATION": "1", "LEDGER_EVENTS": str(tmp / "events.jsonl"),
               "LEDGER_STEPS": str(FAULT_FREE_STEPS), "LEDGER_STEP_SECONDS": str(step_seconds)}
        procs = [subprocess.Popen([sys.executable, LEDGER_TRAINER], cwd=tmp, stdout=subprocess.DEVNULL,
                                  env={**env, "TFELASTIC_RANK": str(rank), "TF_CONFIG": json.dumps(
                                      {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})})
                 for rank in range(workers)]
        deadline = time.monotonic() + 120
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        events = [e for e in read_events(tmp / "events.jsonl") if e["rank"] == 0]
        start = next(e["time"] for e in events if e["event"] == "start")
        end = next(e["time"] for e in events if e["event"] == "end")
        return float(end - start) / FAULT_FREE_STEPS


def check(etcd_url: str, events_path: Path, final_step: int, step_seconds: float) -> LedgerCheck:
    """The soak's job has ended at ``final_step``: compare its ledger with the outside: the time ``final_step``
    steps take without faults over the time from the first generation's chief start to the job's last end (the
    trainers' own clocks). The report is kept beside the events, as report.json."""
    report = report_of(etcd_url)
    (events_path.parent / "report.json").write_text(json.dumps(report, indent=1))
    goodput = report["goodput"]
    events = read_events(events_path)
    first = min(e["time"] for e in events if e["event"] == "start" and e["generation"] == 1)
    last = max(e["time"] for e in events if e["event"] == "end")
    outside = final_step * fault_free_step_seconds(3, step_seconds) / (last - first)
    own_clock = trainer_fresh_seconds(events_path) / (last - first)
    return LedgerCheck(goodput["ratio"], outside, own_clock, goodput["steps_redone"], trainer_redone(events_path),
                       [(b["category"], b["share"]) for b in goodput["badput"]])
