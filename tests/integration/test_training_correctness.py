"""Correctness of training under failure: real TensorFlow, 2-3 workers under real agents, on the CPU.

How the work lost to a kill is measured: the coordinator's ledger counts, for each generation, the steps it
redid: from the furthest step any trainer of the generation before marked (the step file, written after every
step, which a SIGKILL leaves behind) to the step restored. A kill comes at any moment of a step, and must cost at
most one step: the survivor saves the step it holds (trainer/survivors.py), where without it a kill redid up to
the save interval. (Freezing a worker to read its step would defeat it: a survivor whose peer was stopped, or
was itself stopped, when the peer died learns of the death only from TensorFlow's heartbeat timeout, too late to
save: docs/facts.md.)
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tfelastic.trainer.snapshots import snapshot_name

from tests.cluster import FORM_WITH_ALL, TF_DEADLINE, Cluster, members, wait_for
from tests.conftest import ClusterFactory
from tests.workers import example, summaries

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

AGENTS = ["--stall-timeout", "60", "--stop-grace", "20", "--last-call", "0.5", "--settle", "0.5",
          "--max-restarts", "10"]
SAVE_EVERY = 10


def starting_steps(log: str) -> list[int]:
    """The step each generation's chief started at, in order, from its agent's log."""
    return [int(m) for m in re.findall(r"\[rank 0\] starting at step (\d+)", log)]


def chief_summaries(cluster: Cluster) -> list[dict[str, Any]]:
    return [s for s in summaries(cluster.logs()) if s["rank"] == 0]


def kill_at_random_steps(cluster: Cluster, kills: int, rng: random.Random) -> list[dict[str, Any]]:
    """Kills a random worker (the chief or the other) at random steps, in the middle of whatever it does, each
    time once the next generation runs; returns the coordinator's ledger of generations once the last one has made
    a step (its steps redone are counted then)."""
    step = 0
    for generation in range(1, kills + 1):
        doc = cluster.wait_running(generation, 2, timeout=TF_DEADLINE, step=step + rng.randint(3, 2 * SAVE_EVERY))
        step = members(doc)[0]["step"]
        os.kill(rng.choice(members(doc))["worker_pid"], signal.SIGKILL)
        step = wait_for_start(cluster, generation + 1)
    cluster.wait_running(kills + 1, 2, timeout=TF_DEADLINE, step=step + 1)
    generations: list[dict[str, Any]] = ledger(cluster)["generations"]
    return generations


def wait_for_start(cluster: Cluster, generation: int) -> int:
    """The step the chief of ``generation`` started at."""
    def started() -> list[int] | None:
        steps = starting_steps(cluster.agents[0].log())
        return steps if len(steps) >= generation else None

    steps: list[int] = wait_for(started, TF_DEADLINE, f"generation {generation} to start")
    return steps[generation - 1]


FALLBACK = "the state this worker holds is not saved"  # trainer/survivors.py: the step may be half applied


def assert_at_most_one_step_redone(generations: list[dict[str, Any]], kills: int, logs: str,
                                   fallbacks: bool = False) -> None:
    """Each generation after a kill redid at most one step, and none resumed past the furthest step reached.
    ``fallbacks``: fit's documented window (a peer that dies after the gradients' all-reduce, before the
    metrics'): a generation may redo more when a survivor logged that it saved nothing, for that reason."""
    assert len(generations) == kills + 1, generations
    more = [after for after in generations[1:] if after["steps_redone"] > 1]
    for before, after in itertools.pairwise(generations):
        assert after["restored_step"] <= before["reached_step"], (before, after)
    assert not more or (fallbacks and logs.count(FALLBACK) >= len(more)), (more, generations)


def ledger(cluster: Cluster) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "report", "--json", "--rendezvous",
                             str(cluster.endpoint)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def custom_loop(tmp: Path, run: str, *extra: str) -> list[str]:
    return example("custom_loop", "--steps", "100", "--save-every", str(SAVE_EVERY), "--train-examples", "1024",
                   "--seed", "5", "--backup-dir", str(tmp / run / "ckpt"), *extra)


