"""Parameter-server jobs under worker faults: the same CNN, the same fault (a worker SIGKILLed every ``--every``
seconds), three ways, side by side.

    python -m bench.ps_faults [--seconds 150] [--every 30] [--reference-seconds 45]

Every variant runs on localhost (loopback only) and is measured over a window of ``--seconds`` of wall time that
opens once its chief has applied its first step and, under tfelastic, every agent has built its standby
interpreter (warm start, the default: a one-off import of TensorFlow per agent, 10-15 s of a core here, which
would otherwise fall inside the window; those built after each relaunch fall inside it, as in a real job). So
start-up, TensorFlow's imports and the first step's tracing are outside the window. The faults fall at
``--every``, 2 x ``--every``, ... seconds into it. At its end the job is stopped (SIGTERM to the agents, or
SIGKILL to the processes started by hand), whatever is left of its processes (found by its temporary directory,
psutil) is SIGKILLed and counted, and the next variant starts.

  ps          tfelastic, ``--strategy parameter-server --ps 1 --nodes 4`` (agents with ``--role`` chief, ps,
              worker, worker), examples/ps_custom_loop.py: the chief schedules one step of batch 64 at a time on the
              workers (ClusterCoordinator), a checkpoint every 50 steps. The victims alternate between worker 0 and
              worker 1; each one's agent relaunches it alone at its address.
  (a)         tfelastic, a mirrored job (MultiWorkerMirroredStrategy, 2 agents), examples/keras_fit.py: the same CNN
              and a global batch of 64 (32 a worker), the fast checkpoint tier at its adaptive interval
              (``--save-every auto``, tfelastic's default); every kill restarts both workers from the last snapshot.
              The victims alternate between ranks 0 and 1.
  (b)         no manager: the chief, the ps and 2 workers of ps_custom_loop.py launched by hand with TF_CONFIG
              (``TrainerEnvironment(...).to_env()``); a killed worker never returns. With 2 workers, the second
              kill leaves none, and later faults find nothing to kill.

Before them, ``ps-ref``: the same PS job without faults, over ``--reference-seconds``: its steps per second are
the reference of every goodput.

What is measured, and how:
- steps: the chief's optimizer step (the parameter servers' ``iterations``: steps applied, not scheduled). For
  tfelastic from ``tfelastic status`` (the chief's progress, polled every 0.3 s; for (a) the highest member's
  step); for (b), which has no agent, from the same reports the chief sends an agent: the bench binds a Unix
  socket and passes it to the chief alone as TFELASTIC_PROGRESS_SOCKET (a datagram at most every 0.1 s, which
  the chief of the ps variant sends too).
- steps/s before the faults: from the window's start to the first kill; across the faults: net progress (the
  step at the window's end minus the step at its start: steps redone after a restart do not count) over the
  window; per interval: between consecutive faults. Goodput = the steps/s across the faults / ps-ref's steps/s
  (and, beside it, / the variant's own steps/s before its first fault, which removes the difference in speed
  between a mirrored and a PS job of this model on this machine).
- for each worker kill of the ps variant, seconds from the SIGKILL to: its agent's "relaunching worker N alone"
  log line; its "worker N serves, X.Xs after its launch" line (the agent probes the new server every 2 s, so
  this is up to 2 s late); the chief's TensorFlow logging "Worker ...task:N has been recovered" (seen by polling
  the chief's output, every 0.3 s); and the replacement's CPU time growing by ``--busy-cpu`` seconds within one
  0.3 s poll after it serves (psutil: it is running steps).
- restarts and steps redone: status's restarts_by_reason and steps_redone; for ps also whether the chief's pid
  and the generation stayed the same and its step never went back. For (a), also the seconds from each kill to
  the first poll at which the next generation's step had moved past the first step status showed for it, and
  whether each agent's relaunch was warm (through its standby interpreter) or cold.

Targets (printed as yes/no, not asserted): a worker fault costs the PS chief no step and no restart; the worker
serves again within 10 s of its SIGKILL; the PS job's goodput under the schedule is above (a)'s.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.progress import SOCKET_ENV, decode

from bench.goodput import log_time
from tests.cluster import ROOT, Agent, Cluster, alive, kill, members, processes_of, wait_for

PS_EXAMPLE = str(ROOT / "examples" / "ps_custom_loop.py")
MIRRORED_EXAMPLE = str(ROOT / "examples" / "keras_fit.py")
ENDLESS = 1_000_000  # steps: every job is stopped at the window's end, never by reaching its target
SAVE_EVERY = "50"  # the PS examples' default
POLL = 0.3
SETTLE_TIMEOUT = 120.0
STARTUP_TIMEOUT = 300.0  # seconds until the first step: four TensorFlow processes starting on a loaded 2-core box
ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
PS_FLAGS = ["--strategy", "parameter-server", "--ps", "1", "--stop-grace", "10", "--log-level", "info"]
PS_NODES = {"chief": "chief", "ps": "ps", "w0": "worker", "w1": "worker"}
RECOVERED = re.compile(r"Worker /job:worker/replica:0/task:(\d+) has been recovered")
STANDBY_READY = re.compile(r"standby interpreter \d+ ready in")
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} ")
SERVES = re.compile(r"generation \d+: (worker \d+) serves, ([\d.]+)s after its launch")


def clock_of_day(wall: float) -> float:
    """Seconds since local midnight of a time.time() reading: the clock of the agents' log lines."""
    t = time.localtime(wall)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + wall % 1


