"""systemd/tfelastic@.service under a real systemd.

tests/hermetic-systemd.sh boots systemd as PID 1 of private namespaces, with a private /run, /tmp, /var/log, /srv
and overlays over /etc and /var/lib, so nothing of the host changes (the fixture checks it, and removes the empty
control groups the units leave in the shared cgroup tree). systemd/install.sh runs inside it: the unit, the
``tfelastic`` user and /etc/tfelastic are the installed ones. A drop-in adds only what this machine needs (the
Python interpreter lives under /root, which ProtectHome= hides; /srv/tfe plays the shared storage, as
ReadWritePaths= does for a real backup_dir) and a short watchdog. Jobs run tests/trainers/counter.py; the test
reads their events and checkpoints through /proc/PID/root.

Inactive units are garbage-collected by systemd, and their properties with them, so how a run ended is read from
the journal (systemd's own lines, and the agent's), and live properties (NRestarts, MainPID) while a unit runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
from tfelastic.daemon.exit_codes import EX_CONFIG

from tests.cluster import COUNTER, ROOT, wait_for
from tests.ports import free_port

HERMETIC = ROOT / "tests" / "hermetic-systemd.sh"
# The checkout and the interpreter's environment stay visible inside, wherever they are (a clone under /tmp).
KEEP = ":".join(sorted({str(ROOT), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}))
UNIT = ROOT / "systemd" / "tfelastic@.service"
COORDINATOR_UNIT = ROOT / "systemd" / "tfelastic-coordinator@.service"
INSTALL = ROOT / "systemd" / "install.sh"
SYSTEMD = Path("/lib/systemd/systemd")
STORAGE = "/srv/tfe"  # the jobs' "shared storage", a tmpfs inside the namespaces
WATCHDOG_SECONDS = 4  # the unit ships 30 s; the mechanism is the same
START_TIMEOUT = 4  # the unit ships 90 s

pytestmark = [pytest.mark.integration, pytest.mark.systemd]


class Hermetic:
    """A systemd booted by tests/hermetic-systemd.sh, driven from the host."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.root = Path(f"/proc/{pid}/root")  # the namespaces' view of the file system

    def run(self, *command: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["bash", str(HERMETIC), "exec", str(self.pid), *command], capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{command} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def popen(self, *command: str) -> subprocess.Popen[str]:
        return subprocess.Popen(["bash", str(HERMETIC), "exec", str(self.pid), *command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def show(self, unit: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, "-p",
                       "ActiveState,SubState,Result,NRestarts,MainPID,ExecMainStatus,StatusText,"
                       "WatchdogTimestampMonotonic").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, *args: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, *args).stdout

    def wait_journal(self, unit: str, text: str, timeout: float = 30) -> str:
        return str(wait_for(lambda: text in (j := self.journal(unit)) and j, timeout, f"{text!r} in {unit}'s log"))

    def mkdir_for_agent(self, path: str) -> None:
        self.run("install", "-d", "-o", "tfelastic", "-g", "tfelastic", "-m", "0750", path)

    def write(self, path: str, text: str) -> None:
        target = self.root / path.lstrip("/")
        target.write_text(text)
        self.run("chgrp", "tfelastic", path)
        target.chmod(0o640)

    def kill(self, pid: str, sig: signal.Signals) -> None:
        self.run("kill", f"-{sig.name[3:]}", pid)


def _dropin(*lines: str) -> str:
    """What this machine needs beyond an installed unit: the interpreter, its environment and the checkout stay
    visible to the service, wherever they are."""
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)} | {str(ROOT)}
    in_home = sorted(p for p in needed if p.startswith(("/root/", "/home/", "/run/user/")))
    in_tmp = sorted(p for p in needed if p.startswith(("/tmp/", "/var/tmp/")))
    if in_home:  # e.g. pyenv under /root: ProtectHome=yes would hide the interpreter
        lines += ("ProtectHome=tmpfs", *(f"BindReadOnlyPaths={p}" for p in in_home))
    # A clone under /tmp: PrivateTmp=yes gives the service an empty /tmp; bound into it, the checkout and its
    # virtual environment are there again (the rest of /tmp stays private).
    lines += tuple(f"BindReadOnlyPaths={p}" for p in in_tmp)
    return "\n".join(["[Service]", *lines]) + "\n"


