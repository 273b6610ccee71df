"""A chaos soak: one long job under many random faults of every kind, checked for exact correctness at the end.

    python -m bench.chaos [--faults 200] [--seed 1] [--netns] [--stall-timeout learned|SECONDS]

On localhost (or, with --netns, on three hosts in network namespaces on a bridge, with etcd on the bridge's own
address): a one-member etcd, three agents (``--nodes 2:3``, rendezvous on etcd, so any node may die, the
coordinator's included), and the ledger trainer (tests/trainers/ledger.py: a ring collective between the ranks and
a hash-chain state). The backup directory is a 32 MiB tmpfs, so that it can be filled. Faults come one at a time;
each waits for the job to be back to three members training past where it was, and for the quarantine window to
pass (so that two faults never add up to a quarantine by chance). The kinds:

  worker_kill      SIGKILL one trainer                              worker_exit
  agent_kill       SIGKILL an agent that does not lead; restart it  node_lost, then scale_up when it is back
                   once the others re-formed (systemd would)
  leader_kill      the same to the agent that leads (the coordinator's node)
  hang             one trainer stops stepping, alive (a live hang)  stalled
  agent_stop       SIGSTOP an agent that does not lead; SIGCONT     node_lost, scale_up
                   once the others re-formed
  drain            tfelastic drain; restart the agent after it      node_left, scale_up
                   exited 0
  torn_checkpoint  truncate the newest checkpoint, SIGKILL the chief worker_exit (restores an older one)
  full_backup      fill the backup filesystem until a save fails,   worker_exit (1 or 2; a second failure of
                   then free it                                     the chief's node quarantines it: scale_up)
  bad_node         a node whose trainer dies at start: quarantined  worker_exit x2, scale_up after the
                   after its second failure, back after its check  3 s cooldown
  partition        (--netns) a host's link down until the others    node_lost, scale_up
                   re-formed, then up again

Afterwards: the job runs to exactly its target step, and the digest equals the chain's (no step applied twice,
none skipped, no torn checkpoint restored); every agent exits 0 (and every exit along the way is a documented
code); no process of the job is left; each fault's restarts are the ones its kind causes, and none comes
between faults (a false stall verdict); the coordinator's /metrics counts what status counts. One line per fault
(kind, node, time to recover, restarts), then a summary; exit code 1 on any violation. Every wait is bounded;
all traffic stays on loopback and on the namespace hosts it made. Needs root for the tmpfs (without it,
full_backup is left out) and for --netns. The agents run with the default hang detection (a limit learned from the
step times, at least 5 s); ``--stall-timeout SECONDS`` fixes it instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.exit_codes import ExitCode

from bench.common import read_events
from bench.ledger_check import LedgerCheck
from bench.ledger_check import check as check_ledger
from tests.cluster import Agent, Cluster, members, processes_of, wait_for
from tests.etcd import EtcdCluster, leader_of
from tests.trainers.ledger import chain, checkpoints

STEP_SECONDS = 0.05  # the ledger trainer's
LEDGER = [sys.executable, str(Path(__file__).resolve().parent.parent / "tests" / "trainers" / "ledger.py")]
NODES = ("a", "b", "c")
QUARANTINE_WINDOW = 4.0
STALL_TIMEOUT = "learned"  # the agents' default hang detection (a number: a fixed --stall-timeout instead)
FLAGS = ["--stop-grace", "3", "--last-call", "0.5", "--settle", "1",
         "--max-restarts", "100000", "--quarantine-window", str(QUARANTINE_WINDOW), "--quarantine-cooldown", "3",
         "--check-min-free-mb", "1", "--log-level", "info"]
RECOVERY_TIMEOUT = 120.0
KINDS = ("worker_kill", "agent_kill", "leader_kill", "hang", "agent_stop", "drain", "torn_checkpoint",
         "full_backup", "bad_node")
STRIKES = {"worker_kill", "hang", "torn_checkpoint", "full_backup", "bad_node"}  # a worker of a node fails first
BACKUP_MIB = 32
NETNS = Path(__file__).resolve().parent.parent / "tests" / "netns-hosts.sh"
PREFIX, SUBNET = "tfec", "10.231.13"
NETNS_ENV = {"TFE_NETNS_PREFIX": PREFIX, "TFE_NETNS_SUBNET": SUBNET}
TOKEN = "chaos-soak-secret"
BOUNDED_EXIT = ("stepping down did not finish within", "decided to exit with code")  # agent.py, exit_guard.py


@dataclass(frozen=True)
class Hosts:
    """Where the agents run: all on localhost, or node i on namespace host i (then with a token, as any job whose
    listeners are not on loopback)."""

    netns: bool

    def namespace(self, node: str) -> str:
        return f"{PREFIX}-h{NODES.index(node) + 1}" if self.netns else ""

    def address(self, node: str) -> str:
        return f"{SUBNET}.{NODES.index(node) + 1}" if self.netns else "127.0.0.1"


@dataclass
class Result:
    kind: str
    node: str
    seconds: float
    restarts: Counter[str]


@dataclass
class Soak:
    tmp: Path
    etcd: EtcdCluster
    rng: random.Random
    hosts: Hosts
    stall_timeout: str = STALL_TIMEOUT
    cluster: Cluster = field(init=False)
    agents: dict[str, Agent] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    exits: list[tuple[str, int]] = field(default_factory=list)  # agents that ended by themselves
    torn_restores: int = 0
    ledger: LedgerCheck | None = None  # the job's goodput ledger against the outside, once it ended
    settled_generation: int = 0  # the job's generation once the last fault was recovered (or at the start)

    def __post_init__(self) -> None:
        env: dict[str, str | None] = {"LEDGER_EVENTS": str(self.events), "LEDGER_CONTROL_DIR": str(self.control),
               "LEDGER_TARGET_FILE": str(self.target_file), "LEDGER_STEPS": "1000000000",
               "LEDGER_STEP_SECONDS": str(STEP_SECONDS)}
        self.control.mkdir()
        flags = list(FLAGS) + ([] if self.stall_timeout == "learned" else ["--stall-timeout", self.stall_timeout])
        if self.hosts.netns:
            self.token_file.write_text(TOKEN + "\n")
            self.token_file.chmod(0o600)
            flags += ["--token-file", str(self.token_file), "--metrics-token-file", str(self.token_file)]
        self.cluster = Cluster(self.tmp, Endpoint("127.0.0.1", 1), LEDGER, nodes="2:3", etcd=self.etcd.url,
                               extra_args=flags, env=env, token=TOKEN if self.hosts.netns else None)

    @property
    def token_file(self) -> Path:
        return self.tmp / "token"

    @property
    def events(self) -> Path:
        return self.tmp / "ledger-events.jsonl"

    @property
    def control(self) -> Path:
        return self.tmp / "control"

    @property
    def target_file(self) -> Path:
        return self.tmp / "target"

    @property
    def backup(self) -> Path:
        return self.tmp / "backup"

    # ------------------------------------------------------------------------------------------ the job

    def start(self, node: str) -> None:
        old = self.agents.get(node)
        if old is not None and old.proc.poll() is None:
            raise AssertionError(f"agent {node} is still running")
        metrics = ["--metrics-address", self.hosts.address(node)] if self.hosts.netns else []
        self.agents[node] = self.cluster.start(node, netns=self.hosts.namespace(node), extra=metrics)

    def status(self) -> dict[str, Any]:
        doc = wait_for(self.cluster.status, 30, "a coordinator to answer", interval=0.05)
        return dict(doc)

    def leader(self) -> str:
        found = wait_for(lambda: leader_of(self.etcd.url), 30, "a leader in etcd", interval=0.05)
        return str(found.node)

    def training(self, past: int, world: int = 3) -> Callable[[dict[str, Any]], bool]:
        return lambda d: (d["state"] == "running" and d["world_size"] == world and len(members(d)) == world
                          and all(n["step"] is not None and n["step"] > past for n in members(d)))

    def wait(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        return self.cluster.wait_status(predicate, RECOVERY_TIMEOUT, what)

    def furthest(self, doc: dict[str, Any]) -> int:
        return max((n["step"] or 0) for n in members(doc))

    def worker_pid(self, doc: dict[str, Any], node: str) -> int:
        return int(next(n["worker_pid"] for n in members(doc) if n["node_id"] == node))

    def reformed_without(self, node: str, generation: int) -> None:
        self.wait(lambda d: d["state"] == "running" and d["generation"] > generation and d["world_size"] == 2
                  and node not in {n["node_id"] for n in members(d)}, f"the job re-formed without {node}")

    def ended(self, node: str, timeout: float = 60.0) -> int:
        """The agent's exit code; one that does not exit in time is a violation, and is killed."""
        try:
            code = self.agents[node].wait(timeout)
        except subprocess.TimeoutExpired:
            self.agents[node].proc.send_signal(signal.SIGUSR1)  # it logs where it waits (or, loop gone, dies)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: "where the agent waits" in self.agents[node].log() or
                         self.agents[node].proc.poll() is not None, 5.0, "the agent's SIGUSR1 dump")
            tail = "\n    ".join(self.agents[node].log().splitlines()[-60:])
            self.violations.append(f"agent {node} did not exit within {timeout:g}s; its log ends:\n    {tail}")
            self.agents[node].proc.kill()
            code = self.agents[node].wait(10)
        self.exits.append((node, code))
        return code

    # ------------------------------------------------------------------------------------------ faults

    def worker_kill(self, doc: dict[str, Any]) -> str:
        node = self.rng.choice(NODES)
        os.kill(self.worker_pid(doc, node), signal.SIGKILL)
        return node

    def agent_kill(self, doc: dict[str, Any], *, leader: bool = False) -> str:
        lead = self.leader()
        node = lead if leader else self.rng.choice([n for n in NODES if n != lead])
        self.agents[node].proc.send_signal(signal.SIGKILL)
        self.agents[node].wait(30)
        self.reformed_without(node, doc["generation"])
        self.start(node)  # systemd's Restart=on-failure, after the others moved on
        return node

    def leader_kill(self, doc: dict[str, Any]) -> str:
        return self.agent_kill(doc, leader=True)

    def hang(self, doc: dict[str, Any]) -> str:
        node = self.rng.choice(NODES)
        (self.control / f"hang-{node}").write_text(str(doc["generation"]))
        return node

    def agent_stop(self, doc: dict[str, Any]) -> str:
        lead = self.leader()
        node = self.rng.choice([n for n in NODES if n != lead])
        self.agents[node].proc.send_signal(signal.SIGSTOP)
        try:
            self.reformed_without(node, doc["generation"])
        finally:
            self.agents[node].proc.send_signal(signal.SIGCONT)
        return node

    def drain(self, doc: dict[str, Any]) -> str:
        node = self.rng.choice(NODES)
        token = ["--token-file", str(self.token_file)] if self.hosts.netns else []
        result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "drain", node, "--rendezvous",
                                 self.etcd.url, "--reason", "chaos", *token], capture_output=True, text=True,
                                timeout=60)
        if result.returncode != 0:
            self.violations.append(f"drain {node} refused: {result.stderr.strip()}")
            return node
        if (code := self.ended(node)) != 0:
            self.violations.append(f"drained agent {node} exited {code}, not 0")
        self.reformed_without(node, doc["generation"])
        self.start(node)
        return node

    def torn_checkpoint(self, doc: dict[str, Any]) -> str:
        """The chief dies (SIGKILL: it cannot save on the way out) right after its newest checkpoint was torn."""
        chief = str(members(doc)[0]["node_id"])
        newest = checkpoints(self.backup)[0]
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
        os.kill(self.worker_pid(doc, chief), signal.SIGKILL)
        return chief

    def full_backup(self, doc: dict[str, Any]) -> str:
        ballast = self.tmp / "backup" / "ballast"
        with open(ballast, "wb", buffering=0) as f:
            for chunk in (1 << 20, 1 << 12, 1):  # to the last byte: a small save must not fit in a leftover page
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError:
                    pass
        try:
            self.cluster.wait_status(lambda d: d["generation"] > doc["generation"], RECOVERY_TIMEOUT,
                                     "a save to fail")
        finally:
            ballast.unlink()
        return str(members(doc)[0]["node_id"])

    def partition(self, doc: dict[str, Any]) -> str:
        node = self.rng.choice(NODES)
        link = ["ip", "-n", self.hosts.namespace(node), "link", "set", "eth0"]
        subprocess.run([*link, "down"], check=True)
        try:
            self.reformed_without(node, doc["generation"])
        finally:
            subprocess.run([*link, "up"], check=True)
        return node

    def bad_node(self, doc: dict[str, Any]) -> str:
        node = self.rng.choice(NODES)
        bad = self.control / f"bad-{node}"
        bad.touch()
        try:
            os.kill(self.worker_pid(doc, node), signal.SIGKILL)
            self.wait(lambda d: any(n["node_id"] == node and n["state"] == "quarantined" for n in d["nodes"]),
                      f"{node} quarantined")
        finally:
            bad.unlink()  # repaired: after its cooldown it is checked and taken in again
        return node