def since(wall: float, line: str) -> float:
    return (log_time(line) - clock_of_day(wall)) % 86400


@dataclass
class Sample:
    t: float  # time.monotonic()
    generation: int
    step: int


@dataclass
class Fault:
    planned: float  # seconds into the window
    at: float | None  # seconds into the window when the SIGKILL was sent; None: nothing was left to kill
    what: str
    killed_mono: float = 0.0
    killed_wall: float = 0.0
    generation: int = 0  # the job's generation when it was killed
    launches: str = ""  # how the relaunch(es) after it started: warm or cold
    # ps: seconds from the SIGKILL
    relaunched: float | None = None
    serving: float | None = None
    serving_after_launch: float | None = None
    recovered: float | None = None
    busy: float | None = None
    # (a): seconds from the SIGKILL to the next generation's first step past where it resumed
    training_again: float | None = None


@dataclass
class Run:
    label: str
    t0: float
    seconds: float
    samples: list[Sample]
    faults: list[Fault]
    restarts: dict[str, int] = field(default_factory=dict)
    job_restarts: int = 0
    steps_redone: int | None = None
    notes: list[str] = field(default_factory=list)
    same_chief: bool | None = None

    def step_at(self, t: float) -> int:
        before = [s.step for s in self.samples if s.t <= t]
        return before[-1] if before else self.samples[0].step

    def rate(self, start: float, end: float) -> float:
        """Net steps per second between two moments of the window (seconds into it)."""
        if end <= start:
            return float("nan")
        return (self.step_at(self.t0 + end) - self.step_at(self.t0 + start)) / (end - start)

    @property
    def injected(self) -> list[Fault]:
        return [f for f in self.faults if f.at is not None]

    def before(self) -> float:
        first = self.injected[0].at if self.injected else self.seconds
        assert first is not None
        return self.rate(0.0, first)

    def across(self) -> float:
        return self.rate(0.0, self.seconds)

    def intervals(self) -> list[tuple[float, float, float]]:
        edges = [0.0, *[f.at for f in self.injected if f.at is not None], self.seconds]
        return [(a, b, self.rate(a, b)) for a, b in itertools.pairwise(edges)]

    def went_back(self) -> bool:
        steps = [s.step for s in self.samples]
        return any(b < a for a, b in itertools.pairwise(steps))


