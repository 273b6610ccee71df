"""The agent shell's worker half: it launches the trainer and builds its standby, hands the runner's events and the
trainer's progress reports to the core, and reads what an old worker left on the node before a Join or a
relaunch (the steps its snapshots can restore, its GPU memory, its port). I/O only: the core decides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from tfelastic.daemon.agent import server_probe
from tfelastic.daemon.agent.api import (
    Action,
    DumpStacks,
    ProbeServer,
    ScanSnapshots,
    StopResult,
    WaitGpusReleased,
    WaitPortFree,
)
from tfelastic.daemon.agent.core import AgentCore
from tfelastic.daemon.agent.node import Node
from tfelastic.daemon.agent.replacements import PROBE_TIMEOUT
from tfelastic.daemon.agent.runner import WorkerRunner, worker_spec
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.worker.process import WorkerSpec
from tfelastic.daemon.worker.progress import ProgressListener
from tfelastic.trainer.progress import ProgressMessage, read_step_mark, reset_step_mark

log = logging.getLogger("tfelastic.agent")

Apply = Callable[[Iterable[Action]], None]
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class WorkerShell:
    """The :class:`WorkerRunner`'s host (its events go to ``core``, whose actions go to ``apply``) and the trainer's
    progress listener. ``standby_nice``: the standby's CPU priority on this node."""

    def __init__(self, config: AgentConfig, core: AgentCore, node: Node, apply: Apply, spawn: Spawn, *,
                 standby_nice: int = 0) -> None:
        self._config, self._core, self._node = config, core, node
        self._apply, self._spawn = apply, spawn
        self.runner = WorkerRunner(self, stop_grace=config.node.stop_grace,
                                   failure_stop_grace=config.node.failure_stop_grace,
                                   warm_start=config.node.warm_start, before_stopped=self.before_stopped,
                                   standby_nice=standby_nice)
        self._listener: ProgressListener | None = None

    def start(self) -> None:
        self._listener = ProgressListener(self._on_progress)
        self._listener.start()

    async def close(self) -> None:
        """Once the last stop is done: the standby and the listener go too."""
        await self.idle()
        await self.runner.close()
        if self._listener is not None:
            self._listener.close()

    @property
    def live_pid(self) -> int | None:
        return self.runner.live_pid

    @property
    def stopping(self) -> bool:
        return self.runner.stopping

    async def idle(self) -> None:
        """Until no stop is under way (a fenced worker is gone)."""
        await self.runner.idle()

    def stop(self, reason: str, *, planned: bool, hold: float = 0.0, notify: int = 0) -> None:
        self.runner.stop(reason, planned=planned, hold=hold, notify=notify)

    def extend_stop(self, within: float) -> None:
        self.runner.extend_stop(within)

    def end_stop_soon(self, within: float) -> None:
        self.runner.end_stop_soon(within)

    def launch(self, assignment: api.Assignment) -> None:
        assert self._listener is not None
        reset_step_mark(self._listener.step_file)  # every process of the last trainer is gone
        self.runner.launch(assignment.generation, self._spec(assignment))

    def prepare_standby(self, assignment: api.Assignment) -> None:
        self.runner.prepare_standby(self._spec(assignment))

    def _spec(self, assignment: api.Assignment) -> WorkerSpec:
        assert self._listener is not None
        return worker_spec(self._config, assignment, self._listener.path, self._node.snapshots.local_tier,
                           self._listener.step_file)

    def step_mark(self, generation: int) -> int | None:
        """The last step the trainer of ``generation`` marked before it died (None: none, or not this one's)."""
        return read_step_mark(self._listener.step_file, generation) if self._listener is not None else None

    async def probe_server(self, probe: ProbeServer) -> None:
        try:
            answered = await server_probe.answers(probe.address, PROBE_TIMEOUT)
        except Exception:  # never a probe that ends unanswered: the core waits for one answer at a time
            log.exception("probing the worker's server at %s", probe.address)
            answered = False
        self._apply(self._core.server_probed(probe.generation, answered))

    async def dump_stacks(self, ask: DumpStacks) -> None:
        try:
            lines, missing = await self.runner.dump_stacks(ask.pid)
        except Exception as e:  # never a hang left unreported: the core waits for this answer
            log.exception("asking the trainer for its stacks")
            lines, missing = [], f"asking for them failed: {e!r}"
        self._apply(self._core.stacks_dumped(ask.generation, lines, missing))

    # ------------------------------------------------------------------ worker events (runner -> core)

    def worker_started(self, generation: int, pid: int) -> None:
        self._apply(self._core.worker_started(generation, pid, warm=self.runner.launched_warm))

    def launch_failed(self, generation: int, error: str) -> None:
        self._apply(self._core.launch_failed(generation, error))

    def trainer_pid(self, generation: int, pid: int) -> None:
        self._apply(self._core.trainer_pid(generation, pid))

    def worker_exited(self, generation: int, code: int, output: Sequence[str], oom_killed: bool = False) -> None:
        self._apply(self._core.worker_exited(generation, code, output, oom_killed=oom_killed))

    def worker_stopped(self, result: StopResult) -> None:
        self._spawn(asyncio.to_thread(self._node.gpus.forget_xids))
        self._apply(self._core.worker_stopped(result))

    def _on_progress(self, message: ProgressMessage) -> None:
        self._apply(self._core.progress(message))

    # --------------------------------------------------------------------- what an old worker left

    async def before_stopped(self, result: StopResult) -> None:
        """The old worker is gone: what the core wants done before the stop is reported (what the Join after it
        reports, what the next trainer needs free)."""
        await self.prepare(self._core.worker_gone(result.pids))

    async def prepare(self, actions: Iterable[Action]) -> None:
        """Carries out the core's preparations in order, each answered before the next starts; any other action
        goes to ``apply``."""
        for action in actions:
            if isinstance(action, ScanSnapshots):
                self._core.node_read(restorable=await self._node.snapshots.restorable())
            elif isinstance(action, WaitGpusReleased):
                self._core.gpus_released(*await self._node.wait_gpus_released(action.pids))
            elif isinstance(action, WaitPortFree):
                await self._node.wait_port_free(action.port)
            else:
                self._apply([action])