def expected_restarts(kind: str, restarts: Counter[str]) -> bool:
    if kind in ("worker_kill", "torn_checkpoint"):
        return restarts == Counter(worker_exit=1)
    if kind == "hang":
        return restarts == Counter(stalled=1)
    if kind in ("agent_kill", "leader_kill", "agent_stop", "partition"):
        return restarts == Counter(node_lost=1, scale_up=1)
    if kind == "drain":
        return restarts == Counter(node_left=1, scale_up=1)
    if kind == "full_backup":  # one failed save, or two (its node is then quarantined, and back after 3 s)
        return restarts in (Counter(worker_exit=1), Counter(worker_exit=2, scale_up=1))
    return restarts == Counter(worker_exit=2, scale_up=1)  # bad_node


def inject(soak: Soak, kind: str, last_strike: float) -> Result:
    wait = QUARANTINE_WINDOW + 0.5 - (time.monotonic() - last_strike)
    if kind in STRIKES and wait > 0:
        time.sleep(wait)  # two faults must not add up to a quarantine by chance
    before = soak.status()
    if before["generation"] != soak.settled_generation:  # a restart with no fault injected: a false stall verdict
        soak.violations.append(uncaused(range(soak.settled_generation + 1, before["generation"] + 1)))
    started = time.monotonic()
    node = getattr(soak, kind)(before)
    after = soak.wait(lambda d: d["generation"] > before["generation"] and soak.training(soak.furthest(before))(d),
                      f"recovery from {kind} of {node}")
    seconds = time.monotonic() - started
    restarts = Counter(after["restarts_by_reason"]) - Counter(before["restarts_by_reason"])
    soak.settled_generation = after["generation"]
    if not expected_restarts(kind, restarts):
        soak.violations.append(f"{kind} of {node}: restarts {dict(restarts)} are not what this fault causes")
    if kind == "hang":
        (soak.control / f"hang-{node}").unlink(missing_ok=True)
    return Result(kind, node, seconds, restarts)


