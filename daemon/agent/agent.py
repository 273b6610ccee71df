"""The per-node agent's asyncio shell: it does the I/O and :class:`~tfelastic.daemon.agent.core.AgentCore`
decides. Every event (a message, a worker's start, exit or stop, a progress report, a tick, a signal, what it read
of the node) goes to the core, and the shell carries out the actions the core returns, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.api import (
    Action,
    Announce,
    CoordinatorLost,
    DropSession,
    DumpStacks,
    EndStopSoon,
    ExitAgent,
    ExtendStop,
    FatalSessionError,
    HangUp,
    HostUntilJobEnds,
    KeepMetricsUp,
    Launch,
    ListenForProbe,
    ObserveEtcd,
    PrepareStandby,
    ProbeServer,
    RemoveLocalTier,
    RetryAfter,
    RunNodeCheck,
    Send,
    SessionLost,
    Stop,
    StopRetrying,
)
from tfelastic.daemon.agent.core import AgentCore
from tfelastic.daemon.agent.node import Node
from tfelastic.daemon.agent.placement import EtcdPlacement, placement_for
from tfelastic.daemon.agent.runner import agent_environment
from tfelastic.daemon.agent.session import CoordinatorSession, open_session
from tfelastic.daemon.agent.worker_shell import WorkerShell
from tfelastic.daemon.aio import first_of, stacks, within
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.client import EtcdCredentials
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.metrics.build import register_build_info
from tfelastic.daemon.metrics.http import MetricsServer, serve_metrics
from tfelastic.daemon.netutil import host_port, route_address
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.host import AGENTS_GONE_SECONDS
from tfelastic.daemon.sdnotify import ServiceHooks
from tfelastic.daemon.worker.warm import StandbyPolicy

log = logging.getLogger("tfelastic.agent")

GPU_POLL_SECONDS = 5.0
# A terminal closed under `tfelastic run` (SIGHUP) or Ctrl-\ (SIGQUIT) is a request to stop, like SIGTERM and
# Ctrl-C: the agent leaves the job cleanly. SIGUSR1 logs what the agent is doing and where it waits (USER_SIGNALS).
LEAVE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
USER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # SIGUSR2 only logs the agent's state
# Stepping down, after node_timeout: the agents' last reads of a verdict, an etcd hand-over and resignation.
CLOSING_SECONDS = AGENTS_GONE_SECONDS + 5.0


class Agent:
    def __init__(self, config: AgentConfig, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics_token: str | None = None,
                 etcd: EtcdCredentials | None = None, nvml: Any = None) -> None:
        self.config = config
        self._token, self._metrics_token, self._clock = token, metrics_token, clock
        self.registry = CollectorRegistry()
        host = config.node.advertise_address or route_address(config.rendezvous.route_host)
        self._placement = placement_for(config, host, token, etcd, self.registry)
        metrics = AgentMetrics(self.registry, config.job.name, config.node.id)
        register_build_info(self.registry, "agent")
        standby = StandbyPolicy.of_this_node()
        self.core = AgentCore.of(config, host, self._placement.failover, metrics, clock, standby.at_launch,
                                 lambda generation: self.worker.step_mark(generation))
        self._node = Node(config, self.registry, agent_environment(config.job.env), lambda: self.worker.live_pid,
                          nvml)
        self.worker = WorkerShell(config, self.core, self._node, self._apply, self._spawn, standby_nice=standby.nice)
        metrics.standby_memory.set_function(self.worker.runner.standby_memory)
        metrics.standby_ready.set_function(lambda: float(self.worker.runner.standby_ready()))
        self._checking: asyncio.Task[None] | None = None  # the node check under way: never two at once
        self._metrics_server: MetricsServer | None = None
        self._session: CoordinatorSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._leaving = asyncio.Event()  # a LEAVE_SIGNALS signal or a drain: cut the wait between retries short
        self._signalled = asyncio.Event()  # a LEAVE_SIGNALS signal: stop everything, a hosted coordinator too
        self._ticked_at = clock()  # the control loop's last turn, for systemd's watchdog
        self._exiting = False  # the session loop is over: the agent is on its way out
        self.hooks = ServiceHooks()

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in LEAVE_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        for sig in USER_SIGNALS:
            loop.add_signal_handler(sig, self._on_user_signal, sig)
        self.worker.start()
        code = int(ExitCode.FAILED)  # unless the job or the rendezvous says otherwise
        try:
            # The coordinator's port first: /metrics on a free port (0) could otherwise be given the very port
            # this agent is about to host the rendezvous on, and every agent would dial /metrics forever.
            await self._placement.host_if_owner()
            self._serve_metrics()
            self._spawn(self._watch_gpus())
            await self._placement.start()
            code = int(await self._run_sessions())
        except FatalSessionError as e:
            self.core.refused(str(e), e.exit_code)
            code = e.exit_code
        finally:
            self._exiting = True  # the way out has no ticks: the last stop, a hosted coordinator, /metrics' linger
            self._apply(self.core.final_stop())
            await self.worker.close()
            await self._prepare(self.core.worker_closed())
            await self._wind_down(code)
        return code

    async def _run_sessions(self) -> ExitCode:
        while True:
            self._ticked_at = self._clock()
            endpoint = await self._placement.coordinator()
            if endpoint is not None:
                await self._prepare(self.core.coordinator_found())
                try:
                    await self._session_once(endpoint)
                    ended = self.core.session_closed()
                except FatalSessionError as e:
                    self.core.refused(str(e), e.exit_code)
                    return e.exit_code
                except SessionLost as e:
                    ended = self.core.session_ended(str(e))
                except Exception as e:  # a bug must not leave a worker unsupervised: fence, and try again
                    log.exception("the session with the coordinator failed")
                    ended = self.core.session_ended(f"{type(e).__name__}: {e}")
                self._apply(ended)
            await self._prepare(self.core.between_sessions())
            await self.worker.idle()  # a fenced worker is gone before we try again
            self._placement.changed.clear()
            for action in self.core.next_attempt():
                if isinstance(action, ExitAgent):
                    return action.code
                if isinstance(action, RetryAfter):
                    await first_of(self._leaving.wait(), self._placement.changed.wait(), timeout=action.seconds)

    async def _session_once(self, endpoint: Endpoint) -> None:
        rdzv = self.config.rendezvous
        await self._prepare(self.core.session_starting())
        async with open_session(endpoint, rdzv.tls, self._token, self._clock,
                                hang_up_grace=rdzv.node_timeout) as session:
            self._session = session
            alongside = [asyncio.create_task(self._tick())]
            if isinstance(self._placement, EtcdPlacement):
                alongside.append(asyncio.create_task(self._leave_a_deposed_coordinator(self._placement, endpoint)))
            try:
                self._apply(self.core.session_opened())
                await session.run(self._received, alongside=alongside)
            finally:
                self._node.probe.close()
                self._session = None
                for task in alongside:
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(*alongside, return_exceptions=True)

    def _received(self, message: api.CoordinatorMessage) -> None:
        if not isinstance(message, api.Heartbeat):
            self._node.probe.close()  # the Join is answered; and the trainer may need the port now
        self._apply(self.core.received(message))

    def _start_check(self) -> asyncio.Task[None]:
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self._check_node())
        return self._checking

    async def _check_node(self) -> None:
        self.hooks.status("checking this node")
        failure = await self._node.check()
        await self._prepare(self.core.node_check_ended())
        self._apply(self.core.node_checked(failure))

    async def _leave_a_deposed_coordinator(self, placement: EtcdPlacement, endpoint: Endpoint) -> None:
        leader = await placement.another_leader(endpoint)
        if self._session is not None:
            self._session.drop(f"etcd names another coordinator, at {leader}")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.rendezvous.heartbeat_interval / 2)
            self._ticked_at = self._clock()
            self._apply(self.core.tick())

    async def _prepare(self, actions: Iterable[Action]) -> None:
        """The core's preparations, awaited in order: a node check and the exit's here, the rest on the worker's
        side."""
        for action in actions:
            if isinstance(action, RunNodeCheck):
                await self._start_check()
            elif isinstance(action, RemoveLocalTier):
                await asyncio.to_thread(self._node.snapshots.remove_local_tier)
            elif isinstance(action, HostUntilJobEnds):
                await self._placement.host_after_drain(self._signalled)
            elif isinstance(action, KeepMetricsUp):
                await self._keep_metrics_up(action.verdict)
            elif isinstance(action, ObserveEtcd):
                if isinstance(self._placement, EtcdPlacement):  # the core asks only with etcd (failover)
                    self._apply(self.core.etcd_observed(*await self._placement.observe_within(action.within)))
            else:
                await self.worker.prepare([action])

    def _apply(self, actions: Iterable[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                if self._session is not None:
                    self._session.send(action.message)
            elif isinstance(action, Launch):
                self.worker.launch(action.assignment)
            elif isinstance(action, Stop):
                self.worker.stop(action.reason, planned=action.planned, hold=action.hold, notify=action.notify)
            elif isinstance(action, ExtendStop):
                self.worker.extend_stop(action.within)
            elif isinstance(action, EndStopSoon):
                self.worker.end_stop_soon(action.within)
            elif isinstance(action, HangUp):
                if self._session is not None:
                    self._session.hang_up()
            elif isinstance(action, DropSession):
                if self._session is not None:
                    self._session.drop(action.reason)
            elif isinstance(action, RunNodeCheck):
                self._start_check()
            elif isinstance(action, ListenForProbe):
                self._apply(self.core.probe_listening(self._node.probe.open(action.port)))
            elif isinstance(action, PrepareStandby):
                self.worker.prepare_standby(action.assignment)
            elif isinstance(action, StopRetrying):
                self._leaving.set()
            elif isinstance(action, CoordinatorLost):
                self._placement.lost()
            elif isinstance(action, ProbeServer):
                self._spawn(self.worker.probe_server(action))
            elif isinstance(action, DumpStacks):
                self._spawn(self.worker.dump_stacks(action))
            elif isinstance(action, Announce):
                if action.ready:
                    self.hooks.ready()
                if action.status:
                    self.hooks.status(action.status)

    def control_loop_healthy(self, max_age: float) -> bool:
        """For systemd's watchdog: the control loop turned within ``max_age`` seconds. A worker stop in progress
        (bounded by its grace period) and the planned way out (job over, drain, SIGTERM) count as healthy."""
        if self._exiting or self.worker.stopping:
            return True
        return self._clock() - self._ticked_at <= max_age

    def _on_user_signal(self, signum: int) -> None:
        log.info("%s: %s, coordinator %s; %s", signal.Signals(signum).name, self.core.describe(),
                 "connected" if self._session is not None else "not connected",
                 "nothing else to do on this signal" if signum == signal.SIGUSR2 else "SIGTERM or SIGHUP leaves")
        if signum == signal.SIGUSR1:
            log.info("SIGUSR1: where the agent waits:\n%s", stacks())

    def _on_signal(self, signum: int) -> None:
        self._signalled.set()
        self._apply(self.core.signal_received(signum))

    # ----------------------------------------------------------------------------------- around the job

    async def _wind_down(self, code: int) -> None:
        """A drained node that hosts the coordinator keeps hosting it; after a failure, and on the coordinator's
        node after any verdict, /metrics stays up for ``metrics_linger`` so that Prometheus records the verdict
        (the alerts tell a finished job from a dead daemon by it); then the hosted coordinator stops (an etcd
        leader hands the job over), for at most ``node_timeout`` + :data:`CLOSING_SECONDS`: past that, the exit
        goes on."""
        host = self._placement.host
        await self._prepare(self.core.wind_down(hosting=host is not None))
        await self._prepare(self.core.hosting_ended(verdict_hosted=host is not None and host.verdict is not None))
        bound = self.config.rendezvous.node_timeout + CLOSING_SECONDS
        self.hooks.exit_decided(code, bound)
        try:
            closed = await within(self._placement.close(), bound)
        except Exception:  # the exit goes on whatever stepping down raised
            log.exception("stepping down failed")
            closed = True
        if not closed:
            log.error("stepping down did not finish within %gs; exiting anyway. Where the agent waits:\n%s",
                      bound, stacks())
        if self._metrics_server is not None:
            self._metrics_server.close()

    async def _keep_metrics_up(self, verdict: str) -> None:
        linger, host = self.config.metrics.linger, self._placement.host
        if self._metrics_server is None or not linger:
            return
        if host is not None:
            await host.wait_agents_gone()
        log.info("job %s: keeping /metrics up for %gs", verdict, linger)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._leaving.wait(), linger)

    def _serve_metrics(self) -> None:
        metrics = self.config.metrics
        if metrics.port is None:
            return
        self._metrics_server = serve_metrics(self.registry, metrics.address, metrics.port, self._metrics_token)
        log.info("metrics on http://%s/metrics", host_port(metrics.address, self._metrics_server.port))

    async def _watch_gpus(self) -> None:
        """The node's GPU summary for status, read off the loop: NVML calls may block."""
        while True:
            self.core.node_read(gpus=await self._node.gpu_summary())
            await asyncio.sleep(GPU_POLL_SECONDS)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

