"""A Keras script that knows nothing of tfelastic (tests/trainers/unmodified_keras.py), run by real agents: its
progress reaches ``tfelastic status`` and the hang detector through the automatic instrumentation alone."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from tfelastic.trainer.instrument import ENABLE_ENV, SITE_DIR

from tests.cluster import ROOT, TF_DEADLINE, Cluster, kill, members, trainer_pids, wait_for
from tests.conftest import ClusterFactory
from tests.integration.test_goodput_report import report

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

SCRIPT = str(ROOT / "tests" / "trainers" / "unmodified_keras.py")
EPOCHS, STEPS = 8, 10  # BackupAndRestore saves at the end of every epoch, its default
# The input pipeline takes 50 ms a batch, so that faults land mid-training, not in a run that already ended.
KNOBS = {"UNMODIFIED_EPOCHS": str(EPOCHS), "UNMODIFIED_STEPS": str(STEPS), "UNMODIFIED_STEP_SECONDS": "0.05"}
BASE_ARGS = ["--stop-grace", "1", "--last-call", "0.5", "--settle", "1"]
ARGS = [*BASE_ARGS, "--stall-timeout", "8"]


def start(make_cluster: ClusterFactory, tmp_path: Path, *, env: dict[str, str] | None = None,
          extra: list[str] | None = None, learned_stall_limit: bool = False) -> Cluster:
    """``learned_stall_limit``: hang detection as a user gets it, for a test that is not about a hang (a fixed
    limit also bounds start-up and restore, which other TensorFlow jobs on the machine can stretch past it)."""
    args = BASE_ARGS if learned_stall_limit else ARGS
    cluster = make_cluster([sys.executable, SCRIPT, str(tmp_path / "backup")], extra_args=[*args, *(extra or [])],
                           env={**KNOBS, **(env or {})})
    cluster.start("a")
    cluster.start("b")
    return cluster


def first_epoch(cluster: Cluster, generation: int) -> int:
    """The first epoch rank 0 printed in ``generation``: Keras starts at the epoch after the restored one."""
    for agent in cluster.agents:
        _, started, after = agent.log().partition(f"generation {generation}: started worker")
        found = re.search(r"\[rank 0\] Epoch (\d+)/", after) if started else None
        if found:
            return int(found.group(1))
    raise AssertionError(f"rank 0 printed no epoch in generation {generation}")


def test_each_restart_names_its_cause_and_the_set_resumes_from_the_checkpoint(make_cluster: ClusterFactory,
                                                                              tmp_path: Path) -> None:
    """A worker out of memory (TensorFlow's own ResourceExhaustedError) at the start of generation 1, then a
    SIGKILL of rank 1's trainer after two epochs of generation 2: each restart's record names the node whose trainer
    failed, and how, even when the survivor's report of its aborted collective reaches the coordinator first. The
    instrumentation alone reports each node's step to status (generation 2 is waited for past two epochs on both)."""
    marker = tmp_path / "oom-once"
    cluster = start(make_cluster, tmp_path, env={"UNMODIFIED_OOM_MARKER": str(marker)}, learned_stall_limit=True)
    doc = cluster.wait_status(lambda d: d["last_restart"] is not None, TF_DEADLINE, "the restart after the OOM")
    [oom_node] = [a.node_id for a in cluster.agents if "OOM when allocating tensor" in a.log()]
    assert doc["last_restart"]["ended"].startswith(
        f"worker_exit: {oom_node}: trainer ran out of memory: exited with code 1: "
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: "), doc["last_restart"]
    doc = cluster.wait_running(2, 2, timeout=TF_DEADLINE, step=2 * STEPS + 2)  # two epochs saved
    killed = members(doc)[1]
    kill(killed["worker_pid"])
    doc = cluster.wait_status(lambda d: d["generation"] >= 3 and d["state"] == "running", 60,
                              "the restart after the kill")
    assert doc["restarts_by_reason"] == {"worker_exit": 2}, doc
    assert doc["last_restart"] == {"generation": 2,
                                   "ended": f"worker_exit: {killed['node_id']}: trainer was killed by SIGKILL"}, doc
    assert cluster.wait_all(180) == [0, 0], cluster.logs()
    assert first_epoch(cluster, 3) >= 3, cluster.logs()  # resumed after epoch 2, not from scratch
    assert f"[rank 0] Epoch {EPOCHS}/{EPOCHS}" in cluster.logs()  # it completed
    assert "automatic progress reporting is off" not in cluster.logs()


def test_hung_input_pipeline_is_caught_as_a_stall(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    marker = tmp_path / "hung-once"
    # Batch 40 of a worker's pipeline: past the first epoch's save on either worker.
    cluster = start(make_cluster, tmp_path, env={"UNMODIFIED_HANG_AT": "40", "UNMODIFIED_HANG_MARKER": str(marker)})
    cluster.wait_running(1, 2, timeout=TF_DEADLINE, step=1)
    hung = wait_for(lambda: next((a for a in cluster.agents if "input pipeline: hanging" in a.log()), None),
                    TF_DEADLINE, "the input pipeline to hang")
    assert marker.exists()
    doc = cluster.wait_status(lambda d: d["generation"] >= 2, 60, "the restart after the stall")
    assert "stalled" in doc["restarts_by_reason"], doc
    assert "trainer stalled: no progress" in cluster.logs()
    assert hung.proc.poll() is None  # the agent is fine; only its trainer hung
    assert cluster.wait_all(180) == [0, 0], cluster.logs()
    assert first_epoch(cluster, 2) >= 3, cluster.logs()


def test_where_a_hung_trainer_hangs_is_in_the_log_status_and_report(make_cluster: ClusterFactory,
                                                                    tmp_path: Path) -> None:
    """Every worker's pipeline hangs at once, so whichever node the stall is first found on hangs in the script's
    own slow_input: its main thread waits in fit, called from main, and the pipeline's thread is in slow_input."""
    env = {"UNMODIFIED_HANG_AT": "15", "UNMODIFIED_HANG_MARKER": str(tmp_path / "hung"),
           "UNMODIFIED_HANG_EVERY_WORKER": "1"}
    cluster = start(make_cluster, tmp_path, env=env)
    doc = cluster.wait_status(lambda d: d["last_restart"] is not None, TF_DEADLINE + 60, "the restart after the stall")
    site = (rf"stalled: (?P<node>a|b): no progress for [\d.]+s \(stall_timeout=8s\); hung in main "
            rf"\({re.escape(SCRIPT)}:\d+\), waiting in \w+ \(.+\); another thread in slow_input "
            rf"\({re.escape(SCRIPT)}:\d+\)$")
    found = re.match(site, doc["last_restart"]["ended"])
    assert found, doc["last_restart"]
    assert report(str(cluster.endpoint))["generations"][0]["ended"] == doc["last_restart"]["ended"]
    log = next(a for a in cluster.agents if a.node_id == found["node"]).log()
    assert doc["last_restart"]["ended"].partition(": ")[2].partition(": ")[2] in log  # the agent logged the site
    assert re.search(r"\[rank \d\] Current thread 0x[0-9a-f]+ \(most recent call first\):", log)  # and the stacks
    cluster.stop()


def test_without_instrumentation_the_script_runs_and_status_has_no_step(make_cluster: ClusterFactory,
                                                                        tmp_path: Path) -> None:
    cluster = start(make_cluster, tmp_path, extra=["--no-instrument"])
    doc = cluster.wait_status(lambda d: d["state"] == "running" and len(trainer_pids(d)) == 2, TF_DEADLINE,
                              "2 trainers")
    for pid in trainer_pids(doc):
        env = psutil.Process(pid).environ()
        assert SITE_DIR not in env.get("PYTHONPATH", "") and env.get(ENABLE_ENV) == "0"
    samples = sample_status_until_done(cluster, timeout=120)
    assert cluster.wait_all(10) == [0, 0], cluster.logs()
    assert f"[rank 0] Epoch {EPOCHS}/{EPOCHS}" in cluster.logs()  # it trained while we looked
    running = [d for d in samples if d["state"] == "running" and len(members(d)) == 2]
    assert running, samples
    assert all(n["step"] is None for d in running for n in members(d)), running


def sample_status_until_done(cluster: Cluster, timeout: float) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while any(a.proc.poll() is None for a in cluster.agents):
        assert time.monotonic() < deadline, cluster.logs()
        doc = cluster.status()
        if doc is not None:
            samples.append(doc)
        time.sleep(0.2)
    return samples