def uncaused(generations: Iterable[int]) -> str:
    return f"generations {list(generations)} started after the last fault was recovered, with none injected"


def schedule(rng: random.Random, count: int, kinds: tuple[str, ...]) -> list[str]:
    """Every kind once in a random order, then random kinds: a short run still has each one."""
    first = list(kinds)
    rng.shuffle(first)
    return (first + [rng.choice(kinds) for _ in range(max(0, count - len(kinds)))])[:count]


def restarts_on_metrics(soak: Soak, node: str) -> dict[str, int]:
    """tfelastic_cluster_restarts_total by reason, off the /metrics of the agent on ``node``."""
    found = re.findall(r"metrics on http://(\S+)/metrics", soak.agents[node].log())
    request = urllib.request.Request(f"http://{found[-1]}/metrics")  # the log's last incarnation is the live one
    if soak.hosts.netns:
        request.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {s.labels["reason"]: int(s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "tfelastic_cluster_restarts_total" and s.value}


def finish(soak: Soak) -> None:
    """Let the job end at a known step, then check everything the soak promises."""
    doc = soak.status()
    deadline = time.monotonic() + 5.0  # /metrics shows what the coordinator published at its last heartbeat
    while (counted := restarts_on_metrics(soak, soak.leader())) != doc["restarts_by_reason"] and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    if counted != doc["restarts_by_reason"]:
        soak.violations.append(f"/metrics counts restarts {counted}, status {doc['restarts_by_reason']}")
    target = soak.furthest(doc) + 50
    soak.target_file.write_text(str(target))
    for node in NODES:
        if (code := soak.ended(node, timeout=RECOVERY_TIMEOUT)) != 0:
            soak.violations.append(f"agent {node} exited {code} at the end, not 0")
    ends = [e for e in read_events(soak.events) if e["event"] == "end"]
    expected = chain(target)
    if not ends or any((e["step"], e["digest"]) != (target, expected) for e in ends):
        soak.violations.append(f"the job did not end at step {target} with the chain's digest: {ends}")
    events = read_events(soak.events)
    soak.ledger = check_ledger(soak.etcd.url, soak.events, target, STEP_SECONDS)
    soak.torn_restores = sum(1 for e in events if e["event"] == "start" and e["torn"])
    soak.violations += stale_saves(events)
    if late := sorted({e["generation"] for e in events if e["event"] == "start"
                       and e["generation"] > soak.settled_generation}):  # on the way to the target, too
        soak.violations.append(uncaused(late))
    documented = {int(code) for code in ExitCode}
    for node, code in soak.exits:
        if code not in documented:
            soak.violations.append(f"agent {node} exited {code}, which is not a documented exit code")
    if (left := [p for p in processes_of(str(soak.tmp)) if p.name() != "etcd"]):
        soak.violations.append(f"processes left: {[(p.pid, p.name()) for p in left]}")
        for p in left:
            p.kill()


def stale_saves(events: list[dict[str, Any]]) -> list[str]:
    """Checkpoints written by a worker of an older generation after a newer generation had started: a stale
    worker that went on training (the digest alone cannot tell: its state is a valid one)."""
    newest, problems = 0, []
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] == "start":
            newest = max(newest, e["generation"])
        elif e["event"] == "saved" and e["generation"] < newest:
            problems.append(f"generation {e['generation']} saved step {e['step']} after generation {newest} had "
                            "started")
    return problems


