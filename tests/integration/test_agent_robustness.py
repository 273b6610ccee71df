"""What careless operators and failing trainers do to real agents: a terminal closed under
`tfelastic run`, a working directory that disappears, a trainer that raises at once, output lost in a buffer,
agents started by hand a second apart. Real agents, real gRPC, the counter trainer (no TensorFlow)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tfelastic.daemon.worker.priority import AGENT_LEAD

from tests.cluster import COUNTER, FORM_WITH_ALL, members, wait_for
from tests.conftest import ClusterFactory

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stop-grace", "2", "--last-call", "0.5", "--settle", "1"]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT], ids=["SIGHUP", "SIGQUIT"])
def test_a_hangup_or_quit_leaves_the_job_cleanly(make_cluster: ClusterFactory, sig: signal.Signals) -> None:
    """Closing the terminal of `tfelastic run` (SIGHUP), or Ctrl-\\ (SIGQUIT): a planned leave, like SIGTERM."""
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, *FORM_WITH_ALL], env={"COUNTER_STEPS": "200"})
    cluster.start_host("a")
    other = cluster.start("b")
    leaving = cluster.start("c")
    cluster.wait_running(1, 3, step=5)
    other.proc.send_signal(signal.SIGUSR1)  # not a reason to leave: logged and ignored
    leaving.proc.send_signal(sig)
    assert leaving.wait(30) == 0, leaving.log()
    doc = cluster.wait_running(2, 2)
    assert doc["restarts_by_reason"] == {"node_left": 1}
    assert f"agent stopped ({sig.name})" in leaving.log() and "node c leaves" in cluster.logs()
    assert other.proc.poll() is None, other.log()
    assert "SIGUSR1" in other.log()
    assert re.search(r"where the agent waits:\n.*task .*_run_sessions", other.log(), re.S), other.log()


def test_a_launch_failure_is_reported_as_such_with_backoff(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """The working directory disappears under a running job: every relaunch fails before the trainer runs. That is
    a failure of the worker, named, with a growing delay between attempts; not a lost node every 0.2 s."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    # The chief fails at step 60 (3 s in): several heartbeats after both ranks report step 2, so that status sees
    # generation 1 running before it fails (at step 10 the failure came within one heartbeat of the start).
    cluster = make_cluster(TRAINER, extra_args=[*FAST, "--max-restarts", "3", "--workdir", str(workdir)],
                           env={"COUNTER_STEPS": "400", "COUNTER_FAIL_AT": "60"})
    cluster.start_host("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=2)
    shutil.rmtree(workdir)  # no relaunch after the chief's failure finds its working directory
    codes = cluster.wait_all(90)
    logs = cluster.logs()
    assert codes == [1, 1], logs
    assert "node_lost" not in logs, logs
    failed = re.search(r"job failed: restart budget exhausted.*", logs)
    assert failed and "cannot start the trainer: FileNotFoundError" in failed.group(0), logs
    waits = [float(m) for m in re.findall(r"backing off ([\d.]+)s before generation", logs)]
    assert len(waits) == 2 and waits[1] > waits[0] > 0, logs  # growing


@pytest.mark.quick
def test_a_failing_trainers_exception_is_the_reason(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, extra_args=[*FAST, "--max-restarts", "0"],
                           env={"COUNTER_STEPS": "50", "COUNTER_RAISE_AT": "3"})
    cluster.start_host("a")
    cluster.start("b")
    assert cluster.wait_all(60) == [1, 1], cluster.logs()
    lines = [line for line in cluster.logs().splitlines() if "job failed" in line]
    assert lines, cluster.logs()
    for line in lines:
        assert " ERROR " in line, line
        assert "trainer exited with code 1: ZeroDivisionError: float division by zero" in line, line


def test_python_trainers_print_as_they_go(make_cluster: ClusterFactory) -> None:
    """A custom loop's print must reach the log while it trains, not at exit, and not be lost to a kill."""
    cluster = make_cluster(TRAINER, nodes="1", env={"COUNTER_STEPS": "400", "COUNTER_PRINT": "1",
                                                    "PYTHONUNBUFFERED": None})
    agent = cluster.start_host("a")
    doc = cluster.wait_running(1, 1, step=5)
    wait_for(lambda: "counter step 3" in agent.log(), 20, "the trainer's printed lines in the agent's log")
    assert members(doc)[0]["step"] < 400  # still training: the lines came before the exit


def test_agents_started_seconds_apart_form_the_first_generation_together(make_cluster: ClusterFactory) -> None:
    """With a node range and no --last-call, the first formation waits for more nodes (it closes at once when
    max_nodes have joined): a second agent started by hand 2 s later does not cost a scale-up restart."""
    cluster = make_cluster(TRAINER, nodes="1:2", extra_args=["--stop-grace", "2"], env={"COUNTER_STEPS": "100"})
    cluster.start_host("a")
    time.sleep(2.0)  # the operator types the second command
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=2)
    assert doc["restarts_total"] == 0, doc
    assert cluster.wait_all(90) == [0, 0], cluster.logs()