class Job:
    """One variant's processes: what the window's driver asks of them."""

    def __init__(self, label: str, tmp: Path) -> None:
        self.label, self.tmp = label, tmp
        self.t0 = 0.0  # the window's start (time.monotonic()), set by the driver

    def start(self) -> None:
        raise NotImplementedError

    def sample(self) -> tuple[int, int] | None:
        """(generation, the chief's step) now; None when unknown."""
        raise NotImplementedError

    def settled(self) -> bool:
        """Whether the one-off work after the start is over (tfelastic: every agent's standby interpreter built)."""
        return True

    def kill(self, index: int) -> Fault | None:
        """The index-th fault; None: no victim right now (retried at the next poll)."""
        raise NotImplementedError

    def follow(self, faults: list[Fault]) -> None:
        """Called every poll: follow the recovery of the faults so far."""

    def finish(self, run: Run) -> None:
        """At the window's end, before stop(): fill in what the job tells about itself."""

    def stop(self) -> None:
        raise NotImplementedError


def drive(job: Job, seconds: float, every: float | None) -> Run:
    """Starts the job, waits for its first step, then runs the window and its faults; stops the job."""
    try:
        job.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        first: tuple[int, int] | None = None
        while first is None or first[1] <= 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job.label}: no step after {STARTUP_TIMEOUT:.0f}s")
            time.sleep(POLL)
            first = job.sample()
        first_step = time.monotonic()
        while not job.settled() and time.monotonic() - first_step < SETTLE_TIMEOUT:
            time.sleep(POLL)
        fresh = None
        while fresh is None and time.monotonic() < deadline:  # a fresh step at the window's start
            fresh = job.sample()
            time.sleep(0.05 if fresh is None else 0.0)
        first = fresh or first
        t0 = job.t0 = time.monotonic()
        run = Run(job.label, t0, seconds, [Sample(t0, *first)], [])
        run.notes.append(f"the window opened {t0 - first_step:.0f}s after the first step"
                         + ("" if job.settled() else " (not settled: a standby interpreter was still missing)"))
        planned = [every * k for k in range(1, 1000) if every * k < seconds - 1e-6] if every else []
        while (now := time.monotonic()) - t0 < seconds:
            if planned and now - t0 >= planned[0]:
                fault = job.kill(len(run.faults))
                if fault is not None:
                    fault.planned = planned.pop(0)
                    run.faults.append(fault)
            job.follow(run.faults)
            got = job.sample()
            if got is not None:
                run.samples.append(Sample(time.monotonic(), *got))
            time.sleep(max(0.0, POLL - (time.monotonic() - now)))
        for f in planned:  # never injected: the window ended while they waited for a victim
            run.faults.append(Fault(f, None, "window ended before a victim was there"))
        job.finish(run)
        return run
    finally:
        job.stop()


def killed(t0: float, pid: int, what: str, generation: int = 0) -> Fault | None:
    """SIGKILLs ``pid`` now; None if it is gone already (a stale pid: the caller tries again at the next poll)."""
    mono, wall = time.monotonic(), time.time()
    try:
        kill(pid)
    except ProcessLookupError:
        return None
    return Fault(0.0, mono - t0, what, mono, wall, generation)


def launches_after(log: str, wall: float) -> list[str]:
    """How each trainer launch logged after ``wall`` started: "warm" (through the standby interpreter) or "cold"."""
    kinds, warm = [], False
    for line in log.splitlines():
        if not LOG_LINE.match(line) or since(wall, line) > 43200:  # before the kill (the difference wraps)
            continue
        if "launched through the standby interpreter" in line:
            warm = True
        elif "started worker pid" in line:
            kinds.append("warm" if warm else "cold")
            warm = False
    return kinds


def sweep(marker: str) -> int:
    """SIGKILLs whatever is left of a variant's processes (found by their tmp dir); returns how many there were."""
    left = processes_of(marker)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not any(alive(p.pid) for p in left), 10, "leftovers gone")
    return len(left)


# ---------------------------------------------------------------------------------------------- tfelastic


def roles(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["role"]: n for n in doc["nodes"] if n["role"]}