def run(faults: int, seed: int, tmp: Path, netns: bool, only: tuple[str, ...] = (),
        stall_timeout: str = STALL_TIMEOUT) -> int:
    if not netns:
        return run_soak(faults, seed, tmp, Hosts(netns=False), only, stall_timeout)
    subprocess.run(["bash", str(NETNS), "down", str(len(NODES))], env=NETNS_ENV, capture_output=True)
    try:
        subprocess.run(["bash", str(NETNS), "up", str(len(NODES))], env=NETNS_ENV, check=True)
        subprocess.run(["ip", "addr", "add", f"{SUBNET}.254/24", "dev", f"{PREFIX}br0"], check=True)
        return run_soak(faults, seed, tmp, Hosts(netns=True), only, stall_timeout)
    finally:
        subprocess.run(["bash", str(NETNS), "down", str(len(NODES))], env=NETNS_ENV, check=True)


def run_soak(faults: int, seed: int, tmp: Path, hosts: Hosts, only: tuple[str, ...] = (),
             stall_timeout: str = STALL_TIMEOUT) -> int:
    rng = random.Random(seed)
    (tmp / "etcd").mkdir()
    etcd = EtcdCluster(tmp / "etcd", size=1, hosts=[f"{SUBNET}.254"] if hosts.netns else []).start()
    mounted = os.geteuid() == 0
    (tmp / "backup").mkdir()
    if mounted:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={BACKUP_MIB}m", "tfelastic-chaos", str(tmp / "backup")],
                       check=True)
    kinds = tuple(k for k in KINDS if k != "full_backup" or mounted) + (("partition",) if hosts.netns else ())
    kinds = tuple(k for k in kinds if k in only) if only else kinds
    soak = Soak(tmp, etcd, rng, hosts, stall_timeout)
    results: list[Result] = []
    try:
        for node in NODES:
            soak.start(node)
        soak.settled_generation = soak.wait(soak.training(0), "three members training")["generation"]
        last_strike = 0.0
        for i, kind in enumerate(schedule(rng, faults, kinds), 1):
            result = inject(soak, kind, last_strike)
            if kind in STRIKES:
                last_strike = time.monotonic()
            results.append(result)
            print(f"{i:4d} {kind:16s} {result.node}  recovered in {result.seconds:6.2f}s  restarts "
                  f"{dict(result.restarts)}", flush=True)
            if soak.violations:
                break
        if not soak.violations:
            finish(soak)
    except AssertionError as e:  # a wait that ran out: the job did not recover
        soak.violations.append(str(e))
    finally:
        soak.cluster.stop()
        etcd.stop()
        if mounted:
            subprocess.run(["umount", "-l", str(tmp / "backup")], check=False)
    report(results, soak)
    return 1 if soak.violations else 0