def soft_open_files_limit(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if line.startswith("Max open files"))
    return int(line.split()[3])


def test_an_agent_started_under_a_low_ulimit_serves_thousands_of_idle_connections(
        make_cluster: ClusterFactory) -> None:
    """`ulimit -n 1024` in the shell that starts `tfelastic run`: the agent raises its soft limit to the hard one,
    so idle connections to the coordinator's port cannot starve `tfelastic status` of file descriptors."""
    cluster = make_cluster(TRAINER, nodes="1", env={"COUNTER_STEPS": "100000"})
    command = [sys.executable, "-m", "tfelastic.daemon", "run", "--nodes", "1", "--rendezvous", str(cluster.endpoint),
               "--node-id", "a", "--metrics-port", "0", "--backup-dir", str(cluster.tmp / "backup"), "--", *TRAINER]
    agent = cluster.launch("a", ["prlimit", "--nofile=256:8192", *command])
    wait_for(lambda: "hosting the coordinator" in agent.log(), 20, "the agent to host")
    assert soft_open_files_limit(agent.proc.pid) == 8192
    cluster.wait_running(1, 1, step=2)
    idle = [socket.create_connection((cluster.endpoint.host, cluster.endpoint.port), timeout=10) for _ in range(600)]
    try:
        doc = cluster.wait_status(lambda d: d["state"] == "running", 20, "status while 600 connections sit idle")
        assert doc["restarts_total"] == 0
    finally:
        for s in idle:
            s.close()


def test_a_flood_of_health_watches_takes_nothing_from_the_agents(make_cluster: ClusterFactory,
                                                                 tmp_path: Path) -> None:
    """Watch streams from a peer without the token, opened as fast as it can while the job trains and a new node
    joins: none is admitted, training goes on, and the scale-up happens."""
    token = tmp_path / "token"
    token.write_text("flood-secret\n")
    token.chmod(0o600)
    cluster = make_cluster(TRAINER, nodes="2:3", token="flood-secret",
                           extra_args=[*FAST, "--token-file", str(token)],
                           env={"COUNTER_STEPS": "100000"})
    cluster.start_host("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=2)
    outcomes: Counter[str] = Counter()
    flooding = threading.Event()
    flooding.set()

    def flood() -> None:
        with grpc.insecure_channel(str(cluster.endpoint)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while flooding.is_set() and time.monotonic() < deadline:
                stream = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
                try:
                    next(stream)
                    outcomes["admitted"] += 1
                except grpc.RpcError as e:
                    outcomes[e.code().name] += 1

    flooders = [threading.Thread(target=flood) for _ in range(4)]
    for thread in flooders:
        thread.start()
    try:
        cluster.start("c")
        doc = cluster.wait_running(2, 3, step=2, timeout=60)
    finally:
        flooding.clear()
        for thread in flooders:
            thread.join(60)
    assert doc["restarts_by_reason"] == {"scale_up": 1}
    assert outcomes["admitted"] == 0 and sum(outcomes.values()) > 20, outcomes


def test_a_generation_that_starts_below_a_saved_checkpoint_is_a_warning(make_cluster: ClusterFactory) -> None:
    """A backup deleted under a running job (tf_keras deletes its own when fit succeeds), then a failure: the next
    generation trains from step 0 although step 40 was saved. That must not pass in silence."""
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "80", "COUNTER_LOSE_BACKUP_AT": "40"})
    cluster.start_host("a")
    cluster.start("b")
    doc = cluster.wait_status(lambda d: d["steps_lost"] > 0, 60, "the steps lost to be counted")
    assert doc["warnings"] and "below the checkpoint of step" in doc["warnings"][0], doc
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    assert re.search(r"WARNING .*generation 2 resumed at step \d+, below the checkpoint of step 40", cluster.logs())