class TfelasticJob(Job):
    def __init__(self, label: str, tmp: Path, trainer: list[str], nodes: str, flags: list[str],
                 agents: dict[str, str | None]) -> None:
        super().__init__(label, tmp)
        self._agents = agents
        self._warm = "--warm-start" not in flags or flags[flags.index("--warm-start") + 1] != "off"
        self.cluster = Cluster(tmp, Endpoint("127.0.0.1", free_port()), trainer, nodes=nodes, extra_args=flags,
                               env=dict(ENV))
        self.doc: dict[str, Any] | None = None

    def start(self) -> None:
        (first, role), *others = self._agents.items()
        host = self.cluster.start(first, extra=["--role", role] if role else [])
        wait_for(lambda: "hosting the coordinator" in host.log(), 60, "the coordinator")
        for node, role in others:
            self.cluster.start(node, extra=["--role", role] if role else [])

    def settled(self) -> bool:
        if not self._warm:
            return True
        return all(STANDBY_READY.search(a.log()) for a in self.cluster.agents)

    def agent(self, node_id: str) -> Agent:
        return next(a for a in self.cluster.agents if a.node_id == node_id)

    def finish(self, run: Run) -> None:
        doc = self.cluster.status() or self.doc
        if doc is not None:
            run.restarts = dict(doc["restarts_by_reason"])
            run.job_restarts = doc["restarts_total"]
            run.steps_redone = doc["steps_redone"]

    def stop(self) -> None:
        self.cluster.stop()


class PsJob(TfelasticJob):
    def __init__(self, label: str, tmp: Path, flags: list[str], busy_cpu: float) -> None:
        trainer = [sys.executable, PS_EXAMPLE, "--steps", str(ENDLESS), "--save-every", SAVE_EVERY]
        super().__init__(label, tmp, trainer, "4", [*PS_FLAGS, *flags], dict(PS_NODES))
        self._busy_cpu = busy_cpu
        self._follow: dict[int, dict[str, Any]] = {}  # per fault index: what is known of its recovery
        self.chief_pids: set[int] = set()
        self.generations: set[int] = set()

    def sample(self) -> tuple[int, int] | None:
        doc = self.cluster.status()
        if doc is None or doc["state"] != "running":
            return None
        self.doc = doc
        chief = roles(doc).get("chief")
        if chief is None or chief["step"] is None:
            return None
        if chief["worker_pid"]:
            self.chief_pids.add(chief["worker_pid"])
        self.generations.add(doc["generation"])
        return doc["generation"], chief["step"]

    def kill(self, index: int) -> Fault | None:
        doc = self.doc
        task = f"worker {index % 2}"
        victim = roles(doc).get(task) if doc else None
        if doc is None or victim is None or not victim["worker_pid"]:
            return None
        pid, node = victim["worker_pid"], victim["node_id"]
        log = self.agent(node).log()
        self._follow[index] = {"task": task, "node": node, "old_pid": pid, "pid": None, "proc": None,
                               "relaunches": log.count(f"relaunching {task} alone"),
                               "serves": len([m for m in SERVES.finditer(log) if m.group(1) == task]),
                               "recovered": self._recoveries(task), "cpu": None}
        return killed(self.t0, pid, f"{task} SIGKILL (node {node})", doc["generation"])

    def _recoveries(self, task: str) -> int:
        index = task.split()[1]
        return len([m for m in RECOVERED.finditer(self.agent("chief").log()) if m.group(1) == index])

    def follow(self, faults: list[Fault]) -> None:
        for index, fault in enumerate(faults):
            state = self._follow.get(index)
            if state is None or fault.at is None or None not in (fault.relaunched, fault.serving, fault.recovered,
                                                                 fault.busy):
                continue
            if time.monotonic() - fault.killed_mono > 120:
                continue  # given up: reported as missing
            task, log = state["task"], self.agent(state["node"]).log()
            if fault.relaunched is None:
                lines = [line for line in log.splitlines() if f"relaunching {task} alone" in line]
                if len(lines) > state["relaunches"]:
                    fault.relaunched = since(fault.killed_wall, lines[state["relaunches"]])
            if fault.serving is None:
                lines = [line for line in log.splitlines() if SERVES.search(line) and f"{task} serves" in line]
                if len(lines) > state["serves"]:
                    line = lines[state["serves"]]
                    fault.serving = since(fault.killed_wall, line)
                    found = SERVES.search(line)
                    assert found is not None
                    fault.serving_after_launch = float(found.group(2))
            if fault.recovered is None and self._recoveries(task) > state["recovered"]:
                fault.recovered = time.monotonic() - fault.killed_mono
            self._follow_cpu(fault, state)

    def _follow_cpu(self, fault: Fault, state: dict[str, Any]) -> None:
        if state["proc"] is None and self.doc is not None:
            pid = (roles(self.doc).get(state["task"]) or {}).get("worker_pid")
            if pid and pid != state["old_pid"]:
                with contextlib.suppress(psutil.Error):
                    state["proc"] = psutil.Process(pid)
        if state["proc"] is None or fault.serving is None or fault.busy is not None:
            return
        try:
            cpu = sum(state["proc"].cpu_times()[:2])
        except psutil.Error:
            return
        if state["cpu"] is not None and cpu - state["cpu"] >= self._busy_cpu:
            fault.busy = time.monotonic() - fault.killed_mono
        state["cpu"] = cpu

    def finish(self, run: Run) -> None:
        super().finish(run)
        self.follow(run.faults)
        for index, fault in enumerate(run.faults):
            if index in self._follow and fault.at is not None:
                fault.launches = ", ".join(launches_after(self.agent(self._follow[index]["node"]).log(),
                                                          fault.killed_wall)[:1])
        run.same_chief = len(self.chief_pids) == 1 and len(self.generations) == 1


