"""A light trainer whose state can be verified exactly, with a real collective between its ranks (no TensorFlow).

State: (step, digest), digest_s = sha256(digest_{s-1} || s), digest_0 = sha256(b"tfelastic"). A step applied twice
or skipped anywhere along the way, or a torn checkpoint restored, gives a different digest at the end: the chaos
soak (bench/chaos.py) recomputes the chain and compares.

Collective: a ring over the workers of TF_CONFIG. Each step, rank r sends (step, digest) to rank r+1 and receives
rank r-1's, which must equal its own. A peer that is gone blocks the ring, as MultiWorkerMirroredStrategy's
collectives block until TensorFlow's own timeout; after LEDGER_PEER_TIMEOUT (default 30 s) the rank exits 1. So a
worker of an old generation can never train on with the new one's peers, and a worker whose agent is SIGSTOPped
cannot advance the job's state.

Checkpoints (each one a "saved" event with its generation, so that a soak can tell that no worker of an old
generation wrote one once a newer generation had started): the chief writes ckpt-<step>.json every
LEDGER_SAVE_EVERY steps (default 10), at the end, and on
SIGTERM (then every rank exits 42, CHECKPOINTED_AND_STOPPED): written to a temporary file, fsynced, renamed, with
a checksum; the 2 newest are kept. At start every rank restores the newest checkpoint that verifies: a torn one
is skipped (its start event names it).

Knobs: LEDGER_TARGET_FILE (the target step, read every 10 steps: the soak sets it when its faults are done;
default LEDGER_STEPS, 100), LEDGER_STEP_SECONDS (default 0.05), LEDGER_REPORT_INTERVAL (at most one report per
this many seconds unless urgent, default 0: every step; each step is marked in the agent's step file either way),
LEDGER_AFTER_SECONDS (each rank's seconds after its last step and its report that training is done, before
it exits: an evaluation, an export, default 0), LEDGER_CONTROL_DIR (<dir>/hang-<node> holding a generation: this
rank of that generation stops stepping and stays alive, a live hang; while <dir>/bad-<node> exists the rank exits 1
at start, a bad GPU), LEDGER_EVENTS (one JSON line per start and end).

Progress: a report per step, announcing start-up, the step it restored and saves as the library's trainers do (so
that an agent with the default hang detection learns the step times: docs/configuration.md). Each rank keeps the
furthest step it applied in LEDGER_EVENTS.reached-<generation>-<rank> (rewritten in place every step), so that a
soak can count the steps redone after each restart itself, and appends 'STEP TIME' at each step's end (its save
included; TIME on the monotonic clock) to LEDGER_EVENTS.times-<generation>-<rank>: the differences are the seconds
it spent on each step by its own clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tfelastic.trainer.exit_codes import CHECKPOINTED_AND_STOPPED
from tfelastic.trainer.progress import Phase, ProgressReporter

GENESIS = hashlib.sha256(b"tfelastic").hexdigest()
KEEP = 2


def advance(digest: str, step: int) -> str:
    return hashlib.sha256(f"{digest}:{step}".encode()).hexdigest()


def chain(steps: int) -> str:
    """The digest after ``steps`` steps, each applied once, in order."""
    digest = GENESIS
    for step in range(1, steps + 1):
        digest = advance(digest, step)
    return digest


def save(backup: Path, step: int, digest: str) -> None:
    payload = json.dumps({"step": step, "digest": digest})
    body = json.dumps({"payload": payload, "sha256": hashlib.sha256(payload.encode()).hexdigest()})
    tmp = backup / f"ckpt-{step}.json.tmp"
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, backup / f"ckpt-{step}.json")
    for old in checkpoints(backup)[KEEP:]:
        old.unlink(missing_ok=True)


def checkpoints(backup: Path) -> list[Path]:
    """Newest first."""
    found = [(int(p.name[5:-5]), p) for p in backup.glob("ckpt-*.json") if p.name[5:-5].isdigit()]
    return [p for _, p in sorted(found, reverse=True)]


def restore(backup: Path) -> tuple[int, str, list[str]]:
    """The newest checkpoint that verifies: (step, digest, the torn ones skipped)."""
    torn: list[str] = []
    for path in checkpoints(backup):
        try:
            body = json.loads(path.read_text())
            payload = body["payload"]
            if hashlib.sha256(payload.encode()).hexdigest() != body["sha256"]:
                raise ValueError("checksum mismatch")
            state = json.loads(payload)
            return int(state["step"]), str(state["digest"]), torn
        except (OSError, ValueError, KeyError, TypeError):
            torn.append(path.name)
    return 0, GENESIS, torn


class Ring:
    """Rank r sends to r+1 and receives from r-1; blocks while a peer is gone, up to ``timeout``."""

    def __init__(self, workers: list[str], rank: int, timeout: float) -> None:
        self.rank, self.world, self.timeout = rank, len(workers), timeout
        self._next: socket.socket | None = None
        self._prev: Any = None
        if self.world == 1:
            return
        port = int(workers[rank].rsplit(":", 1)[1])
        self._server = socket.create_server(("0.0.0.0", port))
        self._server.settimeout(timeout)
        host, next_port = workers[(rank + 1) % self.world].rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while self._next is None:
            try:
                self._next = socket.create_connection((host.strip("[]"), int(next_port)), timeout=1.0)
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {(rank + 1) % self.world} at {host}:{next_port} never came up") from None
                time.sleep(0.05)
        self._next.settimeout(timeout)
        prev, _ = self._server.accept()
        prev.settimeout(timeout)
        self._prev = prev.makefile("r")

    def exchange(self, step: int, digest: str) -> None:
        if self.world == 1:
            return
        assert self._next is not None
        self._next.sendall((json.dumps({"step": step, "digest": digest}) + "\n").encode())
        line = self._prev.readline()
        if not line:
            raise ConnectionError(f"rank {(self.rank - 1) % self.world} is gone")
        theirs = json.loads(line)
        if (theirs["step"], theirs["digest"]) != (step, digest):
            raise RuntimeError(f"ranks disagree at step {step}: {theirs} != {(step, digest)}")


def block_then_fail(error: Exception, timeout: float, stopping: list[int]) -> int:
    """A collective that failed: wait like TensorFlow's does, unless the agent stops us first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping:
        time.sleep(0.05)
    if stopping:
        return CHECKPOINTED_AND_STOPPED
    print(f"RuntimeError: collective failed: {error}", file=sys.stderr)
    return 1


