"""Parameter-server jobs end to end: real agents, a real coordinator, real TensorFlow (ParameterServerStrategy on
the CPU), on localhost. A worker's failure costs nobody a restart; a parameter server's or the chief's restarts
the job from the chief's checkpoint; a lost worker's node leaves its task vacant until a node takes it in a
planned restart (docs/parameter-server.md)."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import COUNTER, TF_DEADLINE, Cluster, alive, kill, wait_for
from tests.conftest import ClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

ROOT = Path(__file__).resolve().parents[2]
PS_ARGS = ["--strategy", "parameter-server", "--ps", "1", "--stall-timeout", "60", "--stop-grace", "10",
           "--last-call", "30", "--settle", "1", "--warm-start", "off"]


def roles(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The members of the running generation by their task ("chief", "ps 0", "worker 1")."""
    return {n["role"]: n for n in doc["nodes"] if n["role"]}


def summaries(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class ChiefSteps:
    """Polls status in the background and keeps every step the chief reported, in order."""

    def __init__(self, cluster: Cluster) -> None:
        self.steps: list[tuple[int, int]] = []  # (generation, step)
        self.losses: list[float] = []
        self._cluster, self._done = cluster, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(0.3):
            doc = self._cluster.status()
            chief = roles(doc).get("chief") if doc is not None else None
            if doc is not None and chief is not None and chief["step"] is not None:
                self.steps.append((doc["generation"], chief["step"]))
                if chief["loss"] is not None:
                    self.losses.append(chief["loss"])

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture
def watch() -> Iterator[list[ChiefSteps]]:
    watches: list[ChiefSteps] = []
    yield watches
    for w in watches:
        w.stop()


def ps_cluster(make_cluster: ClusterFactory, trainer: list[str], nodes: str = "4") -> Cluster:
    return make_cluster(trainer, nodes=nodes, extra_args=PS_ARGS)


def wait_training(cluster: Cluster, generation: int, step: int, timeout: float = TF_DEADLINE) -> dict[str, Any]:
    return cluster.wait_status(
        lambda d: d["state"] == "running" and d["generation"] == generation
        and (roles(d).get("chief") or {}).get("step") is not None and roles(d)["chief"]["step"] >= step,
        timeout, f"generation {generation}'s chief past step {step}")


def replaced(task: str, pid: int, times: int) -> Callable[[dict[str, Any]], bool]:
    """Status shows ``task`` on a new pid, replaced at least ``times`` times."""
    def check(doc: dict[str, Any]) -> bool:
        node = roles(doc)[task]
        return node["worker_pid"] not in (None, pid) and node["replacements"] >= times
    return check


def wait_serving(cluster: Cluster, node_id: str, task: str, times: int) -> None:
    """Until the node's agent has seen its worker task's server answer after ``times`` launches."""
    agent = next(a for a in cluster.agents if a.node_id == node_id)
    wait_for(lambda: agent.log().count(f"{task} serves") >= times, TF_DEADLINE,
             f"{task} on {node_id} serving ({times})")


def test_workers_killed_and_hung_are_replaced_alone_while_the_chief_trains_on(
        make_cluster: ClusterFactory, tmp_path: Path, watch: list[ChiefSteps]) -> None:
    summary = tmp_path / "summary.jsonl"
    trainer = [sys.executable, str(ROOT / "examples" / "ps_custom_loop.py"), "--steps", "700", "--save-every", "50",
               "--step-seconds", "0.05", "--summary-file", str(summary)]
    cluster = ps_cluster(make_cluster, trainer)
    for node in ("head", "cpu1", "gpu1", "gpu2"):
        cluster.start(node, extra=["--role", {"head": "chief", "cpu1": "ps"}.get(node, "worker")])
    doc = wait_training(cluster, 1, 20, timeout=TF_DEADLINE)
    steps = ChiefSteps(cluster)
    watch.append(steps)
    tasks = roles(doc)
    assert (tasks["chief"]["node_id"], tasks["ps 0"]["node_id"]) == ("head", "cpu1")  # as they asked (--role)
    assert {tasks["worker 0"]["node_id"], tasks["worker 1"]["node_id"]} == {"gpu1", "gpu2"}  # in joining order
    chief_pid, ps_pid = tasks["chief"]["worker_pid"], tasks["ps 0"]["worker_pid"]

    for i in range(5):  # SIGKILL a worker 5 times, each serving again before the next
        task = f"worker {i % 2}"
        victim = roles(doc)[task]
        wait_serving(cluster, victim["node_id"], task, i // 2 + 1)
        kill(victim["worker_pid"])
        doc = cluster.wait_status(replaced(task, victim["worker_pid"], i // 2 + 1), 60, f"{task} replaced")
    # A worker alive but not serving: found by the agent's probe, replaced alone.
    wedged = roles(doc)["worker 0"]
    wait_serving(cluster, wedged["node_id"], "worker 0", 4)
    kill(wedged["worker_pid"], signal.SIGSTOP)
    doc = cluster.wait_status(lambda d: roles(d)["worker 0"]["worker_pid"] not in (None, wedged["worker_pid"]), 60,
                              "the hung worker replaced")
    assert not alive(wedged["worker_pid"])
    doc = cluster.wait_status(lambda d: d["restarts_by_reason"].get("worker_replaced") == 6, 30,
                              "six replacements counted")
    assert doc["restarts_total"] == 0 and doc["generation"] == 1  # never a restart of the job
    assert roles(doc)["chief"]["worker_pid"] == chief_pid and roles(doc)["ps 0"]["worker_pid"] == ps_pid
    assert sum(n["replacements"] for n in doc["nodes"]) == 6

    assert cluster.wait_all(300) == [0, 0, 0, 0], cluster.logs()
    steps.stop()
    [done] = [s for s in summaries(summary) if not s["preempted"]]
    # At least once: a step retried after a kill in the last chunk (between saves) may be counted twice.
    assert 700 <= done["final_step"] <= 706 and (done["generation"], done["pid"]) == (1, chief_pid), done
    assert {g for g, _ in steps.steps} == {1}
    chief_steps = [s for _, s in steps.steps]
    assert chief_steps == sorted(chief_steps), "the chief's step went back"
    # The model learned: its final checkpoint, evaluated alone, is far above chance (0.1 for 10 classes) and the last
    # batch's loss far below an untrained model's (ln 10). Not "below the first loss seen": the chief reports a loss
    # with each save, and by the first one (step 50) this model is often converged, so two single-batch losses of
    # a converged model compare at random.
    assert steps.losses and math.isfinite(done["train_loss"]) and done["train_loss"] < math.log(10) / 4, done
    assert done["accuracy"] > 0.5, done
    log = cluster.logs()
    assert "relaunching worker 0 alone" in log and "relaunching worker 1 alone" in log
    assert "is hung: its server did not answer" in log


@pytest.mark.quick
def test_a_round_nobody_can_fill_ends_the_job_after_join_timeout_and_status_names_the_task(
        make_cluster: ClusterFactory) -> None:
    """Three agents that all say --role worker: min_nodes are in, no chief can be found. No trainer ever starts,
    so the counter stands in for one (and TensorFlow is not needed)."""
    cluster = make_cluster([sys.executable, COUNTER], nodes="3", extra_args=[
        "--strategy", "parameter-server", "--ps", "1", "--last-call", "0.5", "--join-timeout", "6", "--role", "worker"])
    cluster.start_host("a")
    cluster.start("b")
    cluster.start("c")
    doc = cluster.wait_status(lambda d: "chief task" in d["reason"], 20, "status to name the missing task")
    assert doc["state"] == "waiting" and "start a node with --role chief or --role any" in doc["reason"], doc
    assert cluster.wait_all(30) == [1, 1, 1], cluster.logs()
    log = cluster.agents[0].log()
    assert "needs 1 chief task" in log and "none joined within join_timeout=6s" in log, log[-3000:]


def test_a_bad_role_combination_exits_78_before_anything_starts(tmp_path: Path) -> None:
    cases = [
        (["--strategy", "parameter-server", "--ps", "2", "--nodes", "3"], "the minimum must be at least 4"),
        (["--ps", "1", "--nodes", "3"], "needs --strategy parameter-server"),
        (["--role", "ps", "--nodes", "3"], "--role: 'ps' is a task of a parameter-server job"),
        (["--strategy", "parameter-server", "--nodes", "3"], "needs at least 1 parameter server"),
        (["--strategy", "parameter-server", "--ps", "1", "--nodes", "3", "--role", "boss"], "--role"),
    ]
    for flags, message in cases:
        done = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "run", "--rendezvous", "127.0.0.1:1",
                               *flags, "--", "python", "train.py"], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert done.returncode in (78, 2), (flags, done.stderr)
        assert message in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr


def test_model_fit_workers_are_replaced_alone_and_a_killed_ps_or_chief_restarts_the_job_from_the_checkpoint(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    summary = tmp_path / "summary.jsonl"
    # Long enough for every phase below on a loaded machine: while two workers' TensorFlow starts again, the chief
    # trains on (once 380 of 400 steps were done before the ps was killed, and generation 2 ended first).
    epochs, steps_per_epoch = 6, 100
    trainer = [sys.executable, str(ROOT / "examples" / "ps_keras_fit.py"), "--epochs", str(epochs),
               "--steps-per-epoch", str(steps_per_epoch), "--save-every", "20", "--step-seconds", "0.05",
               "--summary-file", str(summary)]
    cluster = ps_cluster(make_cluster, trainer)
    for node in ("a", "b", "c", "d"):
        cluster.start(node)
    doc = wait_training(cluster, 1, 25, timeout=TF_DEADLINE)
    chief_pid = roles(doc)["chief"]["worker_pid"]
    for i in range(2):  # Model.fit's coordinator too re-attaches a worker replaced alone
        worker = roles(doc)[f"worker {i}"]
        wait_serving(cluster, worker["node_id"], f"worker {i}", 1)
        kill(worker["worker_pid"])
        doc = cluster.wait_status(replaced(f"worker {i}", worker["worker_pid"], 1), 60, f"worker {i} replaced")
        wait_serving(cluster, worker["node_id"], f"worker {i}", 2)
    step = roles(doc)["chief"]["step"]
    doc = wait_training(cluster, 1, step + 10, timeout=TF_DEADLINE)
    assert doc["restarts_by_reason"] == {"worker_replaced": 2} and roles(doc)["chief"]["worker_pid"] == chief_pid
    kill(roles(doc)["ps 0"]["worker_pid"])
    doc = wait_training(cluster, 2, 1, timeout=TF_DEADLINE)
    assert doc["restarts_by_reason"] == {"worker_replaced": 2, "worker_exit": 1}
    resumed = roles(doc)["chief"]["step"]
    wait_training(cluster, 2, resumed + 45, timeout=TF_DEADLINE)
    chief = roles(cluster.status() or doc)["chief"]
    kill(chief["worker_pid"])
    doc = wait_training(cluster, 3, 1, timeout=TF_DEADLINE)
    assert doc["restarts_by_reason"] == {"worker_replaced": 2, "worker_exit": 2}
    assert cluster.wait_all(300) == [0, 0, 0, 0], cluster.logs()
    [done] = [s for s in summaries(summary) if not s["preempted"]]
    # A step runs at least once under this strategy: the step a killed worker was running is retried, and is
    # applied twice when the worker died after its update reached the ps. Two kills: up to two steps counted twice.
    duplicates = done["final_step"] - epochs * steps_per_epoch
    assert 0 <= duplicates <= 2 and done["generation"] == 3, done
    # The chief's checkpoint, not a guess: saved every 20 batches, and no older than the last one it reported.
    assert done["initial_step"] >= max(40, chief["last_checkpoint_step"] or 0), (done, chief)
    assert done["initial_step"] % 20 <= duplicates, done
    assert math.isfinite(done["train_loss"])


def test_a_lost_workers_node_leaves_its_task_vacant_and_returns_through_a_planned_restart(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    summary = tmp_path / "summary.jsonl"
    trainer = [sys.executable, str(ROOT / "examples" / "ps_custom_loop.py"), "--steps", "900", "--save-every", "100",
               "--step-seconds", "0.05", "--summary-file", str(summary)]
    cluster = ps_cluster(make_cluster, trainer, nodes="3:4")
    for node in ("a", "b", "c", "d"):
        cluster.start(node)
    doc = wait_training(cluster, 1, 20, timeout=TF_DEADLINE)
    lost = roles(doc)["worker 1"]
    agent = next(a for a in cluster.agents if a.node_id == lost["node_id"])
    agent.proc.send_signal(signal.SIGKILL)
    wait_for(lambda: not alive(lost["worker_pid"]), 15, "the lost agent's worker to die")
    doc = cluster.wait_status(lambda d: bool(d["vacant"]), 30, "the task vacant")
    [vacant] = doc["vacant"]
    assert vacant.startswith(f"worker 1: node {lost['node_id']} lost"), vacant
    step = roles(doc)["chief"]["step"]
    doc = wait_training(cluster, 1, step + 60, timeout=TF_DEADLINE)  # short-handed, on the same generation
    assert doc["restarts_total"] == 0

    cluster.start(lost["node_id"])  # the node comes back
    doc = wait_training(cluster, 2, 1, timeout=TF_DEADLINE)
    assert doc["restarts_by_reason"] == {"scale_up": 1} and doc["vacant"] == []
    assert roles(doc)["worker 1"]["node_id"] == lost["node_id"]  # its old task again
    codes = [a.proc.wait(300) for a in cluster.agents if a is not agent]
    assert codes == [0, 0, 0, 0], cluster.logs()
    stopped = [s for s in summaries(summary) if s["preempted"]]
    [done] = [s for s in summaries(summary) if not s["preempted"]]
    assert done["final_step"] == 900 and done["generation"] == 2
    assert [s["final_step"] for s in stopped] == [done["initial_step"]]  # saved on the stop: no step redone


def test_with_default_hang_detection_a_chief_hung_in_its_own_code_restarts_the_job_and_is_named(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """The chief's progress is the job's: its live hang is caught by the limit learned from its step times (the
    workers and the ps are not watched: they serve), and the restart is recorded with where it hung."""
    summary = tmp_path / "summary.jsonl"
    script = ROOT / "examples" / "ps_custom_loop.py"
    trainer = [sys.executable, str(script), "--steps", "300", "--save-every", "50", "--step-seconds", "0.05",
               "--wedge-at-step", "160", "--summary-file", str(summary)]
    # The default limit, learned: the later flag overrides PS_ARGS' fixed 60 s.
    cluster = make_cluster(trainer, nodes="3", extra_args=[*PS_ARGS, "--stall-timeout", "auto"])
    for node, role in (("head", "chief"), ("cpu1", "ps"), ("gpu1", "worker")):
        cluster.start(node, extra=["--role", role])
    doc = cluster.wait_status(lambda d: d["generation"] >= 2, TF_DEADLINE, "the restart after the chief's hang")
    assert doc["restarts_by_reason"] == {"stalled": 1}, doc
    ended = doc["last_restart"]["ended"]
    assert re.match(rf"stalled: head: no progress for [\d.]+s \(learned limit [\d.]+s: 8 x the longest step gap "
                    rf"[\d.]+s, floor 5s\); hung in chief_wedged_in_its_step \({re.escape(str(script))}:\d+\)",
                    ended), ended
    assert cluster.wait_all(300) == [0, 0, 0], cluster.logs()
    [done] = [s for s in summaries(summary) if not s["preempted"]]
    assert done["generation"] == 2 and done["initial_step"] == 150 and done["final_step"] == 300, done


def test_every_agent_stopped_at_once_lets_the_chief_save_and_the_next_run_resumes_there(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """systemctl stop or scancel on every node at once: the parameter servers and workers serve until the chief's
    trainer has saved and stopped (its save reads their variables and waits for their steps)."""
    summary = tmp_path / "summary.jsonl"
    trainer = [sys.executable, str(ROOT / "examples" / "ps_custom_loop.py"), "--steps", "400", "--save-every", "100",
               "--step-seconds", "0.05", "--summary-file", str(summary)]
    cluster = ps_cluster(make_cluster, trainer)
    for node in ("a", "b", "c", "d"):
        cluster.start(node)
    doc = wait_training(cluster, 1, 120, timeout=TF_DEADLINE)
    tasks = roles(doc)
    for agent in cluster.agents:
        agent.proc.send_signal(signal.SIGTERM)
    assert cluster.wait_all(120) == [0, 0, 0, 0], cluster.logs()
    [stopped] = summaries(summary)
    assert stopped["preempted"] and stopped["final_step"] >= 120 and stopped["checkpoint"], stopped
    for task in ("ps 0", "worker 0", "worker 1"):
        agent = next(a for a in cluster.agents if a.node_id == tasks[task]["node_id"])
        assert f"{task} serves until the chief has stopped" in agent.log(), agent.log()
    chief_agent = next(a for a in cluster.agents if a.node_id == tasks["chief"]["node_id"])
    assert "saved its state and exits 42" in chief_agent.log(), chief_agent.log()  # its save durable: trainer.md

    for node in ("a", "b", "c", "d"):  # the next run of the job
        cluster.start(node)
    assert cluster.wait_all(300) == [0] * 8, cluster.logs()
    [done] = summaries(summary)[1:]
    assert done["final_step"] == 400 and done["initial_step"] == stopped["final_step"]  # no step redone


def test_an_unmodified_tensorflow_tutorial_script_runs_and_its_worker_is_replaced_alone(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """tests/trainers/ps_tutorial.py imports nothing of tfelastic: TF_CONFIG is all it needs. It reports no
    progress either, so the test watches its workers' pids and the chief's own output."""
    trainer = [sys.executable, str(ROOT / "tests" / "trainers" / "ps_tutorial.py"), str(tmp_path / "tutorial-backup")]
    cluster = make_cluster(trainer, nodes="4", extra_args=[*PS_ARGS, "--stall-timeout", "off"],
                           env={"PS_TUTORIAL_EPOCHS": "12", "PS_TUTORIAL_STEPS": "20",
                                "PS_TUTORIAL_EPOCH_SECONDS": "2"})
    for node in ("a", "b", "c", "d"):
        cluster.start(node)
    doc = cluster.wait_status(lambda d: d["state"] == "running" and all(n["worker_pid"] for n in roles(d).values()),
                              120, "every task running")
    worker = roles(doc)["worker 0"]
    chief_agent = next(a for a in cluster.agents if a.node_id == roles(doc)["chief"]["node_id"])
    wait_serving(cluster, worker["node_id"], "worker 0", 1)
    wait_for(lambda: "Epoch 2/12" in chief_agent.log(), TF_DEADLINE, "the chief's second epoch")
    kill(worker["worker_pid"])
    doc = cluster.wait_status(lambda d: roles(d)["worker 0"]["worker_pid"] not in (None, worker["worker_pid"]), 60,
                              "worker 0 replaced")
    assert doc["generation"] == 1 and doc["restarts_by_reason"] == {"worker_replaced": 1}
    assert cluster.wait_all(300) == [0, 0, 0, 0], cluster.logs()
    # At least once: the closure the killed worker ran (steps_per_execution=10) is retried, its applied steps again.
    done = re.search(r"done at step (\d+)", chief_agent.log())
    assert done is not None and 240 <= int(done.group(1)) <= 250, chief_agent.log()[-3000:]
