"""Test harness: real agents (``python -m tfelastic.daemon run``) on localhost or in network namespaces.

Waits are conditions polled with a deadline, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.rendezvous.client import fetch_status
from tfelastic.daemon.status import status_to_json

ROOT = Path(__file__).resolve().parent.parent
COUNTER = str(ROOT / "tests" / "trainers" / "counter.py")
TF_TRAINER = [sys.executable, "-m", "tfelastic.trainer.demo_trainer"]
# For a cluster whose agents start together and must form the first generation together: past min_nodes the
# round waits for the others (max_nodes closes it at once), however slowly a loaded machine starts them.
FORM_WITH_ALL = ["--last-call", "30"]
# How long a test waits for TensorFlow trainers to reach a step: the imports of a new generation's processes take
# seconds of CPU each, and with one of the two cores busy elsewhere a start took past 120 s. A deadline bounds a
# failure's wait, not a success's: a passing test waits only as long as the trainers take.
TF_DEADLINE = 300


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Agent:
    node_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def metrics_address(self) -> str:
        """host:port of this agent's /metrics, as it logged it."""
        found = wait_for(lambda: re.search(r"metrics on http://(\S+)/metrics", self.log()), 20, "the metrics address")
        return str(found.group(1))


@dataclass
class Cluster:
    tmp: Path
    endpoint: Endpoint
    trainer: Sequence[str]
    nodes: str = "2"
    extra_args: Sequence[str] = ()
    env: dict[str, str | None] = field(default_factory=dict)  # None unsets a variable
    token: str | None = None
    netns_prefix: str = ""  # "tfe" runs agent i in namespace tfe-h<i+1>
    etcd: str = ""  # an etcd rendezvous (etcd://...) instead of ``endpoint``
    # False: --warm-start off, before the test's own flags (a --warm-start there wins). The suite's clusters
    # (make_cluster) run without it unless a test asks: the standby it builds per agent and generation imports
    # TensorFlow (a core for seconds) for a relaunch no assertion needs. The benchmarks keep the agent's default.
    warm_start: bool = True
    agents: list[Agent] = field(default_factory=list)

    @property
    def rendezvous(self) -> str:
        return self.etcd or str(self.endpoint)

    def coordinator(self) -> Endpoint | None:
        """Where the job's coordinator is: ``endpoint``, or the one etcd says leads."""
        if not self.etcd:
            return self.endpoint
        from tests.etcd import leader_of

        leader = leader_of(self.etcd)
        return Endpoint.parse(leader.address, "leader") if leader is not None else None

    @property
    def events_path(self) -> Path:
        return self.tmp / "events.jsonl"

    def agent_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        # TMPDIR keeps what a SIGKILLed agent cannot clean up (its progress socket) inside the test's folder.
        # SLURM's variables only where a test sets them: inside a SLURM job, agents would otherwise take its values.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
        env: dict[str, str | None] = dict(inherited, COUNTER_EVENTS=str(self.events_path),
                                          TFELASTIC_DEMO_EVENTS=str(self.events_path), TF_CPP_MIN_LOG_LEVEL="2",
                                          PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp))
        env.update(self.env)
        env.update(extra or {})
        return {name: value for name, value in env.items() if value is not None}  # None: unset it

    def start(self, node_id: str, *, extra: Sequence[str] = (), netns: str = "", env: Mapping[str, str] | None = None,
              placement: bool = True, prefix: Sequence[str] = ()) -> Agent:
        """``env``: this agent's own extra variables. ``placement=False`` leaves out --nodes, --rendezvous and
        --node-id, for agents that take them from their environment (SLURM). ``prefix``: a command that runs the
        agent's (it ends with an exec of its arguments)."""
        flags = ["--nodes", self.nodes, "--rendezvous", self.rendezvous, "--node-id", node_id] if placement else []
        command = [sys.executable, "-m", "tfelastic.daemon", "run", *flags, *self.warm_start_flags(),
                   "--metrics-port", "0", "--metrics-linger", "0",
                   "--backup-dir", str(self.tmp / "backup"),
                   "--local-checkpoint-dir", str(self.tmp / "shm"),  # the fast tier: not the host's shared /dev/shm
                   *self.extra_args, *extra, "--", *self.trainer]
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        return self.launch(node_id, [*prefix, *command], env)

    def warm_start_flags(self) -> list[str]:
        return [] if self.warm_start else ["--warm-start", "off"]

    def start_host(self, node_id: str, timeout: float = 20.0) -> Agent:
        """Starts an agent and waits until it hosts the coordinator, so later agents connect to it."""
        agent = self.start(node_id)
        wait_for(lambda: "hosting the coordinator" in agent.log(), timeout, f"agent {node_id} to host")
        return agent

    def launch(self, node_id: str, command: Sequence[str], env: Mapping[str, str] | None = None) -> Agent:
        """Runs an agent command line, logging to agent-<node_id>.log."""
        log_path = self.tmp / f"agent-{node_id}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.agent_env(env),
                                    cwd=self.tmp)
        agent = Agent(node_id, proc, log_path)
        self.agents.append(agent)
        return agent

    def status(self) -> dict[str, Any] | None:
        # Not up, or gone, fails at once; the deadline is for a coordinator slowed by a loaded machine.
        endpoint = self.coordinator()
        if endpoint is None:
            return None  # no coordinator leads yet (etcd)
        try:
            return status_to_json(asyncio.run(fetch_status(endpoint, self.token, timeout=5.0)))
        except grpc.RpcError:
            return None  # not up yet, or gone

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            doc = self.status()
            return doc if doc is not None and predicate(doc) else None

        result: dict[str, Any] = wait_for(check, timeout, what, interval=0.1)
        return result

    def wait_running(self, generation: int, world: int, timeout: float = 30.0, step: int = 0) -> dict[str, Any]:
        return self.wait_status(
            lambda d: d["state"] == "running" and d["generation"] == generation and d["world_size"] == world
            and all(n["step"] is not None and n["step"] >= step for n in members(d)),
            timeout, f"generation {generation} running with {world} workers past step {step}")

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]

    def logs(self) -> str:
        return "\n".join(f"===== {a.node_id}\n{a.log()}" for a in self.agents)

    def wait_all(self, timeout: float) -> list[int]:
        return [a.wait(timeout) for a in self.agents]

    def stop(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.proc.wait(20)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()


def scrape(url: str) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """A /metrics page: its text, and every sample by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return text, samples


def assert_no_stale_workers(events: list[dict[str, Any]]) -> None:
    """The counter trainer's start events name the live workers of older generations: there must be none."""
    stale = [(e["generation"], e["rank"], e["stale"]) for e in events if e["event"] == "start" and e["stale"]]
    assert not stale, f"workers of an older generation were alive when a newer one started: {stale}"


def members(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((n for n in doc["nodes"] if n["rank"] is not None), key=lambda n: n["rank"])


def processes_of(marker: str) -> list[psutil.Process]:
    """Live processes whose command line or environment mentions ``marker`` (a test's tmp path)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            text = " ".join(p.info["cmdline"] or []) + " " + " ".join(
                f"{k}={v}" for k, v in (p.info["environ"] or {}).items())
            if marker in text:
                found.append(p)
        except psutil.Error:
            continue
    return found


def trainer_pids(doc: dict[str, Any]) -> list[int]:
    return [n["worker_pid"] for n in members(doc) if n["worker_pid"]]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def fail_the_job_under(cluster: Cluster, coordinator_log: Path) -> list[float]:
    """Agents a and b join a standalone coordinator that logs its /metrics address to ``coordinator_log``; rank 1's
    worker is SIGKILLed (with max_restarts 0 the job fails) and both agents exit 1. Returns what the coordinator's
    /metrics then shows, every agent gone, for tfelastic_cluster_job_state{state="failed"}."""
    address = wait_for(lambda: re.search(r"metrics on http://(\S+)/metrics", coordinator_log.read_text()), 20,
                       "the coordinator's metrics address").group(1)
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=5)
    kill(members(doc)[1]["worker_pid"])
    assert cluster.wait_all(60) == [1, 1], cluster.logs()
    _, samples = scrape(f"http://{address}/metrics")
    return [value for (name, labels), value in samples.items()
            if name == "tfelastic_cluster_job_state" and ("state", "failed") in labels]
