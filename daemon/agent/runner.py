"""The agent's hands on its worker: launch it, await its exit, find its trainer's pid, stop it. One at a time, and
nothing decided here: each outcome goes back to the agent's core through :class:`WorkerEvents`.

With warm start on, it also keeps the worker slot's standby (daemon/worker/warm.py) and launches through it
when it fits; any problem with a standby falls back to a cold start, and after :data:`STANDBY_FAILURES_MAX` of
them the agent stops building standbys."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Protocol

from tfelastic.daemon.agent.api import StopResult
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.rendezvous.api import Assignment
from tfelastic.daemon.rendezvous.roles import CHIEF, PS, WORKER
from tfelastic.daemon.sources import config_variables
from tfelastic.daemon.worker.instrument import instrumentation_env
from tfelastic.daemon.worker.process import PEER_FAILED_SIGNAL, PEER_FAILED_SIGNAL_ENV, WorkerProcess, WorkerSpec
from tfelastic.daemon.worker.stacks import STACKS_SIGNAL, STACKS_SIGNAL_ENV
from tfelastic.daemon.worker.warm import Standby, StandbyKey
from tfelastic.trainer.environment import LOCAL_CHECKPOINT_DIR_ENV, RESTORE_STEP_ENV, TrainerEnvironment
from tfelastic.trainer.progress import STEP_FILE_ENV

log = logging.getLogger("tfelastic.agent")

STANDBY_FAILURES_MAX = 3  # standbys that died, could not start or could not take a launch: warm start off


class WorkerEvents(Protocol):
    def worker_started(self, generation: int, pid: int) -> None: ...
    def launch_failed(self, generation: int, error: str) -> None: ...
    def trainer_pid(self, generation: int, pid: int) -> None: ...
    def worker_exited(self, generation: int, code: int, output: Sequence[str], oom_killed: bool = False) -> None: ...
    def worker_stopped(self, result: StopResult) -> None: ...


class WorkerRunner:
    """``before_stopped``: awaited with the stop's result once its processes are gone and before ``worker_stopped``
    (the agent reads what the old worker left on disk, and waits for its GPU memory, for the Join that follows);
    the stop is under way until it returns."""

    def __init__(self, events: WorkerEvents, *, stop_grace: float, failure_stop_grace: float,
                 warm_start: bool = False, before_stopped: Callable[[StopResult], Awaitable[None]] | None = None,
                 standby_nice: int = 0) -> None:
        self._events = events
        self._before_stopped = before_stopped
        self._stop_grace, self._failure_stop_grace = stop_grace, failure_stop_grace
        self._worker: WorkerProcess | None = None
        self._launching: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._warm_start, self._standby_nice = warm_start, standby_nice
        self._standby: Standby | None = None
        self._preparing: asyncio.Task[None] | None = None
        self._standby_failures = 0
        self.launched_warm = False  # how the last worker started

    @property
    def live_pid(self) -> int | None:
        """The keeper of a worker that may still run (for the host metrics), else None."""
        return self._worker.pid if self._worker is not None else None

    @property
    def stopping(self) -> bool:
        return self._stopping is not None and not self._stopping.done()

    async def dump_stacks(self, reporter: int) -> tuple[list[str], str]:
        """The running trainer's Python stacks (WorkerProcess.dump_stacks; ``reporter``: the pid that reported its
        progress), or why there are none."""
        worker = self._worker
        if worker is None or self.stopping:
            return [], "no trainer runs any more"
        return await worker.dump_stacks(STACKS_SIGNAL, reporter=reporter)

    def launch(self, generation: int, spec: WorkerSpec) -> None:
        self._launching = self._spawn(self._launch(generation, spec))

    def stop(self, why: str, *, planned: bool, hold: float = 0.0, notify: int = 0) -> None:
        """Starts a stop (``hold``: see api.Stop), unless one is under way: a stop is never interrupted, so that no
        worker is left half stopped, and the one under way covers this request."""
        if not self.stopping:
            grace = self._stop_grace if planned else self._failure_stop_grace
            self._stopping = self._spawn(self._stop(why, grace, hold, notify))

    def extend_stop(self, within: float) -> None:
        """The trainer saves the step it holds for the next generation: the stop waits ``within`` seconds from now
        at least (WorkerProcess.extend_stop)."""
        if self._worker is not None:
            self._worker.extend_stop(within)

    def end_stop_soon(self, within: float) -> None:
        """The trainer announced its exit code with its state saved: the stop waits ``within`` seconds more at
        most (WorkerProcess.end_soon)."""
        if self._worker is not None:
            self._worker.end_soon(within)

    async def idle(self) -> None:
        """Returns once no stop is under way."""
        while self.stopping:
            assert self._stopping is not None
            await asyncio.shield(self._stopping)

    def prepare_standby(self, spec: WorkerSpec) -> None:
        """Builds a standby for launches like ``spec``, unless warm start is off or one that fits is there."""
        if not self._warm_start or self._standby_failures >= STANDBY_FAILURES_MAX:
            return
        if self._preparing is not None and not self._preparing.done():
            return
        key = StandbyKey.of(spec)
        if key is None or (self._standby is not None and self._standby.key == key and self._standby.alive()):
            return
        self._preparing = self._spawn(self._prepare(key, spec))

    def standby_memory(self) -> int:
        """Resident bytes of the standby interpreter (0 without one)."""
        return self._standby.memory_bytes() if self._standby is not None else 0

    def standby_ready(self) -> bool:
        """A standby has imported TensorFlow and waits for a launch."""
        return self._standby is not None and self._standby.ready_after is not None and self._standby.alive()

    async def close(self) -> None:
        """The agent exits: its standby goes with it."""
        if self._preparing is not None:
            await asyncio.shield(self._preparing)
        standby, self._standby = self._standby, None
        if standby is not None:
            await standby.retire()

    async def _prepare(self, key: StandbyKey, spec: WorkerSpec) -> None:
        old, self._standby = self._standby, None
        if old is not None:
            await old.retire()
        try:
            self._standby = await Standby.start(key, spec, self._standby_nice)
            log.info("standby interpreter %d started for warm launches (%s)", self._standby.worker.pid,
                     key.interpreter)
        except Exception as e:  # whatever it is, the next launch starts cold: never a stuck launch
            self._standby_failed(f"cannot start a standby interpreter: {type(e).__name__}: {e}")

    def _standby_failed(self, why: str) -> None:
        self._standby_failures += 1
        off = self._standby_failures >= STANDBY_FAILURES_MAX
        log.warning("%s; this launch starts cold%s", why, "; warm start is off from now on" if off else "")

    async def _take_standby(self, spec: WorkerSpec) -> Standby | None:
        """The standby, if it fits this launch and is alive; a stale or dead one is retired."""
        if self._preparing is not None:
            await asyncio.shield(self._preparing)  # it is spawning (milliseconds): take it rather than go cold
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        if standby.alive() and standby.key == StandbyKey.of(spec):
            if standby.ready_after is not None:
                return standby
            # Still importing: a launch never waits for it (a trainer without TensorFlow starts in a fraction
            # of the import). It stays for the next launch.
            self._standby = standby
            log.info("the standby interpreter %d is still importing TensorFlow: this launch starts cold",
                     standby.worker.pid)
            return None
        if not standby.alive():
            last = standby.worker.tail[-1] if standby.worker.tail else "no output"
            self._standby_failed(f"the standby interpreter exited before its launch ({last})")
        self._spawn(standby.retire())
        return None

    async def _start(self, spec: WorkerSpec) -> WorkerProcess:
        standby = await self._take_standby(spec) if self._warm_start else None
        if standby is not None:
            try:
                worker = await standby.activate(spec)
                log.info("launched through the standby interpreter %d", worker.pid)
                self.launched_warm = True
                return worker
            except OSError as e:  # it died between the check and the launch (activate retired it)
                self._standby_failed(str(e))
        self.launched_warm = False
        return await WorkerProcess.start(spec)

    async def _launch(self, generation: int, spec: WorkerSpec) -> None:
        try:
            worker = await self._start(spec)
        except OSError as e:  # EMFILE, a workdir that disappeared, a full process table
            self._events.launch_failed(generation, f"{type(e).__name__}: {e}")
            return
        self._worker = worker
        self._events.worker_started(generation, worker.pid)
        self._spawn(self._report_trainer_pid(worker, generation))
        self._spawn(self._await_exit(worker, generation))

    async def _stop(self, why: str, grace: float, hold: float, notify: int) -> None:
        if self._launching is not None:
            await asyncio.shield(self._launching)  # a worker being started is stopped once it has started
        worker, result = self._worker, StopResult(None, True)
        if worker is not None:
            started = time.monotonic()
            await worker.stop(grace, hold, notify)
            log.info("worker stopped in %.3fs (%s)", time.monotonic() - started, why)
            result = StopResult(worker.returncode, worker.exited_before_stop, worker.pids)
            self._worker = None
        if self._before_stopped is not None:
            try:
                await self._before_stopped(result)
            except Exception:  # never a stop that does not end: the worker is gone, the core must hear it
                log.exception("after the worker stopped")
        self._events.worker_stopped(result)

    async def _report_trainer_pid(self, worker: WorkerProcess, generation: int) -> None:
        """Status shows the trainer's pid, not the keeper's; the keeper forks it within milliseconds."""
        pid = worker.pid
        for _ in range(100):
            pid = worker.trainer_pid()
            if pid != worker.pid or worker.has_exited():
                break
            await asyncio.sleep(0.01)
        if worker is self._worker:
            self._events.trainer_pid(generation, pid)

    async def _await_exit(self, worker: WorkerProcess, generation: int) -> None:
        code = await worker.wait()
        if worker is self._worker:
            self._events.worker_exited(generation, code, tuple(worker.tail), worker.oom_killed())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker task failed", exc_info=task.exception())


def worker_spec(config: AgentConfig, assignment: Assignment, progress_socket: str,
                local_checkpoint_dir: str | None, step_file: str | None = None) -> WorkerSpec:
    """How this node launches the assignment's trainer."""
    job = config.job
    env = trainer_env(agent_environment(job.env), assignment, job=job.name, node_id=config.node.id,
                      backup_dir=config.resolved_backup_dir(), progress_socket=progress_socket,
                      instrument=job.instrument, local_checkpoint_dir=local_checkpoint_dir, step_file=step_file)
    return WorkerSpec(job.command, env, job.workdir or None, f"[rank {assignment.rank}]",
                      config.node.failure_stop_grace)


