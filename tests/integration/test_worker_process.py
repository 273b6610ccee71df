"""The worker process group with real processes: the keeper, the confirmed stop, and SIGTERM -> SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from tfelastic.daemon.worker import keeper as keeper_module
from tfelastic.daemon.worker.process import PEER_FAILED_SIGNAL, WorkerProcess, WorkerSpec, group_members
from tfelastic.daemon.worker.stacks import STACKS_SIGNAL, STACKS_SIGNAL_ENV, hang_site
from tfelastic.trainer.instrument import SITE_DIR

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


def test_a_trainer_that_announced_its_exit_is_ended_that_soon_not_at_the_end_of_the_grace(tmp_path: Path) -> None:
    """The agent's EndStopSoon: a trainer whose teardown would outlast the stop's 600 s grace ends 0.2 s after
    end_soon; the test's 60 s deadline fails the stop that waits for the grace."""
    async def scenario() -> tuple[list[int], int | None]:
        worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path, "ignore-term"), dict(os.environ), None,
                                                      "[t]", 1.0))
        pids = await asyncio.to_thread(_pids, tmp_path)
        stopping = asyncio.create_task(worker.stop(600.0))
        await asyncio.sleep(0)  # the SIGTERM is sent: the stop waits
        worker.end_soon(0.2)
        await asyncio.wait_for(stopping, 60)
        assert group_members(worker.pid) == []
        return pids, worker.returncode

    pids, returncode = asyncio.run(scenario())
    assert [p for p in pids if alive(p)] == []
    assert returncode == -signal.SIGKILL  # the agent counts it as the code announced (agent/worker_core.py)


def test_a_held_stop_sends_no_sigterm_until_its_hold_is_over(tmp_path: Path) -> None:
    """api.Stop's hold: the trainer gets time to meet its peer's failure itself; one that has not ended by the end
    of it is stopped as always (this one dies of the SIGTERM)."""
    async def scenario() -> tuple[bool, int | None]:
        worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path), dict(os.environ), None, "[t]", 5.0))
        await asyncio.to_thread(_pids, tmp_path)
        stopping = asyncio.create_task(worker.stop(5.0, hold_seconds=1.0))
        await asyncio.sleep(0.5)
        untouched = not stopping.done() and not worker.has_exited()  # a SIGTERM would have ended it at once
        await asyncio.wait_for(stopping, 60)
        return untouched, worker.returncode

    untouched, returncode = asyncio.run(scenario())
    assert untouched and returncode == -signal.SIGTERM


def test_a_held_stop_tells_the_trainer_that_a_peer_failed_and_no_process_outside_the_worker(tmp_path: Path) -> None:
    """api.Stop's notify: PEER_FAILED_SIGNAL to the trainer at the hold's start (this one has no handler: it dies
    of it at once, long before the hold's end); a pid that is not the worker's is never signalled."""
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        async def scenario(notify_outsider: bool) -> tuple[float, int | None]:
            worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path), dict(os.environ), None, "[t]", 5.0))
            await asyncio.to_thread(_pids, tmp_path)
            target = outsider.pid if notify_outsider else worker.trainer_pid()
            began = time.monotonic()
            await asyncio.wait_for(worker.stop(5.0, hold_seconds=30.0 if not notify_outsider else 0.5,
                                               notify=target), 60)
            return time.monotonic() - began, worker.returncode

        seconds, returncode = asyncio.run(scenario(False))
        assert returncode == -PEER_FAILED_SIGNAL and seconds < 30.0
        (tmp_path / "pids").unlink()
        _, returncode = asyncio.run(scenario(True))
        assert returncode == -signal.SIGTERM and outsider.poll() is None  # the hold ran out; the outsider lives
    finally:
        outsider.kill()
        outsider.wait()


def test_a_survivors_save_keeps_a_failure_stop_waiting_past_its_grace_until_the_trainer_announces_its_exit(
        tmp_path: Path) -> None:
    """The agent's ExtendStop then EndStopSoon: a 0.1 s failure grace, kept for 1.5 s from its start at least (the
    survivors' save), ended by end_soon once the save is durable."""
    async def scenario() -> tuple[float, float, int | None]:
        worker = await WorkerProcess.start(WorkerSpec(_family(tmp_path, "ignore-term"), dict(os.environ), None,
                                                      "[t]", 1.0))
        await asyncio.to_thread(_pids, tmp_path)
        began = time.monotonic()
        worker.extend_stop(1.5)  # announced before the stop: the usual order
        stopping = asyncio.create_task(worker.stop(0.1))
        await asyncio.sleep(0.5)
        assert not stopping.done()  # past its grace, kept
        kept = time.monotonic() - began
        worker.end_soon(0.2)
        await asyncio.wait_for(stopping, 60)
        return kept, time.monotonic() - began, worker.returncode

    kept, ended, returncode = asyncio.run(scenario())
    assert kept >= 0.5 and returncode == -signal.SIGKILL
    assert ended >= 0.7  # end_soon's 0.2 s after the 0.5 s: not the extension's end, not the grace's


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


# A trainer that hangs in a function of its own, under a shell, as a wrapper script would start it.
WEDGED = textwrap.dedent("""
    import time
    def wedged_in_the_input_pipeline():
        print("wedged", flush=True)
        while True:
            time.sleep(60)
    wedged_in_the_input_pipeline()
""")


