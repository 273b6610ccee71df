"""The agent's side of the restore step (daemon/agent/snapshot_scan.py, owned by the agent shell): it reads the
steps its node can restore off the event loop, bounded, never with two reads hanging at once, and removes its
local tier after a success. No coordinator and no worker: the Agent is only constructed, from its config."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
from tfelastic.daemon.agent import snapshot_scan
from tfelastic.daemon.agent.agent import Agent
from tfelastic.daemon.agent.api import RestorableSteps
from tfelastic.daemon.config import from_values
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.trainer import snapshots


def make_agent(tmp_path: Path, local: str | None = None) -> Agent:
    root = str(tmp_path / "shm") if local is None else local
    return Agent(from_values({"command": ("python",), "rendezvous": Endpoint("127.0.0.1", 29400), "node_id": "a",
                              "job": "mnist", "backup_dir": str(tmp_path / "backup"), "local_checkpoint_dir": root,
                              "metrics_port": None}))


def restorable(agent: Agent) -> tuple[int, ...]:
    """Read through a call, so that mypy does not narrow it between two inputs."""
    return agent.core.restorable.steps


def in_backup_dir(agent: Agent) -> tuple[int, ...]:
    return agent.core.restorable.shared


def make_snapshot(store: Path, step: int) -> None:
    store.mkdir(parents=True, exist_ok=True)
    building = Path(snapshots.temporary_dir(str(store), step))
    building.mkdir()
    (building / "ckpt.index").write_bytes(b"index")
    snapshots.seal(str(building), str(store), step)


def test_the_steps_come_from_the_local_tier_and_the_backup_dir(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "shm" / "mnist" / "a" / "fit", 30)
    make_snapshot(tmp_path / "shm" / "mnist" / "b" / "fit", 40)  # another node's tier on this host: not ours
    make_snapshot(tmp_path / "backup" / "fit", 20)
    agent = make_agent(tmp_path)
    asyncio.run(agent.worker.prepare(agent.core.session_starting()))
    assert restorable(agent) == (30, 20)
    assert in_backup_dir(agent) == (20,)  # every member reads it: the coordinator counts it as everyone's


def test_with_the_tier_off_only_the_backup_dir_counts(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "shm" / "mnist" / "a" / "fit", 30)
    make_snapshot(tmp_path / "backup" / "fit", 20)
    agent = make_agent(tmp_path, local="")
    asyncio.run(agent.worker.prepare(agent.core.session_starting()))
    assert restorable(agent) == (20,)


def test_a_hung_read_reports_no_step_and_is_not_started_again_while_it_hangs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    calls: list[list[str]] = []

    def hanging(roots: list[str]) -> RestorableSteps:
        calls.append(list(roots))
        release.wait(10)
        return RestorableSteps((99,), (99,))

    monkeypatch.setattr(snapshot_scan, "SCAN_SECONDS", 0.05)
    monkeypatch.setattr(snapshot_scan, "_read_steps", hanging)
    agent = make_agent(tmp_path)

    async def joins() -> None:
        agent.core.node_read(restorable=RestorableSteps((5,)))
        await agent.worker.prepare(agent.core.session_starting())
        assert restorable(agent) == ()  # not the old steps: they may have been pruned since
        await agent.worker.prepare(agent.core.session_starting())  # the first still hangs: no second thread
        assert len(calls) == 1 and restorable(agent) == ()
        release.set()
        await asyncio.sleep(0.1)
        await agent.worker.prepare(agent.core.session_starting())  # it returned: the next Join reads afresh
        assert len(calls) == 2 and restorable(agent) == (99,)

    with caplog.at_level(logging.WARNING, "tfelastic.agent"):
        asyncio.run(joins())
    assert "took longer than 0.05s (a hung mount?): this Join reports none" in caplog.text
    assert calls[0] == [str(tmp_path / "shm" / "mnist" / "a"), str(tmp_path / "backup")]


def test_a_failing_read_reports_no_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(roots: Iterable[str], limit: int = snapshots.MAX_REPORTED) -> list[int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(snapshots, "restorable_steps", broken)
    agent = make_agent(tmp_path)
    agent.core.node_read(restorable=RestorableSteps((5,)))
    asyncio.run(agent.worker.prepare(agent.core.session_starting()))
    assert restorable(agent) == ()


def test_after_a_success_the_nodes_tier_goes_and_the_jobs_directory_once_empty(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "shm" / "mnist" / "a" / "fit", 30)
    make_snapshot(tmp_path / "shm" / "other-job" / "a" / "fit", 30)
    agent = make_agent(tmp_path)
    agent._node.snapshots.remove_local_tier()
    assert not (tmp_path / "shm" / "mnist").exists()
    assert (tmp_path / "shm" / "other-job" / "a" / "fit").is_dir()  # another job's: untouched
    agent._node.snapshots.remove_local_tier()  # nothing left: nothing to do


def test_the_jobs_directory_stays_while_another_node_on_this_host_has_a_tier_there(tmp_path: Path) -> None:
    make_snapshot(tmp_path / "shm" / "mnist" / "a" / "fit", 30)
    make_snapshot(tmp_path / "shm" / "mnist" / "b" / "fit", 30)
    make_agent(tmp_path)._node.snapshots.remove_local_tier()
    assert sorted(p.name for p in (tmp_path / "shm" / "mnist").iterdir()) == ["b"]