def report(results: list[Result], soak: Soak) -> None:
    print(f"\n{len(results)} faults; torn checkpoints skipped at restore: {soak.torn_restores}")
    by_kind: dict[str, list[float]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r.seconds)
    for kind, times in sorted(by_kind.items()):
        print(f"  {kind:16s} n={len(times):3d}  recovery median {statistics.median(times):6.2f}s  "
              f"max {max(times):6.2f}s")
    total = sum((r.restarts for r in results), Counter())
    print(f"restarts: {dict(sorted(total.items()))}")
    for line in soak.ledger.lines() if soak.ledger is not None else ["goodput ledger: not read"]:
        print(line)
    # Not a violation (the agent still exits with its code), but a hang on the way out that the bound cut short.
    bounded = [line for agent in soak.agents.values() for line in agent.log().splitlines()
               if any(mark in line for mark in BOUNDED_EXIT)]
    print(f"exits cut short by their bound: {len(bounded)}" + "".join(f"\n  {line[:300]}" for line in bounded))
    print("violations: none" if not soak.violations else "VIOLATIONS:\n  " + "\n  ".join(soak.violations))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--netns", action="store_true", help="three hosts in network namespaces (root), with "
                        "partitions among the faults")
    parser.add_argument("--kinds", default="", help="only these kinds, comma-separated (default: every kind)")
    parser.add_argument("--keep", default="", help="keep the job's files (logs) in this directory")
    parser.add_argument("--stall-timeout", default=STALL_TIMEOUT, help="'learned': the agents' default hang "
                        "detection (a limit learned from the step times, floor 5 s), or a fixed --stall-timeout in "
                        "seconds: a false stall restart is a violation either way")
    args = parser.parse_args()
    if args.stall_timeout != "learned" and not args.stall_timeout.replace(".", "", 1).isdigit():
        parser.error(f"--stall-timeout {args.stall_timeout!r}: a number of seconds, or 'learned'")
    only = tuple(k for k in args.kinds.split(",") if k)
    if unknown := set(only) - set(KINDS) - {"partition"}:
        parser.error(f"--kinds: unknown {sorted(unknown)}; the kinds are {', '.join(KINDS)}, partition")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        sys.exit(run(args.faults, args.seed, Path(tempfile.mkdtemp(dir=args.keep)), args.netns, only,
                     args.stall_timeout))
    with tempfile.TemporaryDirectory() as d:
        sys.exit(run(args.faults, args.seed, Path(d), args.netns, only, args.stall_timeout))


if __name__ == "__main__":
    main()