@pytest.fixture(scope="module")
def systemd_ns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hermetic]:
    if os.geteuid() != 0:
        pytest.skip("booting a hermetic systemd needs root")
    if not SYSTEMD.exists() or shutil.which("nsenter") is None:
        pytest.skip("needs systemd (/lib/systemd/systemd; Debian: apt-get install systemd) and nsenter")
    boot_log = tmp_path_factory.mktemp("systemd") / "boot.log"
    host_paths = {p: p.exists() for p in map(Path, ("/etc/tfelastic", "/var/lib/tfelastic", "/srv/tfe"))}
    cgroups_before = set(_unit_cgroups())
    started = subprocess.run(["bash", str(HERMETIC), "start"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "HERMETIC_LOG": str(boot_log), "HERMETIC_KEEP": KEEP})
    assert started.returncode == 0, started.stderr + boot_log.read_text()
    ns = Hermetic(int(started.stdout.strip()))
    try:
        ns.run("bash", str(INSTALL), "--prefix", sys.prefix)
        for unit, dropin in (("tfelastic@", _dropin(f"ReadWritePaths={STORAGE}", f"WatchdogSec={WATCHDOG_SECONDS}s")),
                             ("tfelastic-coordinator@", _dropin(f"WatchdogSec={WATCHDOG_SECONDS}s"))):
            dropins = ns.root / f"etc/systemd/system/{unit}.service.d"
            dropins.mkdir()
            (dropins / "test.conf").write_text(dropin)
        ns.run("systemctl", "daemon-reload")
        ns.run("install", "-d", "-m", "0755", STORAGE)  # /srv is a private tmpfs
        yield ns
    finally:
        subprocess.run(["bash", str(HERMETIC), "stop", str(ns.pid)], check=False)
        _remove_cgroups(set(_unit_cgroups()) - cgroups_before)
    assert {p: p.exists() for p in host_paths} == host_paths, "the hermetic systemd wrote to the host"


def _unit_cgroups() -> list[Path]:
    """The control groups our units got: the namespaces share the host's cgroup tree (no cgroup namespace)."""
    root = Path("/sys/fs/cgroup")
    slices = [*root.glob("system.slice/system-tfelastic.slice"), *root.glob("*/system.slice/system-tfelastic.slice")]
    return [d for s in slices for d in (s, *s.rglob("*")) if d.is_dir()]


def _remove_cgroups(created: set[Path]) -> None:
    """Empty control groups are left behind when the namespaces' systemd dies; remove ours, deepest first."""
    for cgroup in sorted(created, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            cgroup.rmdir()


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, numbers, lists of strings: JSON and TOML agree


def job_file(job: str, node: str, port: int, env: Mapping[str, str], **job_keys: Any) -> str:
    sections = {
        "job": {"name": job, "command": ["/bin/sh", "-c", f"echo hello from the trainer; exec {sys.executable} "
                                                          f"{COUNTER}"],
                "backup_dir": f"{STORAGE}/{job}/backup", "env": {"COUNTER_EVENTS": f"{STORAGE}/{job}/events.jsonl",
                                                                 **env}, **job_keys},
        "node": {"id": node},
        "rendezvous": {"endpoint": f"127.0.0.1:{port}"},
        "metrics": {"port": 0, "linger": 0},  # several agents on one host; exits without waiting for a scrape
    }
    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
                     for name, keys in sections.items())


class Job:
    """One job: its files on the "shared storage", and the instances (one per node) that run it."""

    def __init__(self, ns: Hermetic, port: int, **env: str) -> None:
        self.ns, self.port, self.env = ns, port, env
        self.name = f"sd-{uuid.uuid4().hex[:8]}"
        ns.mkdir_for_agent(f"{STORAGE}/{self.name}")

    def add_node(self, node: str, **job_keys: Any) -> str:
        """Writes /etc/tfelastic/NODE.toml and returns the unit; the instance name is the node id here."""
        self.ns.write(f"/etc/tfelastic/{node}.toml", job_file(self.name, node, self.port, self.env, **job_keys))
        return f"tfelastic@{node}.service"

    def node_name(self) -> str:
        return f"{self.name}-n{uuid.uuid4().hex[:4]}"

    def events(self) -> list[dict[str, Any]]:
        path = self.ns.root / STORAGE.lstrip("/") / self.name / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def checkpoint(self) -> int:
        path = self.ns.root / STORAGE.lstrip("/") / self.name / "backup" / "step"
        return int(path.read_text() or 0) if path.exists() else 0


