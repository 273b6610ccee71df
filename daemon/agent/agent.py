"""The per-node agent's asyncio shell: it does the I/O, and :class:`~tfelastic.daemon.agent.core.AgentCore`
decides.

The shell holds a session with the coordinator (:mod:`~tfelastic.daemon.agent.session`), runs the worker
(:mod:`~tfelastic.daemon.agent.runner`), reads the trainer's progress reports, serves /metrics, polls the GPUs,
handles signals, hosts the coordinator when this node owns the rendezvous address
(:mod:`~tfelastic.daemon.agent.hosting`), and hands every event to the core and carries out the actions it
returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.api import (
    Action,
    Announce,
    DropSession,
    FatalSessionError,
    HangUp,
    Launch,
    ListenForProbe,
    RunNodeCheck,
    Send,
    SessionLost,
    Stop,
    StopResult,
)
from tfelastic.daemon.agent.core import AgentCore, Identity, Timing
from tfelastic.daemon.agent.nodecheck import MATMUL_TIMEOUT_SECONDS, NodeCheck, PortListener
from tfelastic.daemon.agent.placement import EmbeddedPlacement, EtcdPlacement
from tfelastic.daemon.agent.runner import WorkerRunner, agent_environment, trainer_env
from tfelastic.daemon.agent.session import CoordinatorSession, open_session
from tfelastic.daemon.agent.snapshot_scan import SnapshotScan
from tfelastic.daemon.aio import first_of, stacks
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.client import EtcdCredentials
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.metrics.gpu import register_gpu_collector, visible_gpus
from tfelastic.daemon.metrics.host import register_host_collector
from tfelastic.daemon.metrics.http import MetricsServer, serve_metrics
from tfelastic.daemon.netutil import free_port, host_port, route_address
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.host import AGENTS_GONE_SECONDS
from tfelastic.daemon.worker.process import WorkerSpec
from tfelastic.daemon.worker.progress import ProgressListener
from tfelastic.daemon.worker.states import WorkerState
from tfelastic.trainer.progress import ProgressMessage

log = logging.getLogger("tfelastic.agent")

RETRY_SECONDS = 0.2  # between attempts to reach the coordinator
GPU_POLL_SECONDS = 5.0
STANDBY_AFTER_PROGRESS_SECONDS = 10.0  # the next standby: this long after the trainer's first progress report,
STANDBY_DELAY_SECONDS = 40.0  # or this long after its launch (a trainer that does not report)
NODE_CHECK_SECONDS = MATMUL_TIMEOUT_SECONDS + 30.0  # the matmul's own bound, and the rest of the check
# A terminal closed under `tfelastic run` (SIGHUP) or Ctrl-\ (SIGQUIT) is a request to stop, like SIGTERM and
# Ctrl-C: the agent leaves the job cleanly. SIGUSR1 logs what the agent is doing and where it waits; SIGUSR2 is
# ignored.
LEAVE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Agent:
    def __init__(self, config: AgentConfig, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics_token: str | None = None,
                 etcd: EtcdCredentials | None = None) -> None:
        self.config = config
        self._token, self._metrics_token, self._clock = token, metrics_token, clock
        self.registry = CollectorRegistry()
        rdzv = config.rendezvous
        host = config.node.advertise_address or route_address(rdzv.route_host)
        self._placement: EmbeddedPlacement | EtcdPlacement = (
            EtcdPlacement(config, rdzv.etcd, etcd or EtcdCredentials(), Endpoint(host, rdzv.coordinator_port), token,
                          self.registry) if rdzv.etcd is not None else EmbeddedPlacement(config, token, self.registry))
        identity = Identity(config.node.id, host, config.job_spec(), uuid.uuid4().hex, config.node.worker_port,
                            str(rdzv.endpoint))
        timing = Timing(rdzv.heartbeat_interval, rdzv.node_timeout, rdzv.join_timeout, config.stall_limits(),
                        config.node.stop_grace, rdzv.tls.enabled, failover=self._placement.failover)
        self._agent_metrics = AgentMetrics(self.registry, config.job.name, config.node.id)
        self.core = AgentCore(identity, timing, self._agent_metrics, clock, free_port)
        self.runner = WorkerRunner(self, stop_grace=config.node.stop_grace,
                                   failure_stop_grace=config.node.failure_stop_grace,
                                   warm_start=config.node.warm_start, before_stopped=self._before_stopped)
        self._snapshots = SnapshotScan(config.local_tier(), config.resolved_backup_dir())
        self._agent_metrics.standby_memory.set_function(self.runner.standby_memory)
        self._agent_metrics.standby_ready.set_function(lambda: float(self.runner.standby_ready()))
        self._standby_due: tuple[int, WorkerSpec] | None = None  # build a standby after this generation's start
        register_host_collector(self.registry, lambda: self.runner.live_pid, config.resolved_backup_dir())
        trainer_gpus = agent_environment(config.job.env).get("CUDA_VISIBLE_DEVICES")  # its GPUs, not the node's
        self._gpus = register_gpu_collector(self.registry, visible=visible_gpus(trainer_gpus))
        self._node_check = NodeCheck(config.resolved_backup_dir(), config.node.id,
                                     config.node.check_min_free_mb << 20, gpu_problems=self._gpus.health_problems,
                                     gpu_count=lambda: self._gpus.utilization()[0])
        self._probe_port = PortListener()
        self._checking: asyncio.Task[None] | None = None  # the node check under way: never two at once
        self._listen_problem = ""  # why the last ListenForProbe could not listen, for the Join that follows
        self._listener: ProgressListener | None = None
        self._metrics_server: MetricsServer | None = None
        self._session: CoordinatorSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._leaving = asyncio.Event()  # SIGTERM, SIGINT or a drain: cut the wait between retries short
        self._signalled = asyncio.Event()  # SIGTERM or SIGINT: stop everything, a hosted coordinator too
        self._ticked_at = clock()  # the control loop's last turn, for systemd's watchdog
        self.on_status: Callable[[str], None] = lambda text: None  # systemd STATUS= lines hook here
        self.on_ready: Callable[[], None] = lambda: None  # systemd READY=1: the coordinator has taken us in
        # The process's exit code is decided, and what is left is bounded by the seconds given: the daemon arms
        # its exit guard here (exit_guard.py); nothing in-process.
        self.on_exit_decided: Callable[[int, float], object] = lambda code, seconds: None

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in LEAVE_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            loop.add_signal_handler(sig, self._on_user_signal, sig)
        self._listener = ProgressListener(self._on_progress)
        self._listener.start()
        self._serve_metrics()
        self._spawn(self._watch_gpus())
        code = int(ExitCode.FAILED)  # unless the job or the rendezvous says otherwise
        try:
            await self._placement.start()
            code = int(await self._run_sessions())
        except FatalSessionError as e:
            self.core.refused(str(e), e.exit_code)
            code = e.exit_code
        finally:
            self._apply(self.core.final_stop())
            await self.runner.idle()
            await self.runner.close()
            self._listener.close()
            if self.core.exit_code is ExitCode.SUCCEEDED:  # the job succeeded: nothing will resume from it
                await asyncio.to_thread(self._snapshots.remove_local_tier)
            await self._wind_down(code)
        return code

    async def _run_sessions(self) -> ExitCode:
        while True:
            self._ticked_at = self._clock()
            endpoint = await self._placement.coordinator()
            if endpoint is not None and self.core.check_owed:
                await self._start_check()
            if endpoint is not None:
                attached_before = self.core.sessions_opened
                try:
                    await self._session_once(endpoint)
                    problem = None if self.core.winding_down else "the coordinator closed the session"
                except FatalSessionError as e:
                    self.core.refused(str(e), e.exit_code)
                    return e.exit_code
                except SessionLost as e:
                    problem = str(e)
                except Exception as e:  # a bug must not leave a worker unsupervised: fence, and try again
                    log.exception("the session with the coordinator failed")
                    problem = f"{type(e).__name__}: {e}"
                self._apply(self.core.session_ended(problem))
                if problem is not None and self.core.sessions_opened > attached_before:
                    self._placement.lost()
            if self._placement.failover:
                self._apply(self.core.etcd_observed(*await self._observe_etcd()))
            await self.runner.idle()  # a fenced worker is gone before we try again
            verdict = self.core.verdict()
            if verdict is not None:
                return verdict
            self._placement.changed.clear()
            await first_of(self._leaving.wait(), self._placement.changed.wait(), timeout=RETRY_SECONDS)

    async def _observe_etcd(self) -> tuple[int | None, float | None, bool]:
        """What etcd says, or nothing if it does not say it before this node must decide whether to fence."""
        try:
            return await asyncio.wait_for(self._placement.observe(), self.core.etcd_patience())
        except asyncio.TimeoutError:
            return None, self._placement.known_for(), True

    async def _session_once(self, endpoint: Endpoint) -> None:
        rdzv = self.config.rendezvous
        if not self.core.worker.state.has_live_worker:  # else the Join attaches a running worker (etcd)
            await self._read_restorable_steps()
        async with open_session(endpoint, rdzv.tls, self._token, self._clock,
                                hang_up_grace=rdzv.node_timeout) as session:
            self._session = session
            alongside = [asyncio.create_task(self._tick())]
            if self._placement.failover:
                alongside.append(asyncio.create_task(self._leave_a_deposed_coordinator(endpoint, session)))
            try:
                self._apply(self.core.session_opened())
                await session.run(self._received, alongside=alongside)
            finally:
                self._probe_port.close()
                self._session = None
                for task in alongside:
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(*alongside, return_exceptions=True)

    def _received(self, message: api.CoordinatorMessage) -> None:
        if not isinstance(message, api.Heartbeat):
            self._probe_port.close()  # the Join is answered; and the trainer may need the port now
        self._apply(self.core.received(message))

    def _start_check(self) -> asyncio.Task[None]:
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self._check_node())
        return self._checking

    async def _check_node(self) -> None:
        """The node check, off the loop and bounded: a hung mount must not keep the node out of the job
        silently (the thread it hangs in stays behind; the check says why it failed)."""
        self.on_status("checking this node")
        try:
            failure = await asyncio.wait_for(asyncio.to_thread(self._node_check.run), NODE_CHECK_SECONDS)
        except asyncio.TimeoutError:
            failure = f"the node check did not finish within {NODE_CHECK_SECONDS:g}s (a hung mount of the " \
                      f"backup dir {self.config.resolved_backup_dir()}? a wedged GPU?)"
        if self._session is not None and self.core.worker.state is WorkerState.WAITING:  # a Join goes out now
            await self._read_restorable_steps()
        self._apply(self.core.node_checked(failure))

    async def _leave_a_deposed_coordinator(self, endpoint: Endpoint, session: CoordinatorSession) -> None:
        """With etcd: a coordinator cut off from etcd but not from us is no longer the job's once etcd names
        another; go to that one (its take-over keeps our worker)."""
        while True:
            await self._placement.changed.wait()
            self._placement.changed.clear()
            leader = self._placement.named()
            if leader is not None and leader != endpoint:
                session.drop(f"etcd names another coordinator, at {leader}")
                return

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.rendezvous.heartbeat_interval / 2)
            self._ticked_at = self._clock()
            self._apply(self.core.tick())

    def _apply(self, actions: Iterable[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                message = action.message
                if isinstance(message, api.Join) and message.checked and self._listen_problem:
                    message = dataclasses.replace(message, check_failure="; ".join(
                        p for p in (message.check_failure, self._listen_problem) if p))
                if self._session is not None:
                    self._session.send(message)
            elif isinstance(action, Launch):
                self._launch(action.assignment)
            elif isinstance(action, Stop):
                self.runner.stop(action.reason, planned=action.planned)
            elif isinstance(action, HangUp):
                if self._session is not None:
                    self._session.hang_up()
            elif isinstance(action, DropSession):
                if self._session is not None:
                    self._session.drop(action.reason)
            elif isinstance(action, RunNodeCheck):
                self._start_check()
            elif isinstance(action, ListenForProbe):
                self._listen_problem = self._probe_port.open(action.port)
                if self._listen_problem:
                    log.error("node check failed: %s", self._listen_problem)
            elif isinstance(action, Announce):
                if action.ready:
                    self.on_ready()
                if action.status:
                    self.on_status(action.status)
            if self.core.leaving is not None:
                self._leaving.set()

    def _launch(self, assignment: api.Assignment) -> None:
        assert self._listener is not None
        job = self.config.job
        env = trainer_env(agent_environment(job.env), assignment, job=job.name, node_id=self.config.node.id,
                          backup_dir=self.config.resolved_backup_dir(), progress_socket=self._listener.path,
                          instrument=job.instrument, local_checkpoint_dir=self._snapshots.local_tier)
        spec = WorkerSpec(job.command, env, job.workdir or None, f"[rank {assignment.rank}]",
                          self.config.node.failure_stop_grace)
        self.runner.launch(assignment.generation, spec)
        # The next generation's standby is built once this trainer is past its start-up and its first steps
        # (which trace and compile), so that the two do not compete for the CPU; a job that fails in its
        # first seconds relaunches cold (and builds no standby it would not use).
        self._standby_due = (assignment.generation, spec)
        asyncio.get_running_loop().call_later(STANDBY_DELAY_SECONDS, self._prepare_standby, assignment.generation)

    def _prepare_standby(self, generation: int) -> None:
        if self._standby_due is not None and self._standby_due[0] == generation and not self.core.winding_down:
            self.runner.prepare_standby(self._standby_due[1])
            self._standby_due = None

    def control_loop_healthy(self, max_age: float) -> bool:
        """For systemd's watchdog: the control loop turned within ``max_age`` seconds. A worker stop in progress
        (bounded by its grace period) and the planned way out (job over, drain, SIGTERM) count as healthy."""
        if self.core.winding_down or self.runner.stopping:
            return True
        return self._clock() - self._ticked_at <= max_age

    def _on_user_signal(self, signum: int) -> None:
        core = self.core
        a = core.assignment
        log.info("%s: worker %s, generation %s%s, coordinator %s; %s", signal.Signals(signum).name,
                 core.worker.state.value, a.generation if a else "-", f" as rank {a.rank}" if a else "",
                 "connected" if self._session is not None else "not connected",
                 "nothing else to do on this signal" if signum == signal.SIGUSR2 else "SIGTERM or SIGHUP leaves")
        if signum == signal.SIGUSR1:
            log.info("SIGUSR1: where the agent waits:\n%s", stacks())

    def _on_signal(self, signum: int) -> None:
        self._signalled.set()
        self._apply(self.core.signal_received(signum))
        self._leaving.set()

    # ------------------------------------------------------------------ worker events (runner -> core)

    def worker_started(self, generation: int, pid: int) -> None:
        self._agent_metrics.launches.labels(start="warm" if self.runner.launched_warm else "cold").inc()
        self._apply(self.core.worker_started(generation, pid))

    def launch_failed(self, generation: int, error: str) -> None:
        self._apply(self.core.launch_failed(generation, error))

    def trainer_pid(self, generation: int, pid: int) -> None:
        self._apply(self.core.trainer_pid(generation, pid))

    def worker_exited(self, generation: int, code: int, output: Sequence[str]) -> None:
        self._apply(self.core.worker_exited(generation, code, output))

    def worker_stopped(self, result: StopResult) -> None:
        self._spawn(asyncio.to_thread(self._gpus.forget_xids))
        self._apply(self.core.worker_stopped(result))

    async def _before_stopped(self) -> None:
        """The old worker is gone: what it left is what the Join after the stop reports."""
        if self.core.rejoins_after_stop:
            await self._read_restorable_steps()

    def _on_progress(self, message: ProgressMessage) -> None:
        first = self.core.tracker.latest is None
        self._apply(self.core.progress(message))
        if first and self._standby_due is not None and self._standby_due[0] == message.generation:
            asyncio.get_running_loop().call_later(STANDBY_AFTER_PROGRESS_SECONDS, self._prepare_standby,
                                                  message.generation)

    async def _read_restorable_steps(self) -> None:
        """What the next Join reports: the snapshot steps this node can restore (snapshot_scan.py)."""
        self.core.restorable = await self._snapshots.restorable()

    # ----------------------------------------------------------------------------------- around the job

    async def _wind_down(self, code: int) -> None:
        """A drained node that hosts the coordinator keeps serving it; after a failure, and on the coordinator's
        node after any verdict, /metrics stays up for ``metrics_linger`` so that Prometheus records the verdict
        (the alerts tell a finished job from a dead daemon by it); then the hosted coordinator stops (an etcd
        leader hands the job over), for at most :meth:`_closing_seconds`: past that, the exit goes on."""
        leaving = self.core.leaving
        host = self._placement.host
        if leaving is not None and leaving.drained and host is not None:
            self.on_status("drained: hosting the coordinator until the job ends")
            await self._placement.serve_after_drain(self._signalled)
        linger = self.config.metrics.linger
        verdict = host.verdict if host is not None else None
        if (self.core.exit_code is ExitCode.FAILED or verdict is not None) and self._metrics_server is not None \
                and linger:
            if host is not None:
                await host.wait_agents_gone()
            log.info("job %s: keeping /metrics up for %gs", "failed" if self.core.exit_code is ExitCode.FAILED
                     else "succeeded", linger)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._leaving.wait(), linger)
        bound = self._closing_seconds()
        self.on_exit_decided(code, bound)
        closing = asyncio.ensure_future(self._placement.close())
        done, _ = await asyncio.wait({closing}, timeout=bound)
        if not done:
            log.error("stepping down did not finish within %gs; exiting anyway. Where the agent waits:\n%s",
                      bound, stacks())
            closing.cancel()
        if self._metrics_server is not None:
            self._metrics_server.close()

    def _closing_seconds(self) -> float:
        """A hand-over to another coordinator, the agents' last reads of a verdict, an etcd resignation."""
        return self.config.rendezvous.node_timeout + AGENTS_GONE_SECONDS + 5.0

    def _serve_metrics(self) -> None:
        metrics = self.config.metrics
        if metrics.port is None:
            return
        self._metrics_server = serve_metrics(self.registry, metrics.address, metrics.port, self._metrics_token)
        log.info("metrics on http://%s/metrics", host_port(metrics.address, self._metrics_server.port))

    async def _watch_gpus(self) -> None:
        """The node's GPU summary for status, read off the loop: NVML calls may block."""
        while True:
            self.core.gpus = await asyncio.to_thread(self._gpus.utilization)
            await asyncio.sleep(GPU_POLL_SECONDS)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