def trainer_env(base: Mapping[str, str], assignment: Assignment, *, job: str, node_id: str, backup_dir: str,
                progress_socket: str, instrument: bool, local_checkpoint_dir: str | None = None,
                step_file: str | None = None) -> dict[str, str]:
    """The trainer's environment: ``base`` (the agent's, with the job's ``env`` on top), the generation's
    ``TF_CONFIG`` and ``TFELASTIC_*`` (the contract of :class:`TrainerEnvironment`: with the node's local
    snapshot tier, None when it is off, and the assignment's restore step), tf_keras unless the job says
    otherwise, the signal that asks for its Python stacks, and the automatic instrumentation."""
    env = dict(base)
    env.setdefault("TF_USE_LEGACY_KERAS", "1")  # Keras 3 cannot run model.fit under MWMS (docs/facts.md, fact 1)
    env.setdefault("PYTHONUNBUFFERED", "1")  # a print reaches the log as it happens, and is not lost to a kill
    for name in (LOCAL_CHECKPOINT_DIR_ENV, RESTORE_STEP_ENV, STEP_FILE_ENV, *config_variables()):
        env.pop(name, None)  # only the agent's own values: never one inherited from its environment
    if step_file:
        env[STEP_FILE_ENV] = step_file
    env[STACKS_SIGNAL_ENV] = str(int(STACKS_SIGNAL))  # a hung trainer's stacks, on this signal (worker/stacks.py)
    env[PEER_FAILED_SIGNAL_ENV] = str(int(PEER_FAILED_SIGNAL))  # a peer failed: trainer/peer_failure.py
    task_type, task_index = assignment.members[assignment.rank].task
    by_type = {t: tuple(m.address for m in assignment.members if m.task_type == t) for t in (CHIEF, PS, WORKER)}
    env.update(TrainerEnvironment(
        rank=assignment.rank, world_size=assignment.world_size, generation=assignment.generation,
        restart_count=assignment.restart_count, backup_dir=backup_dir, progress_socket=progress_socket, job=job,
        node_id=node_id, task_type=task_type, task_index=task_index,
        workers=by_type[CHIEF] + by_type[WORKER] if by_type[PS] else tuple(m.address for m in assignment.members),
        has_chief_job=bool(by_type[PS]), ps=by_type[PS], local_checkpoint_dir=local_checkpoint_dir,
        restore_step=assignment.restore_step).to_env())
    env.update(instrumentation_env(env, instrument))  # model.fit reports with no code change
    return env


def agent_environment(extra: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The agent's own environment with the job's ``env`` on top: what the trainer starts from."""
    return dict(os.environ, **dict(extra))