def unit_processes(node: str) -> list[psutil.Process]:
    """Live processes of one instance: its agent (by its config path) and its workers (by their node id)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ", "status"]):
        try:
            mine = f"/etc/tfelastic/{node}.toml" in (p.info["cmdline"] or []) or \
                (p.info["environ"] or {}).get("TFELASTIC_NODE_ID") == node
            if mine and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[int]:
    """A standalone coordinator on the host (the hermetic systemd shares its network): units on "other nodes"
    rejoin it, as they would a head node's."""
    port = free_port()
    log = tmp_path / "coordinator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen",
                                 f"127.0.0.1:{port}", "--settle", "0.5", "--last-call", "0.2", "--metrics-port",
                                 "off"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "listening on" in log.read_text(), 30, "the coordinator")
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("unit", "most"), [(UNIT, 5.0), (COORDINATOR_UNIT, 2.0)], ids=["agent", "coordinator"])
def test_hardening_score(unit: Path, most: float) -> None:
    """The agent's unit runs the trainer, which needs GPUs, shared storage and whatever the user's code does; the
    coordinator only serves gRPC, and is held to a stricter score."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                         text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= most, out.stdout


def test_install_is_idempotent_and_keeps_configs(systemd_ns: Hermetic) -> None:
    ns = systemd_ns
    example = ns.root / "etc/tfelastic/example.toml"
    example.write_text(example.read_text() + "# edited by the operator\n")
    again = ns.run("bash", str(INSTALL), "--prefix", sys.prefix).stdout
    assert "kept /etc/tfelastic/example.toml" in again
    assert example.read_text().endswith("# edited by the operator\n")
    assert "created system user" not in again
    assert ns.run("id", "-u", "tfelastic").stdout.strip().isdigit()
    unit = (ns.root / "etc/systemd/system/tfelastic@.service").read_text()
    assert f"ExecStart={sys.prefix}/bin/tfelastic agent --config /etc/tfelastic/%i.toml" in unit
    coordinator = (ns.root / "etc/systemd/system/tfelastic-coordinator@.service").read_text()
    assert f"ExecStart={sys.prefix}/bin/tfelastic coordinator --config /etc/tfelastic/%i.toml" in coordinator
    ns.run("systemd-analyze", "verify", "tfelastic@example.service", "tfelastic-coordinator@example.service")


def _may_raise_limits() -> bool:
    """Whether this machine lets systemd raise a hard resource limit (CAP_SYS_RESOURCE: a container may lack it)."""
    status = Path("/proc/self/status").read_text()
    effective = int(re.search(r"CapEff:\s*([0-9a-f]+)", status).group(1), 16)  # type: ignore[union-attr]
    return bool(effective >> CAP_SYS_RESOURCE & 1)


CAP_SYS_RESOURCE = 24


def test_job_runs_to_success_with_job_node_and_rank_in_the_journal(systemd_ns: Hermetic) -> None:
    ns = systemd_ns
    job = Job(ns, free_port(), COUNTER_STEPS="40")
    node = job.node_name()
    unit = job.add_node(node)
    ns.run("systemctl", "start", unit)  # returns once READY=1 came: the coordinator took the agent in
    assert ns.show(unit)["NRestarts"] == "0"
    log = ns.wait_journal(unit, "Deactivated successfully")  # systemd: exit 0, not restarted
    assert "Scheduled restart job" not in log
    assert f"INFO tfelastic[{job.name}/{node}] tfelastic.agent: job succeeded" in log
    assert "[rank 0] hello from the trainer" in log
    if _may_raise_limits():  # LimitNICE=-5: the unprivileged agent runs ahead of its trainer
        assert "CPU priority: the agent runs at nice -5, the processes it starts at 0" in log
    else:  # systemd cannot raise the hard limit here: the agent says what it needs
        assert "running ahead of them at -5 was refused (Permission denied; RLIMIT_NICE allows down to 20)" in log
    assert [e["step"] for e in job.events() if e["event"] == "end"] == [40]
    assert [e["nice"] for e in job.events() if e["event"] == "start"] == [0]
    fields = ns.run("journalctl", "--no-pager", "-o", "json", "-u", unit, "-n", "1", f"JOB={node}").stdout
    assert json.loads(fields)["SYSLOG_IDENTIFIER"] == "tfelastic"  # LogExtraFields=JOB=%i
    assert not unit_processes(node)


def test_the_coordinator_unit_serves_the_job_from_the_same_job_file(systemd_ns: Hermetic) -> None:
    """A head node: tfelastic-coordinator@JOB reads the job file the agents read and serves its rendezvous
    endpoint. `systemctl start` returns once it listens (READY=1); it ends, exit 0, when the job has succeeded."""
    ns = systemd_ns
    job = Job(ns, free_port(), COUNTER_STEPS="40")
    node = job.node_name()
    unit = job.add_node(node)
    head = f"tfelastic-coordinator@{node}.service"
    ns.run("systemctl", "start", head)
    state = ns.show(head)
    assert (state["ActiveState"], state["StatusText"]) == (
        "active", f"job {job.name}: listening on 127.0.0.1:{job.port}"), state
    ns.run("systemctl", "start", unit)
    ns.wait_journal(unit, "Deactivated successfully")
    log = ns.wait_journal(head, "Deactivated successfully")  # the job is over: exit 0, no restart
    assert f"coordinator of job {job.name}" in log and "Scheduled restart job" not in log, log
    assert "Watchdog timeout" not in log  # a healthy coordinator pings, through the job and its end
    assert "hosting the coordinator" not in ns.journal(unit)  # the agent joined the head node's
    assert [e["step"] for e in job.events() if e["event"] == "end"] == [40]


def test_start_returns_only_once_the_agent_is_in_a_rendezvous(systemd_ns: Hermetic) -> None:
    """READY=1 means: the coordinator answered this agent's Join. While nothing it can join exists (here a
    plain TCP listener holds the rendezvous port, so the agent can neither host the coordinator nor reach one),
    the unit stays "activating" and `systemctl start` blocks, beyond TimeoutStartSec=: the healthy agent extends
    it."""
    ns = systemd_ns
    squatter = socket.create_server(("127.0.0.1", 0))
    job = Job(ns, squatter.getsockname()[1], COUNTER_STEPS="100000")
    node = job.node_name()
    unit = job.add_node(node)
    (ns.root / f"etc/systemd/system/{unit}.d").mkdir()
    (ns.root / f"etc/systemd/system/{unit}.d/start.conf").write_text(f"[Service]\nTimeoutStartSec={START_TIMEOUT}s\n")
    ns.run("systemctl", "daemon-reload")
    attempts = _count_connections(squatter)
    start = ns.popen("systemctl", "start", unit)
    started = time.monotonic()
    try:
        wait_for(lambda: len(attempts) >= 2 and time.monotonic() - started > START_TIMEOUT + 1, 60,
                 "two connection attempts of the agent, and TimeoutStartSec= to pass")
        assert start.poll() is None, start.communicate()
        assert ns.show(unit)["ActiveState"] == "activating"
    finally:
        squatter.close()  # now the agent hosts the coordinator itself, joins it, and is ready
    assert start.wait(60) == 0, start.communicate()
    state = ns.show(unit)
    assert state["ActiveState"] == "active", state
    statuses = ("waiting in rendezvous", "launching generation", "running generation")
    assert state["StatusText"].startswith(statuses), state
    warnings = ns.journal(unit, "-p", "warning")  # the agent's log levels reach journald as priorities
    assert "lost the coordinator" in warnings and " INFO " not in warnings
    ns.run("systemctl", "stop", unit)
    assert not unit_processes(node)


def _count_connections(server: socket.socket) -> list[int]:
    accepted: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return accepted


def test_sigkilled_agent_is_restarted_and_rejoins(systemd_ns: Hermetic, coordinator: int) -> None:
    ns = systemd_ns
    job = Job(ns, coordinator, COUNTER_STEPS="150", COUNTER_STEP_SECONDS="0.05")
    node = job.node_name()
    unit = job.add_node(node)
    ns.run("systemctl", "start", unit)
    wait_for(lambda: job.checkpoint() >= 5, 30, "training")
    first = ns.show(unit)
    ns.kill(first["MainPID"], signal.SIGKILL)
    wait_for(lambda: (s := ns.show(unit))["NRestarts"] == "1" and s["ActiveState"] == "active", 60,
             "systemd to restart the agent, and the agent to rejoin (READY)")
    starts = wait_for(lambda: [e for e in job.events() if e["event"] == "start" and e["generation"] > 1], 30,
                      "a worker of the rejoined agent")
    assert starts[0]["step"] > 0 and starts[0]["restart_count"] >= 1  # the same job, resumed
    assert starts[0]["stale"] == []  # no worker outlived the killed agent
    log = ns.wait_journal(unit, "Deactivated successfully", timeout=60)
    assert "Main process exited, code=killed, status=9/KILL" in log
    assert "Watchdog timeout" not in log  # a healthy agent pings
    assert [e["step"] for e in job.events() if e["event"] == "end"] == [150]


def test_watchdog_restarts_a_wedged_agent(systemd_ns: Hermetic, coordinator: int) -> None:
    ns = systemd_ns
    job = Job(ns, coordinator, COUNTER_STEPS="100000")
    node = job.node_name()
    unit = job.add_node(node)
    ns.run("systemctl", "start", unit)
    wedged = ns.show(unit)["MainPID"]
    ns.kill(wedged, signal.SIGSTOP)
    wait_for(lambda: (s := ns.show(unit))["NRestarts"] == "1" and s["ActiveState"] == "active", 60,
             "the watchdog to catch the stopped agent, and the new agent to rejoin")
    assert ns.show(unit)["MainPID"] != wedged
    log = ns.journal(unit)
    assert f"Watchdog timeout (limit {WATCHDOG_SECONDS}s)!" in log
    assert "Fatal Python error: Aborted" in log  # SIGABRT: faulthandler printed where the agent was
    ns.run("systemctl", "stop", unit)
    assert not unit_processes(node)


def test_watchdog_restarts_a_wedged_coordinator(systemd_ns: Hermetic) -> None:
    """The coordinator's unit has a watchdog as the agent's has: a coordinator whose loop no longer turns is
    killed with its stacks in the journal and started again, and serves the job's endpoint again."""
    ns = systemd_ns
    job = Job(ns, free_port())
    node = job.node_name()
    job.add_node(node)  # the job file, which the coordinator reads; no agent
    head = f"tfelastic-coordinator@{node}.service"
    ns.run("systemctl", "start", head)
    first = ns.show(head)
    # systemd records each ping: a healthy coordinator pings while it serves (the unhealthy one would not)
    def pinged(state: dict[str, str]) -> bool:
        return state["WatchdogTimestampMonotonic"] != first["WatchdogTimestampMonotonic"] and \
            (state["MainPID"], state["NRestarts"], state["ActiveState"]) == (first["MainPID"], "0", "active")

    wait_for(lambda: pinged(ns.show(head)), WATCHDOG_SECONDS * 2, "a watchdog ping of the serving coordinator")
    wedged = first["MainPID"]
    ns.kill(wedged, signal.SIGSTOP)
    wait_for(lambda: (s := ns.show(head))["NRestarts"] == "1" and s["ActiveState"] == "active", 60,
             "the watchdog to catch the stopped coordinator, and systemd to start it again (READY)")
    state = ns.show(head)
    assert state["MainPID"] != wedged
    assert state["StatusText"] == f"job {job.name}: listening on 127.0.0.1:{job.port}", state
    log = ns.journal(head)
    assert f"Watchdog timeout (limit {WATCHDOG_SECONDS}s)!" in log, log
    assert "Fatal Python error: Aborted" in log, log  # SIGABRT: faulthandler printed where it was
    ns.run("systemctl", "stop", head)


