"""The restore step with real agents: each reports the snapshot steps its node can restore (its local tier and the
backup dir), the coordinator picks the newest one every member has, and the trainers get it with the node's local
tier; a job that succeeded leaves no local tier behind, one that failed keeps it. The trainer is the counter (no
TensorFlow); the snapshots are made here with trainer/snapshots.py."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from tfelastic.trainer import snapshots
from tfelastic.trainer.environment import LOCAL_CHECKPOINT_DIR_ENV, RESTORE_STEP_ENV

from tests.cluster import COUNTER, FORM_WITH_ALL, kill, trainer_pids, wait_for
from tests.conftest import ClusterFactory

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
RECORD = {"COUNTER_RECORD_ENV": f"{RESTORE_STEP_ENV},{LOCAL_CHECKPOINT_DIR_ENV}"}
JOB = "default"  # the cluster's agents name no job


def make_snapshot(store: Path, step: int) -> None:
    """A complete snapshot of ``step`` in ``store``, as a trainer seals it."""
    store.mkdir(parents=True, exist_ok=True)
    building = Path(snapshots.temporary_dir(str(store), step))
    building.mkdir()
    (building / "ckpt.index").write_bytes(b"index")
    (building / "ckpt.data-00000-of-00001").write_bytes(b"\0" * 64)
    snapshots.seal(str(building), str(store), step)


def tier(root: Path, node: str) -> Path:
    return Path(snapshots.local_store_root(str(root), JOB, node))


def started(events: list[dict[str, Any]], generation: int) -> dict[int, dict[str, str | None]]:
    """The recorded environment of each rank's start in ``generation``."""
    return {e["rank"]: e["env"] for e in events if e["event"] == "start" and e["generation"] == generation}


def test_the_trainers_restore_the_newest_step_every_node_has_and_success_removes_the_local_tier(
        make_cluster: ClusterFactory, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    make_snapshot(tier(root, "a") / "fit", 30)  # only a has 30: its newer work is redone
    make_snapshot(tier(root, "a") / "fit", 20)
    make_snapshot(tier(root, "b") / "fit", 20)
    make_snapshot(tmp_path / "backup" / "fit", 10)  # the shared tier: every node sees it
    (tier(root, "b") / "fit" / snapshots.snapshot_name(30)).mkdir()  # an incomplete one (no manifest) is no step
    cluster = make_cluster(TRAINER, extra_args=[*FORM_WITH_ALL, "--local-checkpoint-dir", str(root)],
                           env={"COUNTER_STEPS": "120", **RECORD})
    cluster.start("a")
    cluster.start("b")
    doc = cluster.wait_running(1, 2, timeout=60)
    gen1 = started(cluster.events(), 1)
    assert {rank: env[RESTORE_STEP_ENV] for rank, env in gen1.items()} == {0: "20", 1: "20"}, cluster.logs()
    ranks = {n["node_id"]: n["rank"] for n in doc["nodes"]}
    assert {n: gen1[ranks[n]][LOCAL_CHECKPOINT_DIR_ENV] for n in "ab"} == {"a": str(tier(root, "a")),
                                                                            "b": str(tier(root, "b"))}
    logs = cluster.logs()
    assert "generation 1 restores step 20 (common to all 2 members)" in logs, logs
    assert "generation 1: node a has a newer snapshot (step 30) than step 20; its newer work is redone" in logs

    # Both nodes seal step 40 while generation 1 trains; the Joins after the stop report it.
    make_snapshot(tier(root, "a") / "fit", 40)
    make_snapshot(tier(root, "b") / "fit", 40)
    kill(trainer_pids(doc)[0], signal.SIGKILL)
    wait_for(lambda: len(started(cluster.events(), 2)) == 2, 60, "generation 2 to start")
    assert {env[RESTORE_STEP_ENV] for env in started(cluster.events(), 2).values()} == {"40"}, cluster.logs()

    assert cluster.wait_all(90) == [0, 0], cluster.logs()
    assert not root.joinpath(JOB).exists(), sorted(str(p) for p in root.rglob("*"))  # node tiers, then the job's
    assert (tmp_path / "backup" / "fit" / snapshots.snapshot_name(10)).is_dir()  # the shared tier is the trainer's
    assert cluster.logs().count("the job succeeded: removed this node's local snapshots") == 2, cluster.logs()


def test_a_failed_job_keeps_the_local_tier_and_a_node_without_one_gets_none(make_cluster: ClusterFactory,
                                                                            tmp_path: Path) -> None:
    root = tmp_path / "shm"
    make_snapshot(tier(root, "a") / "loop", 50)  # b has its tier off: nothing in common
    cluster = make_cluster(TRAINER, extra_args=[*FORM_WITH_ALL, "--max-restarts", "0"],
                           env={"COUNTER_STEPS": "60", "COUNTER_FAIL_AT": "5", **RECORD})
    cluster.start("a", extra=["--local-checkpoint-dir", str(root)])
    cluster.start("b", extra=["--local-checkpoint-dir", "off"])
    assert cluster.wait_all(60) == [1, 1], cluster.logs()
    gen1 = started(cluster.events(), 1)
    assert [env[RESTORE_STEP_ENV] for env in gen1.values()] == [None, None], cluster.logs()
    assert sorted(env[LOCAL_CHECKPOINT_DIR_ENV] or "" for env in gen1.values()) == ["", str(tier(root, "a"))]
    logs = cluster.logs()
    assert "generation 1: no snapshot step common to all 2 members" in logs, logs
    assert "generation 1: node a has a snapshot of step 50 that not every member has" in logs
    assert (tier(root, "a") / "loop" / snapshots.snapshot_name(50)).is_dir()  # a restarted job resumes from it
    assert "removed this node's local snapshots" not in cluster.logs()