class MirroredJob(TfelasticJob):
    def __init__(self, label: str, tmp: Path, flags: list[str]) -> None:
        trainer = [sys.executable, MIRRORED_EXAMPLE, "--epochs", "1", "--steps-per-epoch", str(ENDLESS),
                   "--save-every", "auto"]
        super().__init__(label, tmp, trainer, "2", ["--max-restarts", "50", "--stop-grace", "10", *flags],
                         {"a": None, "b": None})

    def sample(self) -> tuple[int, int] | None:
        doc = self.cluster.status()
        if doc is None:
            return None
        self.doc = doc
        steps = [n["step"] for n in members(doc) if n["step"] is not None]
        if doc["state"] != "running" or not steps:
            return None
        return doc["generation"], max(steps)

    def kill(self, index: int) -> Fault | None:
        doc = self.doc
        workers = members(doc) if doc else []
        if doc is None or len(workers) < 2 or not workers[index % 2]["worker_pid"]:
            return None
        return killed(self.t0, workers[index % 2]["worker_pid"], f"rank {index % 2} SIGKILL", doc["generation"])

    def finish(self, run: Run) -> None:
        super().finish(run)
        for fault in run.injected:  # the first step past the restored one, in a later generation
            fault.launches = "; ".join(f"{a.node_id} " + ", ".join(launches_after(a.log(), fault.killed_wall)[:1])
                                       for a in self.cluster.agents)
            later = [s for s in run.samples if s.t > fault.killed_mono and s.generation > fault.generation]
            if later:
                resumed = later[0].step
                moved = [s for s in later if s.step > resumed]
                if moved:
                    fault.training_again = moved[0].t - fault.killed_mono


# --------------------------------------------------------------------------------------- (b) by hand


