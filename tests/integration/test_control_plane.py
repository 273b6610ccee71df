"""Real agents, real gRPC, real processes; the trainer is the counter (no TensorFlow), so these are quick."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import (
    COUNTER,
    FORM_WITH_ALL,
    alive,
    assert_no_stale_workers,
    fail_the_job_under,
    kill,
    members,
    trainer_pids,
    wait_for,
)
from tests.conftest import ClusterFactory
from tests.ports import free_port

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stall-timeout", "3", "--stop-grace", "2", "--last-call", "0.5", "--settle", "1"]


def starts(events: list[dict[str, Any]], generation: int) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "start" and e["generation"] == generation]


@pytest.mark.quick
def test_worker_exit_restarts_the_whole_set_and_resumes(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "60", "COUNTER_FAIL_AT": "20"})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    events = cluster.events()
    gen2 = starts(events, 2)
    assert {e["rank"] for e in gen2} == {0, 1}
    assert all(e["step"] >= 19 and e["restart_count"] == 1 for e in gen2), gen2  # resumed, not from 0
    assert [e["step"] for e in events if e["event"] == "end"] == [60, 60]
    assert_no_stale_workers(events)
    assert "trainer exited with code 3" in cluster.logs()


@pytest.mark.quick
def test_trainer_environment(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, env={"COUNTER_STEPS": "3"})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    gen1 = sorted(starts(cluster.events(), 1), key=lambda e: e["rank"])
    configs = [__import__("json").loads(e["tf_config"]) for e in gen1]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert configs[0]["cluster"] == configs[1]["cluster"] and len(configs[0]["cluster"]["worker"]) == 2
    assert all(e["legacy_keras"] == "1" and e["world_size"] == 2 for e in gen1)


@pytest.mark.parametrize("done_at", [None, 10], ids=["in-training", "in-a-second-fit"])
def test_stalled_worker_is_caught(make_cluster: ClusterFactory, done_at: int | None) -> None:
    """Also when the hang comes in training that follows a completed one (a second fit): it re-arms the check."""
    done = {"COUNTER_DONE_AT": str(done_at)} if done_at else {}
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "60", "COUNTER_HANG_AT": "15", **done})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    assert starts(cluster.events(), 2), "no second generation after the hang"
    assert "trainer stalled: no progress" in cluster.logs()
    assert f"hung in main ({COUNTER}:" in cluster.logs(), cluster.logs()  # its stacks: tfelastic.trainer registers
    assert_no_stale_workers(cluster.events())


def test_with_default_settings_a_live_hang_is_caught_by_the_learned_limit(make_cluster: ClusterFactory) -> None:
    """No --stall-timeout: the limit is learned from the steps (0.05 s each): the floor, 5 s, not 300 s."""
    cluster = make_cluster(TRAINER, extra_args=["--stop-grace", "2", "--last-call", "0.5", "--settle", "1"],
                           env={"COUNTER_STEPS": "80", "COUNTER_HANG_AT": "60"})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    assert starts(cluster.events(), 2), "no second generation after the hang"
    assert re.search(r"trainer stalled: no progress for \d\.\ds \(learned limit 5\.0s: 8 x the longest step gap "
                     r"0\.\d\ds, floor 5s\)", cluster.logs()), cluster.logs()
    assert cluster.logs().count("trainer stalled") == 1, cluster.logs()  # the hang; no false one after it
    assert_no_stale_workers(cluster.events())


def test_silence_after_training_completed_is_not_a_stall(make_cluster: ClusterFactory) -> None:
    """Evaluation or export after fit reports nothing: it must not be restarted as a hang."""
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "20", "COUNTER_LINGER_AFTER_DONE": "7"})
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    assert "trainer stalled" not in cluster.logs()
    assert [e["generation"] for e in cluster.events() if e["event"] == "start"] == [1, 1], cluster.events()


def test_sigstopped_worker_is_caught(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, extra_args=FAST, env={"COUNTER_STEPS": "80"})
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, step=10)
    victim = trainer_pids(doc)[0]  # the chief: counters do not wait for each other (see counter.py)
    kill(victim, signal.SIGSTOP)
    doc = cluster.wait_status(lambda d: d["restarts_by_reason"].get("stalled") == 1, 20, "a stall restart")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    assert not alive(victim)


def test_killed_agent_takes_its_worker_along_and_the_others_reform(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, *FORM_WITH_ALL], env={"COUNTER_STEPS": "100"})
    host = cluster.start_host("a")
    cluster.start("b")
    victim_agent = cluster.start("c")
    doc = cluster.wait_running(1, 3, step=5)
    victim_worker = next(n["worker_pid"] for n in members(doc) if n["node_id"] == "c")
    victim_agent.proc.send_signal(signal.SIGKILL)
    wait_for(lambda: not alive(victim_worker), 15, "the killed agent's worker to die")
    doc = cluster.wait_running(2, 2)
    assert doc["restarts_by_reason"] == {"node_lost": 1}
    assert [n["node_id"] for n in members(doc)] == ["a", "b"]
    assert host.wait(60) == 0, cluster.logs()
    assert_no_stale_workers(cluster.events())


@pytest.mark.quick
def test_sigterm_leaves_cleanly_and_is_not_a_failure(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, *FORM_WITH_ALL], env={"COUNTER_STEPS": "100"})
    cluster.start_host("a")
    cluster.start("b")
    leaving = cluster.start("c")
    doc = cluster.wait_running(1, 3, step=5)
    assert (doc["coordinator"]["node"], doc["coordinator"]["address"]) == ("a", str(cluster.endpoint))
    leaving.proc.send_signal(signal.SIGTERM)
    assert leaving.wait(20) == 0, leaving.log()
    doc = cluster.wait_running(2, 2)
    assert doc["restarts_by_reason"] == {"node_left": 1}
    assert "agent stopped (SIGTERM)" in cluster.logs()


def test_scale_up_when_a_node_joins_a_running_job(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=FAST, env={"COUNTER_STEPS": "120"})
    cluster.start("a")
    cluster.start("b")
    before = [n["node_id"] for n in members(cluster.wait_running(1, 2, step=10))]
    cluster.start("c")
    doc = cluster.wait_running(2, 3)
    assert doc["restarts_by_reason"] == {"scale_up": 1}
    assert [n["node_id"] for n in members(doc)] == [*before, "c"]  # the old ranks are kept
    assert cluster.wait_all(60) == [0, 0, 0], cluster.logs()
    gen2 = starts(cluster.events(), 2)
    assert len(gen2) == 3 and all(e["step"] >= 10 for e in gen2)


@pytest.mark.quick
def test_restart_budget_exhausted_fails_the_job(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster([sys.executable, "-c", "import sys; sys.exit(5)"],
                           extra_args=[*FAST, "--max-restarts", "2"])
    cluster.start("a")
    cluster.start("b")
    assert cluster.wait_all(60) == [1, 1], cluster.logs()
    assert "restart budget exhausted: 3 failures within 3600s exceed max_restarts=2" in cluster.logs()


def test_hosting_agent_dies_and_another_takes_over(make_cluster: ClusterFactory) -> None:
    """The new coordinator starts without the job's state, but the survivors' Joins name generation 1 and its
    three members: it re-forms once they are back, or a node timeout after the first (the killed host's member
    never comes back), not after the last call of a first formation (120 s here)."""
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*FAST, "--last-call", "120"],
                           env={"COUNTER_STEPS": "150"})
    host = cluster.start_host("a")
    cluster.start("b")
    cluster.start("c")
    cluster.wait_running(1, 3, step=5)
    host.proc.send_signal(signal.SIGKILL)
    doc = cluster.wait_running(2, 2, timeout=30)
    assert {n["node_id"] for n in members(doc)} == {"b", "c"}
    assert [a.wait(60) for a in cluster.agents[1:]] == [0, 0], cluster.logs()
    assert_no_stale_workers(cluster.events())


def test_job_waits_below_min_nodes(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2", extra_args=["--join-timeout", "60"], env={"COUNTER_STEPS": "3"})
    cluster.start("a")
    doc = cluster.wait_status(lambda d: d["state"] == "waiting" and len(d["nodes"]) == 1, 20, "a waiting round")
    assert doc["generation"] == 0
    cluster.start("b")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()


def test_join_timeout_fails_the_job(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2", extra_args=["--join-timeout", "1.5"])
    agent = cluster.start("a")
    assert agent.wait(30) == 1
    assert "only 1 of min_nodes=2 nodes joined within join_timeout=1.5s" in agent.log()


def test_different_job_settings_are_refused(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2", env={"COUNTER_STEPS": "3"})
    cluster.start("a")
    wait_for(lambda: cluster.status() is not None, 20, "the coordinator")
    odd = cluster.start("odd", extra=["--job", "other"])
    assert odd.wait(30) == 78
    assert "job: job has 'default', joining agent has 'other'" in odd.log()
    doc = cluster.status()
    assert doc is not None and [n["node_id"] for n in doc["nodes"]] == ["a"]


@pytest.mark.quick
def test_duplicate_node_id_is_refused(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2", env={"COUNTER_STEPS": "3"})
    cluster.start("a")
    wait_for(lambda: cluster.status() is not None, 20, "the coordinator")
    twin = cluster.start("a")
    assert twin.wait(30) == 78
    assert "node id 'a' is already in the job" in twin.log()


def test_user_setting_of_tf_use_legacy_keras_is_respected(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="1", env={"COUNTER_STEPS": "2", "TF_USE_LEGACY_KERAS": "0"})
    cluster.start("a")
    assert cluster.wait_all(60) == [0], cluster.logs()
    assert [e["legacy_keras"] for e in starts(cluster.events(), 1)] == ["0"]


def test_trainer_output_goes_to_the_agent_log_prefixed_with_the_rank(make_cluster: ClusterFactory) -> None:
    script = "import os; print('hello from', os.environ['TFELASTIC_NODE_ID'])"
    cluster = make_cluster([sys.executable, "-c", script], nodes="2")
    a, b = cluster.start("a"), cluster.start("b")
    assert cluster.wait_all(60) == [0, 0], cluster.logs()
    lines = [line for line in (a.log() + b.log()).splitlines() if "hello from" in line]
    assert sorted(line.split("tfelastic.worker: ")[1] for line in lines) in (
        ["[rank 0] hello from a", "[rank 1] hello from b"], ["[rank 0] hello from b", "[rank 1] hello from a"])


@pytest.mark.quick
def test_standalone_coordinator_and_agents_from_job_files(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster(TRAINER, nodes="2", env={"COUNTER_STEPS": "20"})
    coordinator = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen",
                                    str(cluster.endpoint), "--metrics-port", "0", "--metrics-linger", "0"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(cluster.status, 20, "the standalone coordinator")
        for stray in (signal.SIGUSR1, signal.SIGUSR2):  # an operator's question, a stray signal: neither ends it
            coordinator.send_signal(stray)
        for node in ("a", "b"):
            job = tmp_path / f"{node}.toml"
            job.write_text(textwrap.dedent(f"""
                [job]
                name = "from-file"
                command = {json.dumps(TRAINER)}
                min_nodes = 2
                backup_dir = "{tmp_path / 'backup'}"
                [node]
                id = "{node}"
                [rendezvous]
                endpoint = "{cluster.endpoint}"
                [metrics]
                port = 0
            """))
            cluster.launch(node, [sys.executable, "-m", "tfelastic.daemon", "agent", "--config", str(job)])
        assert cluster.wait_all(60) == [0, 0], cluster.logs()
        assert coordinator.wait(30) == 0  # it exits once the job is over and the agents hung up
        output = coordinator.stdout.read().decode() if coordinator.stdout else ""
        assert "job succeeded" in output and "hosting the coordinator" not in cluster.logs()
        assert "SIGUSR1: where the coordinator waits:" in output and "SIGUSR2: the coordinator runs" in output
        assert {e["event"] for e in cluster.events()} == {"start", "end"}
    finally:
        coordinator.kill()
        coordinator.wait()


def test_a_standalone_coordinator_lingers_with_a_failed_verdict_until_a_stop_signal(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """Without etcd, as with it: after a failure /metrics stays up with the verdict for --metrics-linger, and
    SIGTERM (systemd's stop) ends the linger with the job's exit code, 1, not a death by the signal."""
    cluster = make_cluster(TRAINER, nodes="2", extra_args=[*FAST, "--max-restarts", "0"],
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05"})
    log_path = tmp_path / "coordinator.log"
    with log_path.open("ab") as log:
        coordinator = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen",
                                        str(cluster.endpoint), "--metrics-port", "0", "--metrics-linger", "60"],
                                       stdout=log, stderr=subprocess.STDOUT)
    try:
        assert fail_the_job_under(cluster, log_path) == [1.0]  # every agent is gone: the coordinator still answers
        assert coordinator.poll() is None
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(30) == 1, log_path.read_text()[-3000:]
    finally:
        coordinator.kill()
        coordinator.wait()


def test_a_standalone_coordinator_stopped_before_the_verdict_stops_in_order_and_exits_0(tmp_path: Path) -> None:
    """SIGTERM (or SIGHUP) before the job ended: an orderly stop, not a death by the signal."""
    for stop in (signal.SIGTERM, signal.SIGHUP):
        code, output = stopped_while_listening(stop, tmp_path)
        assert code == 0, output
        assert "stopped by a signal before job default ended" in output


def stopped_while_listening(stop: signal.Signals, cwd: Path) -> tuple[int, str]:
    coordinator = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen",
                                    f"127.0.0.1:{free_port()}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, cwd=cwd)
    output = coordinator.stdout
    assert output is not None
    try:
        wait_for(lambda: "listening on" in output.readline(), 20, "the coordinator to listen")
        coordinator.send_signal(stop)
        return coordinator.wait(30), output.read()
    finally:
        coordinator.kill()
        coordinator.wait()


def test_exit_0_in_answer_to_a_planned_stop_does_not_end_the_job(make_cluster: ClusterFactory) -> None:
    # A trainer that exits 0 on SIGTERM (it checkpointed and stopped) has not completed training.
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=FAST,
                           env={"COUNTER_STEPS": "120", "COUNTER_EXIT_ON_TERM": "1"})
    cluster.start("a")
    cluster.start("b")
    cluster.wait_running(1, 2, step=10)
    cluster.start("c")
    doc = cluster.wait_running(2, 3)
    assert doc["restarts_by_reason"] == {"scale_up": 1}
    assert cluster.wait_all(60) == [0, 0, 0], cluster.logs()
    assert [e["step"] for e in cluster.events() if e["event"] == "end"] == [120, 120, 120]


@pytest.mark.quick
def test_status_shows_step_rate_checkpoint_age_and_gpus(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2", env={"COUNTER_STEPS": "400", "COUNTER_STEP_SECONDS": "0.05"})
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_status(lambda d: d["state"] == "running" and all(
        (n["steps_per_second"] or 0) > 0 for n in members(d)), 30, "step rates")
    chief, other = members(doc)
    assert 5 < chief["steps_per_second"] < 40  # the counter makes about 20 steps a second
    assert chief["last_checkpoint_age_seconds"] is not None and chief["last_checkpoint_step"] is not None
    assert other["last_checkpoint_age_seconds"] is None  # only the chief saves
    assert [(n["gpus"], n["gpu_utilization"]) for n in members(doc)] == [(0, None), (0, None)]  # no GPU here
