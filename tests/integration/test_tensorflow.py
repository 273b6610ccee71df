"""The elastic loop with a real TensorFlow MultiWorkerMirroredStrategy trainer and BackupAndRestore, on the CPU."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import FORM_WITH_ALL, TF_DEADLINE, TF_TRAINER, alive, kill, members, wait_for
from tests.conftest import ClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

EPOCHS, STEPS, SAVE_EVERY = 3, 60, 10
TARGET = EPOCHS * STEPS
# 20 ms a step: restarts must land mid-training, not race a run that completes during the stop.
TRAINER = [*TF_TRAINER, "--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS), "--save-every", str(SAVE_EVERY),
           "--step-seconds", "0.02"]
# Hang detection as a user gets it (learned, with start-up's allowance) where a test is not about a hang: a fixed
# limit also bounds start-up and restore, which other TensorFlow jobs on the machine can stretch past it.
ARGS = ["--stop-grace", "1", "--last-call", "0.5", "--settle", "1"]
WEDGE_ARGS = [*ARGS, "--stall-timeout", "8"]


def by_event(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def assert_finished_at_target_after_resuming(events: list[dict[str, Any]], generations: int) -> None:
    starts = by_event(events, "start")
    assert [e["generation"] for e in starts] == list(range(1, generations + 1)), starts
    assert starts[0]["initial_step"] == 0
    for start in starts[1:]:
        assert start["initial_step"] > 0, f"generation {start['generation']} started from scratch"
        assert start["initial_step"] % SAVE_EVERY == 0  # a BackupAndRestore checkpoint, not a guess
    assert [e["final_step"] for e in by_event(events, "end")] == [TARGET]


def test_killed_worker_restarts_the_set_from_the_checkpoint_and_a_third_agent_scales_it_up(
        make_cluster: ClusterFactory) -> None:
    """Two restarts of one job, each resuming from BackupAndRestore's checkpoint: a worker's death restarts the set,
    then a third agent's arrival re-forms it with three workers."""
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=ARGS)
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, timeout=TF_DEADLINE, step=25)
    kill(members(doc)[1]["worker_pid"])
    cluster.wait_running(2, 2, timeout=TF_DEADLINE, step=25)
    assert by_event(cluster.events(), "start")[1]["initial_step"] >= 20  # the chief's events: one per generation
    cluster.start("c")
    doc = cluster.wait_running(3, 3, timeout=60)
    assert doc["restarts_by_reason"] == {"worker_exit": 1, "scale_up": 1}
    assert cluster.wait_all(240) == [0, 0, 0], cluster.logs()
    assert_finished_at_target_after_resuming(cluster.events(), 3)
    assert [e["world_size"] for e in by_event(cluster.events(), "start")] == [2, 2, 3]


def test_wedged_worker_is_caught_as_a_stall(make_cluster: ClusterFactory) -> None:
    """A trainer alive but stuck: TensorFlow's heartbeat thread runs on, so only hang detection can catch it.
    (A SIGSTOPped one raced TensorFlow's own 10 s heartbeat timeout, which sometimes won: docs/facts.md, fact 3.)"""
    cluster = make_cluster([*TRAINER, "--wedge-at-step", "40"], extra_args=WEDGE_ARGS)
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, timeout=TF_DEADLINE, step=25)
    wedged = members(doc)[1]  # the last rank: the one that wedges, in its own callback's sleep
    victim = wedged["worker_pid"]
    doc = cluster.wait_status(lambda d: d["generation"] >= 2, 60, "the restart after the stall")
    assert "stalled" in doc["restarts_by_reason"], doc
    # The other rank waits for it in a collective: its agent reports a moment later (WAITING_HANG_DELAY), so that
    # the restart is recorded as the wedged rank's, where it hung.
    ended = doc["last_restart"]["ended"]
    assert re.match(rf"stalled: {wedged['node_id']}: no progress for [\d.]+s \(stall_timeout=8s\); hung in "
                    r"on_train_batch_end \(\S+/demo_trainer\.py:\d+\)", ended), ended
    assert not alive(victim)
    assert cluster.wait_all(180) == [0, 0], cluster.logs()
    assert_finished_at_target_after_resuming(cluster.events(), 2)


def test_killed_agent_takes_its_worker_and_the_others_reform(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(TRAINER, nodes="2:3", extra_args=[*ARGS, *FORM_WITH_ALL])
    cluster.start_host("a", timeout=30)
    cluster.start("b")
    victim = cluster.start("c")
    doc = cluster.wait_running(1, 3, timeout=TF_DEADLINE, step=15)
    worker = next(n["worker_pid"] for n in members(doc) if n["node_id"] == "c")
    victim.proc.send_signal(signal.SIGKILL)
    wait_for(lambda: not alive(worker), 15, "the killed agent's worker to die")
    doc = cluster.wait_running(2, 2, timeout=60)
    # Even when a survivor's report of its aborted collective came first (rendezvous/blame.py)
    assert doc["restarts_by_reason"] == {"node_lost": 1}
    assert doc["last_restart"]["ended"].startswith("node_lost: c: "), doc["last_restart"]
    assert [a.wait(180) for a in cluster.agents[:2]] == [0, 0], cluster.logs()
    assert_finished_at_target_after_resuming(cluster.events(), 2)
    assert by_event(cluster.events(), "start")[1]["world_size"] == 2


def test_demo_shows_a_real_recovery(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "demo", "--json", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True, doc
    assert doc["faults_injected"] == 1 and doc["restarts_total"] == 1
    assert doc["final_step"] == doc["target_step"] == 200
    assert len(doc["resumed_from_step"]) == 1 and doc["resumed_from_step"][0] > 0
    assert len(doc["recovery_seconds"]) == 1 and doc["recovery_seconds"][0] > 0