class ByHandJob(Job):
    """chief + ps + 2 workers with TF_CONFIG, no agent: a killed worker stays dead."""

    def __init__(self, label: str, tmp: Path) -> None:
        super().__init__(label, tmp)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._sock_path = str(tmp / "progress.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self._sock_path)
        self._sock.settimeout(0.2)
        self._step: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)

    def _receive(self) -> None:
        while not self._done.is_set():
            try:
                data = self._sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            with contextlib.suppress(ValueError):
                self._step = decode(data).step

    def start(self) -> None:
        self._thread.start()
        address = {name: f"127.0.0.1:{free_port()}" for name in ("chief", "ps", "w0", "w1")}
        tasks = {"chief": ("chief", 0, 0), "ps": ("ps", 0, 1), "w0": ("worker", 0, 2), "w1": ("worker", 1, 3)}
        for name, (task_type, index, rank) in tasks.items():
            env = TrainerEnvironment(rank=rank, world_size=4, task_type=task_type, task_index=index,
                                     workers=(address["chief"], address["w0"], address["w1"]), has_chief_job=True,
                                     ps=(address["ps"],), backup_dir=str(self.tmp / "backup")).to_env()
            if name == "chief":
                env[SOCKET_ENV] = self._sock_path  # the bench's own instrument: the chief's progress reports
            log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it; closed below)
            with log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, PS_EXAMPLE, "--steps", str(ENDLESS), "--save-every", SAVE_EVERY],
                    env=dict(os.environ, **ENV, **env, TMPDIR=str(self.tmp)), cwd=self.tmp, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)

    def sample(self) -> tuple[int, int] | None:
        return None if self._step is None else (0, self._step)

    def kill(self, index: int) -> Fault | None:
        for name in ("w0", "w1"):
            if self.procs[name].poll() is None:
                fault = killed(self.t0, self.procs[name].pid, f"worker {name[1]} SIGKILL (never returns)")
                self.procs[name].wait()
                return fault
        return Fault(0.0, None, "no worker left to kill")

    def finish(self, run: Run) -> None:
        chief = self.procs["chief"]
        run.restarts, run.steps_redone = {}, 0
        run.same_chief = chief.poll() is None
        if chief.poll() is not None:
            run.notes.append(f"the chief exited with {chief.returncode}")

    def stop(self) -> None:
        self._done.set()
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()


# ------------------------------------------------------------------------------------------------ driving


def measure(job: Job, seconds: float, every: float | None, keep: Path | None) -> tuple[Run, int]:
    """Runs one variant; returns its run and how many of its processes had to be swept after its stop."""
    try:
        run = drive(job, seconds, every)
    finally:
        left = sweep(str(job.tmp))
        if keep is not None:
            _keep_logs(job.tmp, keep / job.label.split()[0].strip("()"))
    return run, left


