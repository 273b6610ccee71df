"""The worker process group with real processes: the keeper, the confirmed stop, and SIGTERM -> SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tfelastic.daemon.worker import keeper as keeper_module
from tfelastic.daemon.worker.process import WorkerProcess, WorkerSpec, group_members

from tests.cluster import alive, processes_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.quick]

# A trainer that starts a child, a grandchild that escapes into its own session, and records all their pids.
FAMILY = textwrap.dedent("""
    import os, subprocess, sys, time, signal
    if len(sys.argv) > 2 and sys.argv[2] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {child.pid} {escaped.pid}")
    time.sleep(600)
""")


def _family(tmp_path: Path, *extra: str) -> list[str]:
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    return [sys.executable, str(script), str(tmp_path / "pids"), *extra]


def _pids(tmp_path: Path) -> list[int]:
    path = tmp_path / "pids"
    wait_for(lambda: path.exists() and path.read_text().strip(), 20, "the trainer to start its family")
    return [int(p) for p in path.read_text().split()]


def test_stop_terminates_the_whole_tree_and_confirms(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path), dict(os.environ), None, "[t]", 5.0))
        pids = await asyncio.to_thread(_pids, tmp_path)
        await worker.stop(5.0)
        # the trainer died of the SIGTERM, and the keeper re-raised it: the worker ended by that signal
        assert worker.returncode == -signal.SIGTERM
        assert group_members(worker.pid) == []
        return pids

    pids = asyncio.run(scenario())
    assert [p for p in pids if alive(p)] == []


def test_stop_escalates_to_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[int], int | None]:
        worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path, "ignore-term"), dict(os.environ), None,
                                                      "[t]", 1.0))
        pids = await asyncio.to_thread(_pids, tmp_path)
        await worker.stop(1.0)
        assert group_members(worker.pid) == []
        return pids, worker.returncode

    pids, returncode = asyncio.run(scenario())
    assert [p for p in pids if alive(p)] == []
    # The trainer ignores SIGTERM and the keeper always does, so the worker survives the SIGTERM; only the
    # SIGKILL of the whole group after the grace period ends it, the keeper included.
    assert returncode == -signal.SIGKILL


def test_a_stopped_worker_names_every_process_it_had(tmp_path: Path) -> None:
    """What may still hold GPU memory after the stop: the keeper, the trainer, and every descendant, the one
    that escaped into its own session too (the agent waits for NVML to list none of them)."""
    async def scenario() -> tuple[list[int], int, int, tuple[int, ...], tuple[int, ...]]:
        worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path), dict(os.environ), None, "[t]", 5.0))
        pids = await asyncio.to_thread(_pids, tmp_path)
        trainer = worker.trainer_pid()
        before = worker.pids
        await worker.stop(5.0)
        return pids, worker.pid, trainer, before, worker.pids

    (trainer, child, escaped), keeper, found, before, after = asyncio.run(scenario())
    assert found == trainer
    assert before == tuple(sorted((keeper, trainer)))
    assert set(after) == {keeper, trainer, child, escaped}


def test_exit_status_and_signal_pass_through_the_keeper(tmp_path: Path) -> None:
    async def run(command: list[str]) -> int:
        worker = await WorkerProcess.start(WorkerSpec(command, dict(os.environ), None, "[t]", 5.0))
        return await worker.wait()

    assert asyncio.run(run([sys.executable, "-c", "raise SystemExit(7)"])) == 7
    assert asyncio.run(run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])) \
        == -signal.SIGKILL
    assert asyncio.run(run(["/nonexistent/trainer"])) == 127


def test_worker_never_outlives_a_sigkilled_agent(tmp_path: Path) -> None:
    """The agent here is a small Python process that starts a worker and waits; we SIGKILL it."""
    agent_script = tmp_path / "agent.py"
    agent_script.write_text(textwrap.dedent(f"""
        import asyncio, os
        from tfelastic.daemon.worker.process import WorkerProcess, WorkerSpec
        async def main():
            worker = await WorkerProcess.start(WorkerSpec({_family(tmp_path)!r}, dict(os.environ), None, "[t]", 2.0))
            await worker.wait()
        asyncio.run(main())
    """))
    agent = subprocess.Popen([sys.executable, str(agent_script)])
    try:
        pids = _pids(tmp_path)
        assert all(alive(p) for p in pids)
        agent.kill()
        agent.wait()
        wait_for(lambda: not any(alive(p) for p in pids), 15, "every worker process to die with its agent")
    finally:
        agent.kill()


def test_worker_never_outlives_an_agent_that_dies_while_the_keeper_starts(tmp_path: Path) -> None:
    """The agent exits right after spawning, before the keeper has armed its parent-death signal."""
    agent_script = tmp_path / "agent.py"
    agent_script.write_text(textwrap.dedent(f"""
        import asyncio, os
        from tfelastic.daemon.worker.process import WorkerProcess, WorkerSpec
        async def main():
            await WorkerProcess.start(WorkerSpec({_family(tmp_path)!r}, dict(os.environ), None, "[t]", 0.5))
            os._exit(0)
        asyncio.run(main())
    """))
    subprocess.run([sys.executable, str(agent_script)], check=True, timeout=60)
    wait_for(lambda: not processes_of(str(tmp_path)), 15, "every worker process to end with its agent")
    pids = tmp_path / "pids"
    if pids.exists() and pids.read_text().strip():  # the trainer got as far as starting its family
        assert not any(alive(int(p)) for p in pids.read_text().split())


def test_a_stop_that_comes_before_the_trainer_exists_still_reaches_it(tmp_path: Path) -> None:
    """The agent's SIGTERM to the worker's group can land while the keeper has not forked the trainer yet (a
    re-form right after a launch). The trainer must still get it, not train on until the SIGKILL after the grace
    period. The keeper is run as the agent starts it, except that its fork first signals its own group."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(keeper_module.__file__).parent)!r})
        import keeper
        fork = os.fork
        def stopped_then_fork():
            os.killpg(0, signal.SIGTERM)  # the agent's stop: the keeper exists, the trainer does not yet
            return fork()
        os.fork = stopped_then_fork
        sys.exit(keeper.main(["sleep", "300"]))
    """)
    worker = subprocess.Popen([sys.executable, "-I", "-S", "-c", script], start_new_session=True,
                              env={**os.environ, "TFELASTIC_KEEPER_GRACE": "1"})
    try:
        assert worker.wait(60) == -signal.SIGTERM  # the trainer (sleep) died of it, and the keeper said so
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