def main() -> int:
    env = os.environ
    backup = Path(env["TFELASTIC_BACKUP_DIR"])
    rank, node = int(env["TFELASTIC_RANK"]), env["TFELASTIC_NODE_ID"]
    generation = int(env["TFELASTIC_GENERATION"])
    control = Path(env.get("LEDGER_CONTROL_DIR", "/nonexistent"))
    events = env.get("LEDGER_EVENTS")
    pause = float(env.get("LEDGER_STEP_SECONDS", "0.05"))
    save_every = int(env.get("LEDGER_SAVE_EVERY", "10"))
    peer_timeout = float(env.get("LEDGER_PEER_TIMEOUT", "30"))
    report_interval = float(env.get("LEDGER_REPORT_INTERVAL", "0"))
    target_file = env.get("LEDGER_TARGET_FILE")

    def event(kind: str, **extra: object) -> None:
        if events:
            with open(events, "a") as f:
                f.write(json.dumps({"event": kind, "node": node, "rank": rank, "generation": generation,
                                    "pid": os.getpid(), "time": time.time(), **extra}) + "\n")

    def target() -> int:
        if target_file:
            try:
                return int(Path(target_file).read_text())
            except (OSError, ValueError):
                pass
        return int(env.get("LEDGER_STEPS", "100"))

    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    if (control / f"bad-{node}").exists():
        time.sleep(pause)
        print("RuntimeError: CUDA error: an illegal memory access was encountered (a bad GPU)", file=sys.stderr)
        return 1
    backup.mkdir(parents=True, exist_ok=True)
    reporter = ProgressReporter.from_env(min_interval=report_interval)
    reporter.report(0, phase=Phase.SETUP)  # as the library's trainers do: the agent then learns the step times
    step, digest, torn = restore(backup)
    reporter.report(step, phase=Phase.SETUP, restored_tier="shared", restored_step=step)  # where it resumes
    event("start", step=step, torn=torn)
    reached = os.open(f"{events}.reached-{generation}-{rank}", os.O_WRONLY | os.O_CREAT, 0o644) if events else -1
    times = os.open(f"{events}.times-{generation}-{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) \
        if events else -1
    workers = json.loads(env["TF_CONFIG"])["cluster"]["worker"]
    try:
        ring = Ring(workers, rank, peer_timeout)
    except (OSError, TimeoutError) as e:
        return block_then_fail(e, 0, stopping)
    goal = target()
    hang = control / f"hang-{node}"
    while step < goal:
        if hang.exists() and hang.read_text().strip() == str(generation):
            event("hang", step=step)
            while True:  # alive, and not stepping, until the agent stops it
                time.sleep(0.05)
        time.sleep(pause)
        try:
            ring.exchange(step + 1, advance(digest, step + 1))
        except (OSError, ConnectionError) as e:
            return block_then_fail(e, peer_timeout, stopping)
        step, digest = step + 1, advance(digest, step + 1)
        if reached >= 0:
            os.pwrite(reached, f"{step:012d}".encode(), 0)
        saving = rank == 0 and (step % save_every == 0 or stopping)
        if saving:
            reporter.report(step, phase=Phase.SAVE)
            save(backup, step, digest)
            event("saved", step=step)
        reporter.report(step, examples=step, loss=1.0 / step, checkpoint_step=step if saving else None)
        if times >= 0:  # unbuffered: a SIGKILL loses no step that ended
            os.write(times, f"{step} {time.monotonic():.6f}\n".encode())
        if stopping:
            event("checkpointed", step=step)
            return CHECKPOINTED_AND_STOPPED
        if step % 10 == 0:
            goal = target()
    if rank == 0:
        save(backup, step, digest)
        event("saved", step=step)
    reporter.report(step, done=True)
    event("end", step=step, digest=digest)
    time.sleep(float(env.get("LEDGER_AFTER_SECONDS", "0")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