@pytest.mark.parametrize(("job_keys", "message"), [
    ({"nmae": "typo"}, "unknown key job.nmae"),
    ({"backup_dir": "/opt/tfelastic-ckpt"}, "cannot be written by this user"),  # not in ReadWritePaths=
], ids=["unknown-key", "read-only-backup-dir"])
def test_bad_config_fails_once_with_its_message(systemd_ns: Hermetic, job_keys: dict[str, str], message: str) -> None:
    ns = systemd_ns
    job = Job(ns, free_port())
    node = job.node_name()
    unit = job.add_node(node, **job_keys)
    assert ns.run("systemctl", "start", unit, check=False).returncode != 0
    state = ns.show(unit)  # a failed unit stays loaded
    assert (state["ActiveState"], state["SubState"], state["Result"]) == ("failed", "failed", "exit-code"), state
    assert state["ExecMainStatus"] == str(EX_CONFIG) and state["NRestarts"] == "0"  # no auto-restart pending
    log = ns.journal(unit)
    assert "tfelastic: configuration error:" in log and message in log
    ns.run("systemctl", "reset-failed", unit)


def test_stop_drains_the_node_and_the_other_node_reforms_without_lost_steps(
        systemd_ns: Hermetic, coordinator: int) -> None:
    """Two nodes, each a unit. `systemctl stop` on the chief's node: its trainer checkpoints on SIGTERM and
    exits 42, the agent leaves, and the other node re-forms alone and resumes exactly where the chief stopped.
    The counter checkpoints only on SIGTERM here, so any lost step would show."""
    ns = systemd_ns
    job = Job(ns, coordinator, COUNTER_STEPS="300", COUNTER_STEP_SECONDS="0.03", COUNTER_SAVE_EVERY="1000000",
              COUNTER_CHECKPOINT_ON_TERM="1")
    first, second = job.node_name(), job.node_name()
    units = [job.add_node(n, min_nodes=1, max_nodes=2) for n in (first, second)]
    ns.run("systemctl", "start", units[0])
    wait_for(lambda: job.events(), 30, "the first node's worker")
    ns.run("systemctl", "start", units[1])
    wait_for(lambda: {e["rank"] for e in job.events() if e["event"] == "start" and e["world_size"] == 2} == {0, 1},
             30, "both nodes training together")  # a started counter checkpoints on SIGTERM
    ns.run("systemctl", "stop", units[0])  # returns when the drain is over
    assert not unit_processes(first)
    log = ns.wait_journal(units[0], "Deactivated successfully")
    assert "Failed with result" not in log and "Watchdog timeout" not in log
    rejoined = wait_for(lambda: [e for e in job.events() if e["event"] == "start" and e["world_size"] == 1
                                 and e["generation"] > 2], 30, "the second node re-formed alone")
    assert rejoined[0]["rank"] == 0
    ns.wait_journal(units[1], "Deactivated successfully", timeout=60)  # it finished the job: exit 0
    events = job.events()
    for generation in sorted({e["generation"] for e in events})[1:]:
        chief_stopped = [e["step"] for e in events if e["event"] == "checkpointed" and e["rank"] == 0
                         and e["generation"] == generation - 1]
        resumed = [e["step"] for e in events if e["event"] == "start" and e["rank"] == 0
                   and e["generation"] == generation]
        assert chief_stopped == resumed and resumed[0] > 0, (generation, events)
    assert [e["step"] for e in events if e["event"] == "end"] == [300]


