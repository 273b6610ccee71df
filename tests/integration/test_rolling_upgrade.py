"""A rolling upgrade (docs/operations.md, "Upgrades"): the agents of a running job move, one node at a time, from
this build to another build that speaks the same protocol, and no step is lost.

The other build is this checkout with another version: a copy of the daemon package whose ``VERSION`` differs,
put ahead of the installed package on ``PYTHONPATH`` (the trainer library is the same). Each node is drained as
``systemctl stop`` does (SIGTERM: its trainer checkpoints on SIGTERM and exits 42) and started again on the new
build. The counter trainer saves only on SIGTERM here, so a lost step would show as a generation that starts
anywhere but where the previous one stopped.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.version import PROTOCOL, VERSION

from tests.cluster import COUNTER, ROOT, Cluster, members, wait_for
from tests.conftest import ClusterFactory

pytestmark = pytest.mark.integration

NEW_VERSION = VERSION + ".post1"
NODES = ("a", "b", "c")


def other_build(folder: Path) -> Path:
    """A tree that imports as tfelastic with version NEW_VERSION: put it on PYTHONPATH."""
    package = folder / "tfelastic"
    shutil.copytree(ROOT / "daemon", package / "daemon", ignore=shutil.ignore_patterns("__pycache__"))
    (package / "trainer").symlink_to(ROOT / "trainer")
    version = package / "daemon" / "version.py"
    text = version.read_text()
    assert f'VERSION = "{VERSION}"' in text
    version.write_text(text.replace(f'VERSION = "{VERSION}"', f'VERSION = "{NEW_VERSION}"'))
    return folder


@pytest.fixture
def coordinator(tmp_path: Path, make_cluster: ClusterFactory) -> Iterator[Cluster]:
    """A job with a head-node coordinator of the old build, as docs/operations.md recommends for a rolling
    upgrade; the counter runs for far longer than the test, which stops it."""
    cluster = make_cluster([sys.executable, COUNTER], nodes="2:3",
                           extra_args=["--stop-grace", "10", "--last-call", "0.3", "--settle", "0.5"],
                           env={"COUNTER_STEPS": "1000000", "COUNTER_STEP_SECONDS": "0.02",
                                "COUNTER_SAVE_EVERY": "1000000000", "COUNTER_CHECKPOINT_ON_TERM": "1"})
    log = (tmp_path / "coordinator.log").open("ab")
    head = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen",
                             str(cluster.endpoint), "--node-id", "head", "--metrics-port", "off", "--settle", "0.5",
                             "--last-call", "0.3"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_for(lambda: "listening on" in (tmp_path / "coordinator.log").read_text(), 30, "the coordinator")
        yield cluster
    finally:
        cluster.stop()
        head.kill()
        head.wait()
        log.close()


def test_a_rolling_upgrade_of_every_agent_loses_no_step(coordinator: Cluster, tmp_path: Path) -> None:
    cluster = coordinator
    build = other_build(tmp_path / "build")
    agents = {node: cluster.start(node) for node in NODES}
    cluster.wait_status(lambda d: d["state"] == "running" and d["world_size"] == 3, 60, "3 nodes training")
    for node in NODES:
        agents[node].proc.send_signal(signal.SIGTERM)  # systemctl stop: a drain
        assert agents[node].wait(60) == 0, agents[node].log()
        agents[node] = cluster.start(node, env={"PYTHONPATH": str(build)})
        cluster.wait_status(partial(running_with, node=node, version=NEW_VERSION), 60, f"{node} on the new build")
    assert f"tfelastic {NEW_VERSION} (protocol {PROTOCOL})" in agents["a"].log()  # the new build really ran
    upgraded = cluster.wait_status(lambda d: d["state"] == "running" and min(n["step"] or 0 for n in members(d))
                                   > resumed_at(cluster) + 20, 60, "training on, every node upgraded")
    assert {n["version"] for n in members(upgraded)} == {NEW_VERSION}
    assert upgraded["coordinator"]["version"] == VERSION  # the head node is upgraded last, on its own
    for node in NODES:
        agents[node].proc.send_signal(signal.SIGTERM)
    assert [agents[node].wait(60) for node in NODES] == [0, 0, 0], cluster.logs()[-4000:]
    assert_every_generation_resumed_where_the_last_stopped(cluster.events())


def running_with(doc: dict[str, Any], *, node: str, version: str) -> bool:
    mine = [n for n in members(doc) if n["node_id"] == node]
    return doc["state"] == "running" and doc["world_size"] == 3 and bool(mine) and mine[0]["version"] == version


def resumed_at(cluster: Cluster) -> int:
    return max(int(e["step"]) for e in cluster.events() if e["event"] == "start")


def assert_every_generation_resumed_where_the_last_stopped(events: list[dict[str, Any]]) -> None:
    """Every generation resumes at the chief's newest save (the chief's save is the job's; counters do not wait
    for each other), and every chief that started saved when it was stopped. A generation that a rejoin
    superseded before its chief started (seen on a loaded machine: only rank 1 ran) saves nothing, and the next
    resumes at the save before it."""
    generations = sorted({e["generation"] for e in events if e["event"] == "start"})
    # Each node's return starts a generation; its leave may not (a rejoin inside `settle` supersedes it).
    assert len(generations) >= 1 + len(NODES), generations
    newest_save: int | None = None
    for generation in generations:
        resumed = {e["step"] for e in events if e["event"] == "start" and e["generation"] == generation}
        if newest_save is not None:
            assert resumed == {newest_save} and newest_save != 0, (generation, newest_save, resumed)
        chief_started = any(e["event"] == "start" and e["generation"] == generation and e["rank"] == 0
                            for e in events)
        saved = {e["step"] for e in events if e["event"] == "checkpointed" and e["generation"] == generation
                 and e["rank"] == 0}
        assert len(saved) == (1 if chief_started else 0), (generation, saved, chief_started)
        newest_save = saved.pop() if saved else newest_save