def _wedged(tmp_path: Path, *interpreter_flags: str) -> tuple[str, WorkerSpec]:
    script = tmp_path / "wedged.py"
    script.write_text(WEDGED)
    env = {**os.environ, "PYTHONPATH": SITE_DIR, STACKS_SIGNAL_ENV: str(int(STACKS_SIGNAL))}
    # Not exec'd: the shell stays as the trainer's parent, and does not catch SIGUSR2.
    command = ["/bin/sh", "-c", f'"{sys.executable}" {" ".join(interpreter_flags)} "{script}"; exit $?']
    return str(script), WorkerSpec(command, env, None, "[t]", 5.0)


async def _dump_when_wedged(worker: WorkerProcess) -> tuple[list[str], str]:
    await asyncio.to_thread(wait_for, lambda: "wedged" in worker.tail, 30, "the trainer to wedge")
    return await worker.dump_stacks(STACKS_SIGNAL)


def test_a_wedged_trainer_under_a_shell_dumps_its_stacks_on_the_agents_signal_and_lives_on(tmp_path: Path) -> None:
    """The instrumentation's sitecustomize registers the dump; the agent asks the Python under the shell (the shell
    itself would die of SIGUSR2), and the trainer runs on until the agent stops it."""
    script, spec = _wedged(tmp_path)

    async def scenario() -> None:
        worker = await WorkerProcess.start(spec)
        lines, missing = await _dump_when_wedged(worker)
        assert missing == "" and (hang_site(lines) or "").startswith(f"hung in wedged_in_the_input_pipeline ({script}:")
        assert not worker.has_exited()
        assert any(line.startswith("Current thread 0x") for line in worker.tail)  # the log has the whole dump
        await worker.stop(5.0)

    asyncio.run(scenario())


def test_a_trainer_that_registers_no_dump_is_not_sent_the_signal_and_the_reason_is_given(tmp_path: Path) -> None:
    _, spec = _wedged(tmp_path, "-I")  # -I: no PYTHONPATH, so no sitecustomize

    async def scenario() -> None:
        worker = await WorkerProcess.start(spec)
        lines, missing = await _dump_when_wedged(worker)
        assert lines == [] and missing.startswith("no process of the worker catches SIGUSR2"), missing
        assert not worker.has_exited()
        await worker.stop(5.0)

    asyncio.run(scenario())


def test_a_trainer_stopped_by_sigstop_is_said_to_be_stopped(tmp_path: Path) -> None:
    _, spec = _wedged(tmp_path)

    async def scenario() -> None:
        worker = await WorkerProcess.start(spec)
        await asyncio.to_thread(wait_for, lambda: "wedged" in worker.tail, 30, "the trainer to wedge")
        python = psutil.Process(worker.pid).children(recursive=True)[-1]
        python.suspend()
        await asyncio.to_thread(wait_for, lambda: python.status() == psutil.STATUS_STOPPED, 10, "SIGSTOP")
        lines, missing = await worker.dump_stacks(STACKS_SIGNAL)
        assert lines == [] and missing == f"the trainer (pid {python.pid}) is stopped (SIGSTOP): it cannot dump its " \
                                          "stacks", missing
        await worker.stop(5.0)

    asyncio.run(scenario())


# A trainer whose Python forks a child that trains (and reports): both catch the signal (a fork keeps the handler).
# Each line is one write: unbuffered (PYTHONUNBUFFERED, as the agent runs a trainer) print writes a text and its
# newline apart, and two processes' writes on one pipe interleave ("waitingwedged 17799", under load).
FORKED = textwrap.dedent("""
    import os, sys, time
    def parent_waits():
        os.write(1, b"waiting\\n")
        os.waitpid(child, 0)
    def child_wedged_in_its_step():
        os.write(1, f"wedged {os.getpid()}\\n".encode())
        while True:
            time.sleep(60)
    child = os.fork()
    if child == 0:
        child_wedged_in_its_step()
    parent_waits()
""")


def test_the_process_that_reported_is_asked_for_its_stacks_before_its_parent(tmp_path: Path) -> None:
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    env = {**os.environ, "PYTHONPATH": SITE_DIR, STACKS_SIGNAL_ENV: str(int(STACKS_SIGNAL))}

    async def scenario() -> None:
        worker = await WorkerProcess.start(WorkerSpec([sys.executable, str(script)], env, None, "[t]", 5.0))
        line = await asyncio.to_thread(wait_for, lambda: next((t for t in worker.tail if t.startswith("wedged")), None),
                                       30, "the child to wedge")
        await asyncio.to_thread(wait_for, lambda: "waiting" in worker.tail, 30, "the parent to wait for it")
        reporter = int(line.split()[1])
        lines, missing = await worker.dump_stacks(STACKS_SIGNAL, reporter=reporter)
        assert (hang_site(lines) or "").startswith(f"hung in child_wedged_in_its_step ({script}:"), (lines, missing)
        lines, _ = await worker.dump_stacks(STACKS_SIGNAL)  # not known: the shallowest, the parent
        assert (hang_site(lines) or "").startswith(f"hung in parent_waits ({script}:"), lines
        await worker.stop(5.0)

    asyncio.run(scenario())