def test_custom_loop_killed_three_times_ends_with_the_weights_of_an_uninterrupted_run(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    reference = make_cluster(custom_loop(tmp_path, "reference"), nodes="2", extra_args=AGENTS)
    reference.start_host("ref-a")  # other node ids: other log files in the same folder
    reference.start("ref-b")
    assert reference.wait_all(300) == [0, 0], reference.logs()[-4000:]
    [expected] = chief_summaries(reference)

    cluster = make_cluster(custom_loop(tmp_path, "killed", "--step-seconds", "0.2"), nodes="2", extra_args=AGENTS)
    cluster.start_host("a")
    cluster.start("b")
    generations = kill_at_random_steps(cluster, 3, random.Random(11))
    assert cluster.wait_all(300) == [0, 0], cluster.logs()[-4000:]

    [final] = chief_summaries(cluster)
    assert final["final_step"] == final["target_step"] == expected["final_step"] == 100
    assert_at_most_one_step_redone(generations, 3, cluster.logs())
    doc = cluster.status() or {}
    assert doc.get("restarts_total", 3) == 3
    # Exact restore (model, optimizer, step, position in the shuffled epoch): the same weights, bit for bit.
    assert final["weights_digest"] == expected["weights_digest"], (final, expected)


def test_keras_fit_killed_twice_reaches_the_target_step_redoing_at_most_one_step_each_time(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    trainer = example("keras_fit", "--epochs", "2", "--steps-per-epoch", "40", "--save-every", str(SAVE_EVERY),
                      "--train-examples", "1024", "--step-seconds", "0.2", "--backup-dir", str(tmp_path / "ckpt"))
    cluster = make_cluster(trainer, nodes="2", extra_args=AGENTS)
    cluster.start_host("a")
    cluster.start("b")
    generations = kill_at_random_steps(cluster, 2, random.Random(5))
    assert cluster.wait_all(300) == [0, 0], cluster.logs()[-4000:]
    [final] = chief_summaries(cluster)
    assert final["final_step"] == final["target_step"] == 80
    assert_at_most_one_step_redone(generations, 2, cluster.logs(), fallbacks=True)


def keep_per_replica(world: int) -> tuple[int, int, float]:
    """The per-replica batch stays 32, the global batch is 32 x workers, the learning rate scales linearly."""
    return 32 * world, 32, 0.001 * world


def keep_global(world: int) -> tuple[int, int, float]:
    """The global batch stays 96 (divisible by 2 and 3), split among the workers; the learning rate stays."""
    return 96, 96 // world, 0.001


BATCH_POLICIES = {
    "keep-per-replica": (keep_per_replica, ["--per-replica-batch", "32", "--reference-replicas", "1"]),
    "keep-global": (keep_global, ["--global-batch", "96"]),
}


@pytest.mark.parametrize("policy", BATCH_POLICIES)
def test_world_size_2_3_2_keeps_the_batch_policy_and_loses_nothing_on_the_planned_change(
        make_cluster: ClusterFactory, tmp_path: Path, policy: str) -> None:
    """2 workers, a third joins (scale-up: a planned stop, so the trainers checkpoint and exit 42), then the third
    node's agent is SIGKILLed (a failure) and the job goes on with 2. Every generation follows the batch policy."""
    expected, batch_args = BATCH_POLICIES[policy]
    trainer = custom_loop(tmp_path, "elastic", "--step-seconds", "0.2", "--batch-policy", policy,
                          "--learning-rate", "0.001", *batch_args)
    cluster = make_cluster(trainer, nodes="2:3", extra_args=AGENTS)
    cluster.start_host("a")
    cluster.start("b")
    cluster.wait_running(1, 2, timeout=TF_DEADLINE, step=15)
    third = cluster.start("c")

    cluster.wait_running(2, 3, timeout=TF_DEADLINE, step=1)
    stopped = [s for s in chief_summaries(cluster) if s["generation"] == 1]
    assert len(stopped) == 1 and stopped[0]["preempted"] is True, chief_summaries(cluster)
    assert wait_for_start(cluster, 2) == stopped[0]["final_step"]  # zero steps lost
    step = cluster.wait_running(2, 3, timeout=TF_DEADLINE, step=stopped[0]["final_step"] + 5)["nodes"][0]["step"]

    third.proc.kill()
    assert [agent.wait(300) for agent in cluster.agents[:2]] == [0, 0], cluster.logs()[-4000:]
    final = [s for s in chief_summaries(cluster) if s["generation"] == 3]
    assert len(final) == 1 and final[0]["final_step"] == 100, chief_summaries(cluster)
    # The chief had reached `step` before the kill (it may have gone on a little: status lags it), so at most the
    # save interval is redone, and generation 3 resumed from a save of the schedule, from the planned stop's, or
    # from the step a survivor of the lost node held and saved (trainer/survivors.py).
    resumed = final[0]["initial_step"]
    assert step - SAVE_EVERY <= resumed, (step, resumed)
    survivors = [int(s) for s in re.findall(r"failed; it saves step (\d+),", cluster.logs())]
    assert resumed % SAVE_EVERY == 0 or resumed == stopped[0]["final_step"] or resumed in survivors, \
        (resumed, stopped[0]["final_step"], survivors)
    assert final[0]["restored_from"].endswith(f"/{snapshot_name(resumed)}"), final[0]
    # A surviving node: from its memory, or the survivors' step from the backup dir, where they wrote it (a step of
    # the schedule both hold: the node's memory first)
    where = [f"{tmp_path}/shm/"] if resumed not in survivors else [f"{tmp_path}/elastic/ckpt/"] + \
        ([f"{tmp_path}/shm/"] if resumed % SAVE_EVERY == 0 else [])
    assert any(w in final[0]["restored_from"] for w in where), (final[0], where)
    # Every generation's chief logged its plan at start.
    plans = re.findall(r"\[rank 0\] world size (\d+), (\d+) replicas: global batch (\d+), (\d+) per replica, "
                       rf"learning rate (\S+) \({policy}\)", cluster.agents[0].log())
    assert [int(p[0]) for p in plans] == [2, 3, 2], plans
    for world, replicas, global_batch, per_replica, learning_rate in plans:
        want_global, want_per_replica, want_learning_rate = expected(int(world))
        assert int(replicas) == int(world), plans
        assert (int(global_batch), int(per_replica)) == (want_global, want_per_replica), plans
        assert float(learning_rate) == pytest.approx(want_learning_rate), plans


def test_sigterm_drain_loses_no_step(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    trainer = example("keras_fit", "--epochs", "2", "--steps-per-epoch", "40", "--save-every", "25",
                      "--train-examples", "1024", "--step-seconds", "0.2", "--backup-dir", str(tmp_path / "ckpt"))
    cluster = make_cluster(trainer, nodes="1:2", extra_args=[*AGENTS, *FORM_WITH_ALL])
    cluster.start_host("a")
    drained = cluster.start("b")
    cluster.wait_running(1, 2, timeout=TF_DEADLINE, step=12)  # between two saves (25, 50): a kill would lose steps

    drained.proc.send_signal(signal.SIGTERM)  # what systemctl stop does
    assert drained.wait(60) == 0, drained.log()
    cluster.wait_running(2, 1, timeout=TF_DEADLINE, step=1)
    [stopped] = [s for s in chief_summaries(cluster) if s["generation"] == 1]
    assert stopped["preempted"] is True and stopped["final_step"] % 25 != 0  # saved off the save schedule
    assert wait_for_start(cluster, 2) == stopped["final_step"]
    assert "checkpointed after step" in drained.log() or "checkpointed after step" in cluster.agents[0].log()
    for agent in (drained, cluster.agents[0]):  # Preempted told each agent that its save was durable (trainer.md)
        assert "saved its state and exits 42" in agent.log(), agent.log()
    assert cluster.agents[0].wait(300) == 0, cluster.logs()[-4000:]
    assert [s["final_step"] for s in chief_summaries(cluster) if s["generation"] == 2] == [80]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
