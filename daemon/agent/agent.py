"""The per-node agent: joins the rendezvous, runs this node's worker, and reports what happens to it.

The agent obeys the coordinator: it launches a worker on an Assignment, stops it on StopWorkers and joins
again, and exits on JobFinished. It decides on its own only to fence itself: when the coordinator is silent for
``node_timeout`` it stops its worker at once, since the others have already re-formed without it.

If this node owns the rendezvous endpoint, the agent also tries to host the coordinator; when several agents on
one host try, the exclusive bind lets exactly one succeed, and after that one dies another takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.api import ExitCode, FatalSessionError
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.metrics.cluster import ClusterCollector, register_cluster_collector
from tfelastic.daemon.metrics.gpu import register_gpu_collector, visible_gpus
from tfelastic.daemon.metrics.host import register_host_collector
from tfelastic.daemon.metrics.http import MetricsServer, serve_metrics
from tfelastic.daemon.netutil import free_port, host_port, is_local_address, route_address
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.client import HandshakeFailures, call_metadata, open_channel
from tfelastic.daemon.rendezvous.server import BindError, Coordinator, create_server
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc
from tfelastic.daemon.worker.instrument import instrumentation_env
from tfelastic.daemon.worker.process import WorkerProcess, WorkerSpec
from tfelastic.daemon.worker.progress import ProgressListener
from tfelastic.daemon.worker.stall import StallDetector
from tfelastic.daemon.worker.states import WorkerState, WorkerStateMachine
from tfelastic.trainer.exit_codes import CHECKPOINTED_AND_STOPPED
from tfelastic.trainer.progress import ProgressMessage

log = logging.getLogger("tfelastic.agent")

_FATAL_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: ExitCode.CONFIG,
    grpc.StatusCode.FAILED_PRECONDITION: ExitCode.CONFIG,
    grpc.StatusCode.ALREADY_EXISTS: ExitCode.CONFIG,
    grpc.StatusCode.INVALID_ARGUMENT: ExitCode.CONFIG,
    grpc.StatusCode.ABORTED: ExitCode.FAILED,
}


if TYPE_CHECKING:  # generic only in the stubs
    SessionCall = grpc.aio.StreamStreamCall[pb.AgentMessage, pb.CoordinatorMessage]


_PLANNED_REASONS = frozenset(r.value for r in api.RestartReason if not r.counts_against_budget)


class _SessionLost(Exception):
    pass


class Agent:
    def __init__(self, config: AgentConfig, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics_token: str | None = None) -> None:
        self.config = config
        self._token = token
        self._clock = clock
        self.registry = CollectorRegistry()
        self.metrics = AgentMetrics(self.registry, config.job, config.node_id)
        register_host_collector(self.registry, self._live_worker_pid, config.resolved_backup_dir())
        trainer_gpus = dict(os.environ, **dict(config.env)).get("CUDA_VISIBLE_DEVICES")  # its GPUs, not the node's
        self._gpus = register_gpu_collector(self.registry, visible=visible_gpus(trainer_gpus))
        self._gpu_summary = (0, 0.0)
        self._recent_steps: deque[tuple[float, int]] = deque()  # (time, step) over the last 30 s
        self._checkpoint_at: float | None = None
        self._metrics_token = metrics_token
        self._metrics_server: MetricsServer | None = None
        self._cluster_metrics: ClusterCollector | None = None
        self._join_sent_at: float | None = None
        self._failed_at: float | None = None  # this node's worker failed (exit, stall), until the stop order
        self._stop_after_failure_at: float | None = None  # a failure stop order, until the next first progress
        self.worker_state = WorkerStateMachine(on_change=self.metrics.set_worker_state)
        self._worker: WorkerProcess | None = None
        self._assignment: api.Assignment | None = None
        self._last_generation = 0
        self._restart_count = 0
        self._stall = StallDetector(config.stall_timeout, clock)
        self._stall_reported = False
        self._progress: ProgressMessage | None = None
        self._progress_at = 0.0
        self._progress_sent: ProgressMessage | None = None
        self._coordinator: Coordinator | None = None
        self._outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._session_number = 0  # a Join queued for an older session must not reach a newer one
        self._coordinator_seen = 0.0  # last message on the current session (the coordinator's lease)
        self._last_contact = 0.0  # last message on any session (the join_timeout deadline)
        self._outage = False
        self._handshakes = HandshakeFailures(config.tls.enabled, config.join_timeout, clock)
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop_task: asyncio.Task[None] | None = None
        self._worker_lock = asyncio.Lock()
        self._shutdown_requested = asyncio.Event()  # SIGTERM, or an operator's drain
        self._signalled = asyncio.Event()  # SIGTERM or SIGINT only
        self._leave_reason = "agent stopped (SIGTERM)"
        self._drained = False
        self._exit_code: ExitCode | None = None
        self._host = config.advertise_address or route_address(config.rendezvous.host)
        self._incarnation = uuid.uuid4().hex
        self._trainer_done = 0  # the generation whose trainer reported that training completed
        # Training completed, and nothing reported since: evaluation, export and teardown are not watched for
        # hangs unless the trainer reports during them (ProgressCallback in evaluate, report_alive, another fit).
        self._stall_paused = False
        self._listener: ProgressListener | None = None
        self.on_status: Callable[[str], None] = lambda text: None  # systemd STATUS= lines hook here
        self.on_ready: Callable[[], None] = lambda: None  # systemd READY=1: the coordinator has taken us in
        self._ticked_at = clock()  # the control loop's last turn, for systemd's watchdog

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        self._listener = ProgressListener(self._on_progress)
        self._listener.start()
        self._serve_metrics()
        self._spawn(self._watch_gpus())
        try:
            return int(await self._run_sessions())
        finally:
            clean = self._exit_code is ExitCode.SUCCEEDED or self._shutdown_requested.is_set()
            await self._stop_worker("agent exiting", planned=clean)
            self._listener.close()
            await self._keep_hosting_after_drain()
            await self._linger_after_failure()
            await self._stop_hosting()
            if self._metrics_server is not None:
                self._metrics_server.close()

    async def _run_sessions(self) -> ExitCode:
        self._last_contact = self._clock()
        while True:
            self._ticked_at = self._clock()
            await self._try_hosting()
            try:
                await self._session()
            except FatalSessionError as e:
                log.error("%s", e)
                return e.exit_code
            except _SessionLost as e:
                if not self._outage:  # once per outage, not once per retry
                    log.warning("lost the coordinator at %s: %s; retrying", self.config.rendezvous, e)
                    self.on_status(f"retrying the coordinator at {self.config.rendezvous} (unreachable: {e})")
                self._outage = True
                if (tls_problem := self._handshakes.failed(str(e), self._last_contact)) is not None:
                    log.error("%s", tls_problem)  # a certificate that cannot be verified does not fix itself
                    return ExitCode.CONFIG
            except Exception:  # a bug must not leave a worker unsupervised: fence, and try again
                log.exception("the session with the coordinator failed")
                self._outage = True
            if self._exit_code is not None:
                return self._exit_code
            if self._shutdown_requested.is_set():
                return ExitCode.SUCCEEDED
            await self._stop_worker("fencing: the coordinator is unreachable", planned=False)  # others moved on
            if self._clock() - self._last_contact > self.config.join_timeout:
                log.error("the coordinator at %s stayed unreachable for join_timeout=%gs; giving up",
                          self.config.rendezvous, self.config.join_timeout)
                return ExitCode.FAILED
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._shutdown_requested.wait(), 0.2)

    async def _session(self) -> None:
        """One stream to the coordinator. Returns when it ended as planned; raises when it was lost."""
        self._session_number += 1
        self._outbox = asyncio.Queue()
        self._outbox.put_nowait(self._join_message())
        self._coordinator_seen = self._clock()
        async with open_channel(self.config.rendezvous, self.config.tls) as channel:
            stub = pb_grpc.RendezvousStub(channel)  # type: ignore[no-untyped-call]
            call = stub.Session(metadata=call_metadata(self._token))
            tasks = [asyncio.create_task(coro) for coro in
                     (self._write(call), self._read(call), self._tick(), self._watch_shutdown())]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                error = next((t.exception() for t in done if t.exception() is not None), None)
                if error is not None and not isinstance(error, _SessionOver):
                    raise error
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                call.cancel()

    async def _write(self, call: SessionCall) -> None:
        while True:
            message = await self._outbox.get()
            if message is None:
                await call.done_writing()
                return
            try:
                await call.write(message)
            except grpc.aio.AioRpcError as e:
                raise _SessionLost(f"{e.code().name}: {e.details()}") from None
            except (grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                raise _SessionLost(f"write failed: {e}") from None

    async def _read(self, call: SessionCall) -> None:
        try:
            async for message in call:
                self._coordinator_seen = self._clock()
                self._last_contact = self._coordinator_seen
                if self._outage:
                    self._outage = False
                    log.info("reconnected to the coordinator at %s", self.config.rendezvous)
                await self._handle(message)
                if self._exit_code is not None:
                    self._outbox.put_nowait(None)  # hang up; the coordinator then ends the stream
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in _FATAL_CODES:
                raise FatalSessionError(f"the coordinator refused this agent: {e.details()}",
                                        _FATAL_CODES[code]) from None
            raise _SessionLost(f"{code.name}: {e.details()}") from None
        if self._exit_code is None and not self._shutdown_requested.is_set():
            raise _SessionLost("the coordinator closed the session")
        raise _SessionOver()

    async def _tick(self) -> None:
        interval = self.config.heartbeat_interval
        # Fence one heartbeat before the coordinator's lease on us runs out, so that this node's worker is
        # gone before the others re-form without it.
        fence_after = self.config.node_timeout - interval
        next_heartbeat = self._clock()
        while True:
            await asyncio.sleep(interval / 2)
            self._ticked_at = self._clock()
            silent = self._clock() - self._coordinator_seen
            if silent > fence_after:
                raise _SessionLost(f"no message from the coordinator for {silent:.1f}s")
            self._check_stall()
            if self._clock() >= next_heartbeat:
                next_heartbeat = self._clock() + interval
                self._outbox.put_nowait(self._progress_report() or pb.AgentMessage(heartbeat=pb.Heartbeat()))

    async def _watch_shutdown(self) -> None:
        await self._shutdown_requested.wait()
        log.info("stopping: leaving the rendezvous and stopping the worker")
        self.on_status("stopping: draining the worker")
        self._outbox.put_nowait(pb.AgentMessage(leave=pb.Leave(reason=self._leave_reason)))
        await self._stop_worker("agent stopping", planned=True)
        self._outbox.put_nowait(None)
        await asyncio.sleep(self.config.node_timeout)  # the read loop ends when the coordinator hangs up
        raise _SessionOver()

    def control_loop_healthy(self, max_age: float) -> bool:
        """For systemd's watchdog: the control loop turned within ``max_age`` seconds. A worker stop in progress
        (bounded by its grace period) and the planned way out (job over, drain, SIGTERM) count as healthy."""
        if self._exit_code is not None or self._shutdown_requested.is_set():
            return True
        if self._stop_task is not None and not self._stop_task.done():
            return True
        return self._clock() - self._ticked_at <= max_age

    def _on_signal(self) -> None:
        self._signalled.set()
        self._shutdown_requested.set()

    async def _keep_hosting_after_drain(self) -> None:
        """A drained node that hosts the coordinator keeps serving it: the other nodes still need it. It stops
        when the job ends, or on SIGTERM."""
        if not self._drained or self._coordinator is None or self._signalled.is_set():
            return
        log.info("drained, but this node hosts the coordinator: serving it until the job ends (SIGTERM stops it)")
        self.on_status("drained: hosting the coordinator until the job ends")
        finished = asyncio.create_task(self._coordinator.servicer.finished.wait())
        signalled = asyncio.create_task(self._signalled.wait())
        await asyncio.wait((finished, signalled), return_when=asyncio.FIRST_COMPLETED)
        finished.cancel()
        signalled.cancel()

    # ----------------------------------------------------------------------------------- coordinator orders

    async def _handle(self, message: pb.CoordinatorMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind in ("assignment", "waiting"):
            self.on_ready()
        if kind == "assignment":
            await self._launch(convert.assignment_from_proto(message.assignment))
        elif kind == "stop":
            self._count_restart(message.stop.reason)
            self._spawn(self._restart(message.stop.generation, message.stop.reason, self._session_number))
        elif kind == "finished":
            state = convert.JOB_STATE_NAMES.get(message.finished.state, api.JobState.FAILED)
            log.info("job %s: %s", state.value, message.finished.reason)
            self.on_status(f"job {state.value}: {message.finished.reason}")
            self._exit_code = ExitCode.SUCCEEDED if state is api.JobState.SUCCEEDED else ExitCode.FAILED
        elif kind == "drain":
            reason = message.drain.reason
            log.info("drained by an operator (%s): checkpointing, stopping the worker and leaving the job", reason)
            self._leave_reason, self._drained = f"drained: {reason}", True
            self._shutdown_requested.set()
        elif kind == "waiting":
            w = message.waiting
            self.on_status(f"waiting in rendezvous: {w.joined} joined, need {w.min_nodes}-{w.max_nodes}")
            log.info("waiting: %d node(s) joined (min %d, max %d): %s", w.joined, w.min_nodes, w.max_nodes,
                     w.detail)

    async def _launch(self, assignment: api.Assignment) -> None:
        async with self._worker_lock:
            if self.worker_state.state is not WorkerState.WAITING or self._shutdown_requested.is_set():
                log.warning("ignored the assignment to generation %d: worker is %s", assignment.generation,
                            self.worker_state.state.value)
                return
            self._assignment = assignment
            self._last_generation = assignment.generation
            self._restart_count = assignment.restart_count
            self._stall.reset()
            self._stall_reported = self._stall_paused = False
            self._recent_steps.clear()
            self._progress = self._progress_sent = None
            spec = WorkerSpec(self.config.command, self._trainer_env(assignment), self.config.workdir or None,
                              f"[rank {assignment.rank}]", self.config.failure_stop_grace)
            self._worker = await WorkerProcess.start(spec)
            self.worker_state.to(WorkerState.RUNNING)  # WAITING -> RUNNING
            self.metrics.new_generation(assignment.generation, assignment.rank, assignment.world_size)
            if self._join_sent_at is not None:
                self.metrics.rendezvous.observe(self._clock() - self._join_sent_at)
                self._join_sent_at = None
        log.info("generation %d: started worker pid %d as rank %d of %d", assignment.generation,
                 self._worker.pid, assignment.rank, assignment.world_size)
        self.on_status(f"running generation {assignment.generation} as rank {assignment.rank} "
                       f"of {assignment.world_size}")
        self._spawn(self._report_trainer_pid(self._worker))
        self._spawn(self._await_exit(self._worker, assignment.generation))

    async def _report_trainer_pid(self, worker: WorkerProcess) -> None:
        """Status shows the trainer's pid, not the keeper's; the keeper forks it within milliseconds."""
        pid = worker.pid
        for _ in range(100):
            pid = worker.trainer_pid()
            if pid != worker.pid or worker.has_exited():
                break
            await asyncio.sleep(0.01)
        if worker is self._worker and self.worker_state.state is WorkerState.RUNNING:
            self._report(pb.WORKER_STATUS_RUNNING, pid=pid)

    async def _await_exit(self, worker: WorkerProcess, generation: int) -> None:
        code = await worker.wait()
        if worker is not self._worker or self.worker_state.state is not WorkerState.RUNNING:
            return  # we stopped it on purpose
        if code == 0:
            self.worker_state.to(WorkerState.SUCCEEDED)  # RUNNING -> SUCCEEDED
            log.info("generation %d: trainer exited 0", generation)
            self._report(pb.WORKER_STATUS_SUCCEEDED, exit_code=0)
            return
        self.worker_state.to(WorkerState.FAILED)  # RUNNING -> FAILED
        self._failed_at = self._clock()
        detail = _describe_exit(code)
        log.warning("generation %d: trainer %s", generation, detail)
        self._report(pb.WORKER_STATUS_FAILED, exit_code=code, detail=f"trainer {detail}")

    async def _restart(self, generation: int, reason: str, session_number: int) -> None:
        if self._assignment is None or generation != self._assignment.generation:
            mine = self._assignment.generation if self._assignment else None
            log.warning("ignored a stop order for generation %d: this node runs generation %s", generation, mine)
            return
        log.info("generation %d: stopping the worker (%s)", generation, reason)
        self.on_status(f"restarting: {reason}")
        planned = reason in _PLANNED_REASONS
        await self._stop_worker(reason, planned=planned)
        if self._exit_code is None and not self._shutdown_requested.is_set() and \
                session_number == self._session_number:
            self._outbox.put_nowait(self._join_message())  # the Join confirms the old worker is gone

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("agent task failed", exc_info=task.exception())

    async def _stop_worker(self, why: str, *, planned: bool) -> None:
        """Stop the worker if one may be alive, and return once every process of it is gone.

        A planned stop (scale-up, leave, shutdown) gives the trainer ``stop_grace`` to checkpoint; after a failure
        the collective is broken, so nothing can be saved and ``failure_stop_grace`` is short. The stop runs as
        one task that every caller awaits, shielded: a caller that is cancelled (its session ended) does not
        interrupt it, so a worker is never left half stopped.
        """
        if self._stop_task is None or self._stop_task.done():
            grace = self.config.stop_grace if planned else self.config.failure_stop_grace
            self._stop_task = asyncio.create_task(self._stop_worker_now(why, grace))
        await asyncio.shield(self._stop_task)

    async def _stop_worker_now(self, why: str, grace: float) -> None:
        async with self._worker_lock:
            if not self.worker_state.state.has_live_worker:
                return
            was_running = self.worker_state.to(WorkerState.STOPPING) is WorkerState.RUNNING
            if self._worker is not None:
                started = self._clock()
                await self._worker.stop(grace)
                log.info("worker stopped in %.3fs (%s)", self._clock() - started, why)
                if grace == self.config.stop_grace and was_running:
                    self._count_graceful_stop(self._worker)
                if was_running and self._completed(self._worker):
                    # It finished training while we stopped it: the coordinator must know (see state.py).
                    log.info("the trainer completed (exit 0) while stopping")
                    self._report(pb.WORKER_STATUS_SUCCEEDED, exit_code=0)
            self.worker_state.to(WorkerState.STOPPED)  # STOPPING -> STOPPED

    def _count_graceful_stop(self, worker: WorkerProcess) -> None:
        code = worker.returncode
        if code == CHECKPOINTED_AND_STOPPED:
            step = self._progress.step if self._progress is not None else None
            log.info("the trainer checkpointed%s and stopped: no work lost",
                     f" after step {step}" if step is not None else "")
            outcome = "checkpointed"
        elif code == -signal.SIGKILL and not worker.exited_before_stop:
            log.warning("the trainer did not stop within stop_grace=%gs and was killed: work since its last "
                        "checkpoint is lost", self.config.stop_grace)
            outcome = "killed"
        else:
            outcome = "exited"
        self.metrics.graceful_stops.labels(outcome=outcome).inc()

    def _completed(self, worker: WorkerProcess) -> bool:
        """An exit 0 is a completion if the trainer ended by itself, or told us it had completed; an exit 0
        in answer to SIGTERM may just be a trainer that checkpointed and stopped."""
        assert self._assignment is not None
        said_done = self._trainer_done == self._assignment.generation
        return worker.returncode == 0 and (worker.exited_before_stop or said_done)

    # ------------------------------------------------------------------------------------ agent messages

    def _join_message(self) -> pb.AgentMessage:
        state = self.worker_state.state
        if state is WorkerState.INIT or state is WorkerState.STOPPED:
            self.worker_state.to(WorkerState.WAITING)  # INIT|STOPPED -> WAITING
        cfg = self.config
        spec = api.JobSpec(cfg.job, cfg.command_digest(), cfg.min_nodes, cfg.max_nodes, cfg.max_restarts,
                           cfg.restart_window, cfg.stall_timeout, cfg.resolved_backup_dir(), cfg.heartbeat_interval,
                           cfg.node_timeout)
        port = cfg.worker_port or free_port(self._host)
        self._join_sent_at = self._clock()
        last_rank = self._assignment.rank if self._assignment else -1
        return pb.AgentMessage(join=pb.Join(
            node_id=cfg.node_id, spec=convert.spec_to_proto(spec), host=self._host, worker_port=port,
            last_generation=self._last_generation, restart_count=self._restart_count,
            incarnation=self._incarnation, last_rank=last_rank))

    def _report(self, status: pb.WorkerStatus, *, pid: int = 0, exit_code: int = 0, detail: str = "") -> None:
        assert self._assignment is not None
        report = pb.WorkerReport(generation=self._assignment.generation, status=status, pid=pid,
                                 exit_code=exit_code, detail=detail)
        self._attach_progress(report)
        self._outbox.put_nowait(pb.AgentMessage(report=report))

    def _progress_report(self) -> pb.AgentMessage | None:
        if self._progress is None or self._progress is self._progress_sent or self._assignment is None:
            return None
        report = pb.WorkerReport(generation=self._assignment.generation, status=pb.WORKER_STATUS_RUNNING,
                                 pid=self._progress.pid)
        self._attach_progress(report)
        return pb.AgentMessage(report=report)

    def _attach_progress(self, report: pb.WorkerReport) -> None:
        report.gpus, report.gpu_utilization = self._gpu_summary
        p = self._progress
        if p is None:
            return
        now = self._clock()
        report.has_progress = True
        report.progress.CopyFrom(pb.Progress(
            step=p.step, examples=p.examples or 0, loss=p.loss or 0.0, has_loss=p.loss is not None,
            age_seconds=now - self._progress_at,
            checkpoint_step=p.checkpoint_step if p.checkpoint_step is not None else -1,
            steps_per_second=self._steps_per_second(),
            checkpoint_age_seconds=-1.0 if self._checkpoint_at is None else now - self._checkpoint_at))
        self._progress_sent = p

    def _steps_per_second(self) -> float:
        """Over the last 30 s of reports; 0 (unknown) until they span a second. Reports are stamped when the
        agent reads them, and a busy loop reads a backlog at once: two reports alone could give any rate."""
        if len(self._recent_steps) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._recent_steps[0], self._recent_steps[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 1.0 else 0.0

    async def _watch_gpus(self) -> None:
        """The node's GPU summary for status, read off the loop: NVML calls may block."""
        while True:
            self._gpu_summary = await asyncio.to_thread(self._gpus.utilization)
            await asyncio.sleep(5.0)

    def _on_progress(self, message: ProgressMessage) -> None:
        if self._assignment is None or message.generation != self._assignment.generation:
            return  # a report from an older generation's worker
        if message.done:
            self._trainer_done = message.generation
        self._stall_paused = message.done
        if self.worker_state.state is not WorkerState.RUNNING:
            return
        self._record_progress(message)
        if self._progress is not None and message.checkpoint_step is None:
            message = ProgressMessage(message.generation, message.pid, message.step, message.examples,
                                      message.loss, self._progress.checkpoint_step)
        self._progress, self._progress_at = message, self._clock()
        self._stall.progress()

    def _record_progress(self, message: ProgressMessage) -> None:
        wall, now = time.time(), self._clock()
        self.metrics.progress(message, wall)
        self._recent_steps.append((now, message.step))
        while self._recent_steps and now - self._recent_steps[0][0] > 30.0:
            self._recent_steps.popleft()
        if message.checkpoint_step is not None:
            self.metrics.checkpoint(message.checkpoint_step, wall)
            self._checkpoint_at = now
        if self._stop_after_failure_at is not None:  # the first step after a failure: recovered
            self.metrics.recovery.observe(self._clock() - self._stop_after_failure_at)
            self._stop_after_failure_at = None

    def _count_restart(self, reason: str) -> None:
        self.metrics.restarts.labels(reason=reason).inc()
        if reason not in _PLANNED_REASONS:
            self._stop_after_failure_at = self._clock()
        if self._failed_at is not None:
            self.metrics.detection.observe(self._clock() - self._failed_at)
            self._failed_at = None

    def _live_worker_pid(self) -> int | None:
        worker = self._worker
        return worker.pid if worker is not None and self.worker_state.state.has_live_worker else None

    async def _linger_after_failure(self) -> None:
        """Keep /metrics (and the hosted coordinator's cluster metrics) up for ``metrics_linger`` after the job
        failed: an exporter that vanishes with the verdict never lets Prometheus record it. SIGTERM cuts it short."""
        if self._exit_code is not ExitCode.FAILED or self._metrics_server is None or not self.config.metrics_linger:
            return
        if self._coordinator is not None:
            await self._coordinator.wait_agents_gone(timeout=5.0)
        log.info("job failed: keeping /metrics up for %gs", self.config.metrics_linger)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._shutdown_requested.wait(), self.config.metrics_linger)

    def _serve_metrics(self) -> None:
        cfg = self.config
        if cfg.metrics_port is None:
            return
        self._metrics_server = serve_metrics(self.registry, cfg.metrics_address, cfg.metrics_port, self._metrics_token)
        log.info("metrics on http://%s/metrics", host_port(cfg.metrics_address, self._metrics_server.port))

    def _check_stall(self) -> None:
        # Paused after training completed: a restart would redo the silent work that follows, or, where
        # BackupAndRestore deleted its backup on success (tf_keras' default), all the training.
        if self.worker_state.state is not WorkerState.RUNNING or self._stall_reported or self._stall_paused:
            return
        if self._stall.stalled():
            self._stall_reported = True
            self._failed_at = self._clock()
            silent = self._stall.silent_for() or 0.0
            log.warning("trainer stalled: no progress for %.1fs (stall_timeout=%gs)", silent,
                        self.config.stall_timeout)
            self._report(pb.WORKER_STATUS_STALLED,
                         detail=f"no progress for {silent:.1f}s (stall_timeout={self.config.stall_timeout:g}s)")

    def _trainer_env(self, a: api.Assignment) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.env)
        env.setdefault("TF_USE_LEGACY_KERAS", "1")
        assert self._listener is not None
        env.update({
            "TF_CONFIG": a.tf_config(),
            "TFELASTIC_JOB": self.config.job,
            "TFELASTIC_NODE_ID": self.config.node_id,
            "TFELASTIC_RANK": str(a.rank),
            "TFELASTIC_WORLD_SIZE": str(a.world_size),
            "TFELASTIC_GENERATION": str(a.generation),
            "TFELASTIC_RESTART_COUNT": str(a.restart_count),
            "TFELASTIC_BACKUP_DIR": self.config.resolved_backup_dir(),
            "TFELASTIC_PROGRESS_SOCKET": self._listener.path,
        })
        env.update(instrumentation_env(env, self.config.instrument))  # model.fit reports with no code change
        return env

    # -------------------------------------------------------------------------------------------- hosting

    async def _try_hosting(self) -> None:
        if self._coordinator is not None or not is_local_address(self.config.rendezvous.host):
            return
        cfg = self.config
        settings = cfg.rendezvous_settings()
        try:
            self._coordinator = await create_server(
                str(cfg.rendezvous), settings, token=self._token, tls=cfg.tls,
                heartbeat_interval=cfg.heartbeat_interval)
        except BindError:
            return  # another agent on this host hosts it
        log.info("hosting the coordinator on %s", cfg.rendezvous)
        coordinator = self._coordinator
        self._cluster_metrics = register_cluster_collector(self.registry, lambda: coordinator.servicer.published)

    async def _stop_hosting(self) -> None:
        if self._coordinator is None:
            return
        # Let the other agents read the verdict and hang up before the coordinator goes away.
        verdict = self._exit_code is not None or self._coordinator.servicer.finished.is_set()
        await self._coordinator.wait_agents_gone(timeout=5.0 if verdict else 0.0)
        await self._coordinator.stop()
        self._coordinator = None
        if self._cluster_metrics is not None:
            self.registry.unregister(self._cluster_metrics)
            self._cluster_metrics = None


class _SessionOver(Exception):
    """The session ended as planned (the job finished, or the agent is leaving)."""


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