def test_a_checkout_under_tmp_stays_visible_inside(tmp_path: Path) -> None:
    """A clone under /tmp: the hermetic systemd's private /tmp would hide it (and `systemd/install.sh` with it)
    unless the script keeps it (HERMETIC_KEEP)."""
    if os.geteuid() != 0 or not SYSTEMD.exists() or shutil.which("nsenter") is None:
        pytest.skip("booting a hermetic systemd needs root, systemd and nsenter")
    clone = Path(tempfile.mkdtemp(prefix="tfelastic-clone-", dir="/tmp"))
    try:
        (clone / "systemd").mkdir()
        (clone / "systemd" / "install.sh").write_text("echo installed\n")
        started = subprocess.run(["bash", str(HERMETIC), "start"], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "HERMETIC_KEEP": f"{clone}:{KEEP}",
                                      "HERMETIC_LOG": str(tmp_path / "boot.log")})
        assert started.returncode == 0, started.stderr
        ns = Hermetic(int(started.stdout.strip()))
        try:
            assert ns.run("bash", str(clone / "systemd" / "install.sh")).stdout == "installed\n"
            # The rest of /tmp stays private: only the kept paths are there (the suite's own, for a clone under /tmp)
            kept = {Path(p).relative_to("/tmp").parts[0] for p in KEEP.split(":") if p.startswith("/tmp/")}
            assert sorted(ns.run("ls", "-A", "/tmp").stdout.split()) == sorted({clone.name} | kept)
        finally:
            subprocess.run(["bash", str(HERMETIC), "stop", str(ns.pid)], check=False)
    finally:
        shutil.rmtree(clone)