def _keep_logs(tmp: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*.log"):
        with contextlib.suppress(OSError):
            (dest / log.name).write_bytes(log.read_bytes())


# ------------------------------------------------------------------------------------------------ report


def fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def report(runs: dict[str, Run], reference: Run, swept: int) -> None:
    ref = reference.across()
    print(f"ps-ref, the PS job without faults: {ref:.2f} steps/s over {reference.seconds:.0f}s "
          f"(step {reference.samples[0].step} -> {reference.step_at(reference.t0 + reference.seconds)})")
    print("steps/s of the chief: before the first fault | after it | across the window (net) ; goodput = across / "
          "ps-ref's | across / its own before")
    for key, run in runs.items():
        first = run.injected[0].at if run.injected else run.seconds
        assert first is not None
        before, after, across = run.before(), run.rate(first, run.seconds), run.across()
        own = across / before if before > 0 else float("nan")
        restarts = ", ".join(f"{k}={v}" for k, v in sorted(run.restarts.items())) or "none"
        print(f"{run.label}")
        print(f"    {before:6.2f} | {after:6.2f} | {across:6.2f} steps/s ; goodput {across / ref:.3f} | {own:.3f} ; "
              f"step {run.samples[0].step} -> {run.step_at(run.t0 + run.seconds)} in {run.seconds:.0f}s; job "
              f"restarts {run.job_restarts} ({restarts}), steps redone {run.steps_redone}")
        print("    per interval: " + ", ".join(f"{a:.0f}-{b:.0f}s {r:.2f}" for a, b, r in run.intervals()))
        for f in run.faults:
            if f.at is None:
                print(f"    {f.planned:.0f}s: {f.what}")
                continue
            late = f" (due at {f.planned:.0f}s)" if f.at - f.planned > 1 else ""
            extra = ""
            if key == "ps":
                extra = (f": relaunched {fmt(f.relaunched)} ({f.launches or '?'}), serves {fmt(f.serving)} "
                         f"({fmt(f.serving_after_launch)} after its launch), re-attached: the chief logs it "
                         f"recovered {fmt(f.recovered)}, its CPU busy {fmt(f.busy)}")
            elif key == "a":
                extra = f": training again {fmt(f.training_again)} (launches: {f.launches})"
            print(f"    {f.at:.1f}s{late}: {f.what}{extra}")
        for note in run.notes:
            print(f"    note: {note}")
    ps, mirrored = runs.get("ps"), runs.get("a")
    if ps is not None:
        print("targets (not asserted):")
        costless = (ps.job_restarts == 0 and not ps.steps_redone and bool(ps.same_chief) and not ps.went_back())
        print(f"  a worker fault costs the PS chief no step and no restart: {'yes' if costless else 'no'} "
              f"(job restarts {ps.job_restarts}, steps redone {ps.steps_redone}, one chief pid and one generation: "
              f"{ps.same_chief}, its step went back: {ps.went_back()})")
        serving = [f.serving for f in ps.injected]
        back = bool(serving) and all(s is not None and s <= 10 for s in serving)
        worst = max((s for s in serving if s is not None), default=None)
        attached = max((f.recovered for f in ps.injected if f.recovered is not None), default=None)
        print(f"  the worker back within 10 s of its SIGKILL: {'yes' if back else 'no'} (serving: max {fmt(worst)}"
              f"{'' if None not in serving else ', some never'}; re-attached as the chief logs it: max "
              f"{fmt(attached)})")
        if mirrored is not None:
            print(f"  the PS job's goodput above (a)'s: {'yes' if ps.across() > mirrored.across() else 'no'} "
                  f"({ps.across() / ref:.3f} vs {mirrored.across() / ref:.3f}; against their own rates before the "
                  f"faults {ps.across() / ps.before():.3f} vs {mirrored.across() / mirrored.before():.3f})")
    left = processes_of(str(Path(tempfile.gettempdir()) / "ps-faults-"))
    print(f"processes: {swept} swept after their job's stop, {len(left)} left at the end", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=150.0, help="the window with faults (default 150)")
    parser.add_argument("--every", type=float, default=30.0, help="a worker SIGKILL every this many seconds")
    parser.add_argument("--reference-seconds", type=float, default=45.0,
                        help="the fault-free PS job's window (default 45)")
    parser.add_argument("--variants", default="ps,a,b", help="which to run after ps-ref (default ps,a,b)")
    parser.add_argument("--warm-start", choices=["on", "off"], default="on", help="the agents' --warm-start")
    parser.add_argument("--busy-cpu", type=float, default=0.05,
                        help="CPU seconds within one poll that count a replaced worker as running steps")
    parser.add_argument("--keep-logs", type=Path, help="copy every variant's logs here")
    args = parser.parse_args()
    flags = ["--warm-start", args.warm_start]
    runs: dict[str, Run] = {}
    swept = 0
    labels = {"ps": "ps   tfelastic, parameter-server job (chief, 1 ps, 2 workers; a worker replaced alone)",
              "a": "(a)  tfelastic, mirrored job (2 workers; every kill restarts both from the last snapshot)",
              "b": "(b)  parameter-server job by hand, no manager (a killed worker never returns)"}

    def one(make: Callable[[Path], Job], seconds: float, every: float | None) -> Run:
        nonlocal swept
        with tempfile.TemporaryDirectory(prefix="ps-faults-") as d:
            run, left = measure(make(Path(d)), seconds, every, args.keep_logs)
            swept += left
            return run

    makers: dict[str, Callable[[Path], Job]] = {
        "ps": lambda tmp: PsJob(labels["ps"], tmp, flags, args.busy_cpu),
        "a": lambda tmp: MirroredJob(labels["a"], tmp, flags),
        "b": lambda tmp: ByHandJob(labels["b"], tmp)}
    began = time.monotonic()
    reference = one(lambda tmp: PsJob("ps-ref", tmp, flags, args.busy_cpu), args.reference_seconds, None)
    print(f"[{time.monotonic() - began:.0f}s] ps-ref done: {reference.across():.2f} steps/s", file=sys.stderr,
          flush=True)
    for key in args.variants.split(","):
        runs[key] = one(makers[key], args.seconds, args.every)
        print(f"[{time.monotonic() - began:.0f}s] {key} done", file=sys.stderr, flush=True)
    report(runs, reference, swept)
    print(f"(the bench took {time.monotonic() - began:.0f}s)")


if __name__ == "__main__":
    main()