def test_an_agent_whose_exit_hangs_still_exits_with_the_code_it_decided() -> None:
    """The exit guard (exit_guard.py): the process decided on its exit code, and then its teardown hangs (here a
    thread that never ends, which interpreter exit waits for; in the chaos soak, a gRPC that went silent). It
    exits anyway, with that code, and the log says where each thread was."""
    script = textwrap.dedent("""
        import logging, threading
        from tfelastic.daemon.exit_guard import exit_within
        logging.basicConfig(level=logging.INFO)
        exit_within(0.5, 0, "tearing down")
        threading.Thread(target=threading.Event().wait, name="hung-teardown").start()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "decided to exit with code 0 but is still tearing down 0.5s later" in result.stderr, result.stderr
    assert "thread hung-teardown" in result.stderr, result.stderr


def test_trainers_that_saturate_every_core_cost_no_node(make_cluster: ClusterFactory) -> None:
    """Three agents on this machine, each trainer spinning one process per core for a minute while each agent's
    standby imports TensorFlow beside it: every agent keeps its heartbeats and its trainer's hang watch, so no
    node is lost, none fences itself and the job never restarts."""
    cluster = make_cluster(TRAINER, nodes="3", warm_start=True, extra_args=FORM_WITH_ALL,
                           env={"COUNTER_STEPS": "600", "COUNTER_STEP_SECONDS": "0.1", "COUNTER_BURN_SECONDS": "60"})
    agents = [cluster.start_host("a"), cluster.start("b"), cluster.start("c")]
    usual = os.getpriority(os.PRIO_PROCESS, 0)
    wait_for(lambda: all("CPU priority" in a.log() for a in agents), 30, "the agents' priorities")
    assert [psutil.Process(a.proc.pid).nice() for a in agents] == [max(-20, usual - AGENT_LEAD)] * 3  # as root
    codes = cluster.wait_all(300)
    logs = cluster.logs()
    assert codes == [0, 0, 0], logs
    assert {e["nice"] for e in cluster.events() if e["event"] == "start"} == {usual}, logs
    assert not re.search(r"node \S+ lost|no message from the coordinator|trainer stalled", logs), logs
    assert {e["generation"] for e in cluster.events() if e["event"] == "start"} == {1}, logs
    assert sum(e["event"] == "end" for e in cluster.events()) == 3, logs


def _memory_cgroup(limit_mb: int) -> Iterator[Path]:
    """A new memory cgroup with a limit (v2, or v1's memory hierarchy), removed afterwards; skips without one."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
    if "memory" in (v2 / "cgroup.subtree_control").read_text(errors="replace").split() \
            if (v2 / "cgroup.subtree_control").exists() else False:
        base, limit_file = v2, "memory.max"
    elif (v1 / "memory.limit_in_bytes").exists() and os.access(v1, os.W_OK):
        base, limit_file = v1, "memory.limit_in_bytes"
    else:
        pytest.skip("no writable memory cgroup here")
    group = base / f"tfelastic-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / limit_file).write_text(str(limit_mb << 20))
        yield group
    finally:
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 30, "the cgroup to empty")
        group.rmdir()


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    yield from _memory_cgroup(400)


def test_a_trainer_killed_by_the_kernels_oom_killer_is_recorded_as_out_of_memory(
        make_cluster: ClusterFactory, memory_cgroup: Path) -> None:
    """The agent and its trainer in a memory cgroup of 400 MB; the trainer eats memory until the kernel kills it:
    a SIGKILL with nothing printed, told from any other by the cgroup's count of OOM kills."""
    cluster = make_cluster(TRAINER, nodes="1", extra_args=[*FAST, "--max-restarts", "0"],
                           env={"COUNTER_STEPS": "100", "COUNTER_EAT_MEMORY_AT": "5"})
    enter = ["sh", "-c", f'echo $$ > {memory_cgroup / "cgroup.procs"} && exec "$@"', "sh"]
    agent = cluster.start("a", prefix=enter)
    assert agent.wait(120) == 1, agent.log()
    log = agent.log()
    assert re.search(r"trainer ran out of memory: was killed by SIGKILL \(the kernel's OOM killer: its memory "
                     r"cgroup counted the kill\) \(cause: out_of_memory\)", log), log
