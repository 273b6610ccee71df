"""The agent's decisions, as plain code over an injected clock: no sockets, no processes, no asyncio.

Every input (a session opened or lost, a message from the coordinator, a worker that started, exited or was
stopped, a progress report, a tick, a signal, what the shell read of the node) is a method call that returns the
:mod:`actions <tfelastic.daemon.agent.api>` to carry out; the asyncio shell (:mod:`tfelastic.daemon.agent.agent`)
does the I/O and reports back. :class:`AgentCore` is the shells' one way in and decides the coordinator's side (the
session, the Join, fencing, leaving, the verdict); its collaborators keep the rest: the worker's life
(:class:`~tfelastic.daemon.agent.worker_core.WorkerCore`), the coordinator's lease
(:class:`~tfelastic.daemon.agent.contact.CoordinatorContact`) and the node checks a Join carries
(:class:`~tfelastic.daemon.agent.check_ledger.NodeCheckLedger`).

The agent obeys the coordinator: it launches a worker on an Assignment, stops it on StopWorkers and joins again
(the Join confirms that every process of the old worker is gone, and that the GPUs gave back their memory: GPUs
that do not within the shell's bound fail the node check that Join carries), and exits on JobFinished. It
decides on its own only to fence itself (the coordinator silent for ``node_timeout - heartbeat_interval``: one
heartbeat before the coordinator's lease on it runs out), when to build a standby, and how to leave. A stall of
its trainer it only reports: the coordinator decides the restart.
"""

from __future__ import annotations

import logging
import signal
import uuid
from collections.abc import Callable, Sequence

from tfelastic.daemon.agent.api import (
    Action,
    AgentEnd,
    Announce,
    Connection,
    CoordinatorLost,
    DropSession,
    ExitAgent,
    HangUp,
    HostUntilJobEnds,
    Identity,
    KeepMetricsUp,
    Leaving,
    ListenForProbe,
    ObserveEtcd,
    RemoveLocalTier,
    RestorableSteps,
    RetryAfter,
    RunNodeCheck,
    Send,
    StopResult,
    StopRetrying,
    Timing,
    WorkerPolicy,
)
from tfelastic.daemon.agent.check_ledger import NodeCheckLedger
from tfelastic.daemon.agent.contact import CoordinatorContact
from tfelastic.daemon.agent.failover import fence_reason
from tfelastic.daemon.agent.progress_tracker import ProgressTracker
from tfelastic.daemon.agent.replacements import ReplacementPolicy
from tfelastic.daemon.agent.trainer_watch import StepMarkReader
from tfelastic.daemon.agent.worker_core import Clock, WorkerCore
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.netutil import free_port
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.version import PROTOCOL, VERSION
from tfelastic.daemon.worker.states import WorkerState
from tfelastic.trainer.progress import ProgressMessage

log = logging.getLogger("tfelastic.agent")

__all__ = ["AgentCore", "Clock"]


class AgentCore:
    def __init__(self, identity: Identity, timing: Timing, connection: Connection, metrics: AgentMetrics,
                 clock: Clock, pick_port: Callable[[str], int], step_mark: StepMarkReader | None = None,
                 policy: WorkerPolicy | None = None) -> None:
        self.identity, self.timing = identity, timing
        self._metrics, self._clock = metrics, clock
        self.end = AgentEnd()
        self.worker_core = WorkerCore(identity, timing, policy or WorkerPolicy(), metrics, clock, self.end, step_mark)
        self._failover, self._pick_port = connection.failover, pick_port
        self._contact = CoordinatorContact(clock, connection.coordinator, heartbeat_interval=timing.heartbeat_interval,
                                           node_timeout=timing.node_timeout, join_timeout=timing.join_timeout,
                                           tls=connection.tls)
        self._checks = NodeCheckLedger()

    @classmethod
    def of(cls, config: AgentConfig, host: str, failover: bool, metrics: AgentMetrics, clock: Clock,
           standby_at_launch: bool = False, step_mark: StepMarkReader | None = None) -> AgentCore:
        """The core of an agent with this configuration, whose trainer peers reach at ``host``; ``step_mark``
        reads the step its trainer last marked (trainer/progress.py)."""
        rdzv, node = config.rendezvous, config.node
        identity = Identity(node.id, host, config.job_spec(), uuid.uuid4().hex, node.worker_port, node.role)
        replacement = ReplacementPolicy(config.job.worker_replacements, config.job.restart_window,
                                        rdzv.restart_backoff, rdzv.restart_backoff_max)
        timing = Timing(rdzv.heartbeat_interval, rdzv.node_timeout, rdzv.join_timeout, config.stall_limits(),
                        node.stop_grace)
        return cls(identity, timing, Connection(str(rdzv.endpoint), rdzv.tls.enabled, failover), metrics, clock,
                   free_port, step_mark, WorkerPolicy(standby_at_launch, replacement))

    # ----------------------------------------------------------------------------------- the worker's side

    @property
    def tracker(self) -> ProgressTracker:
        return self.worker_core.tracker

    @property
    def gpu_holders(self) -> tuple[int, ...]:
        return self.worker_core.gpu_holders

    @property
    def restorable(self) -> RestorableSteps:
        return self.worker_core.restorable

    @property
    def leaving(self) -> Leaving | None:
        return self.end.leaving

    def describe(self) -> str:
        return self.worker_core.describe()

    def node_read(self, *, gpus: tuple[int, float] | None = None, restorable: RestorableSteps | None = None) -> None:
        self.worker_core.node_read(gpus=gpus, restorable=restorable)

    def worker_started(self, generation: int, pid: int, *, warm: bool = False) -> list[Action]:
        return self._then(self.worker_core.worker_started(generation, pid, warm=warm))

    def trainer_pid(self, generation: int, pid: int) -> list[Action]:
        return self._then(self.worker_core.trainer_pid(generation, pid))

    def launch_failed(self, generation: int, error: str) -> list[Action]:
        return self._then(self.worker_core.launch_failed(generation, error))

    def worker_exited(self, generation: int, code: int, output: Sequence[str] = (), *,
                      oom_killed: bool = False) -> list[Action]:
        return self._then(self.worker_core.worker_exited(generation, code, output, oom_killed=oom_killed))

    def worker_gone(self, pids: tuple[int, ...]) -> list[Action]:
        return self._then(self.worker_core.worker_gone(pids))

    def worker_stopped(self, result: StopResult) -> list[Action]:
        return self._then(self.worker_core.worker_stopped(result))

    def progress(self, message: ProgressMessage) -> list[Action]:
        return self._then(self.worker_core.progress(message))

    def stacks_dumped(self, generation: int, stacks: Sequence[str], missing: str = "") -> list[Action]:
        return self._then(self.worker_core.stacks_dumped(generation, stacks, missing))

    def server_probed(self, generation: int, answered: bool) -> list[Action]:
        return self._then(self.worker_core.server_probed(generation, answered))

    @property
    def _worker_state(self) -> WorkerState:
        return self.worker_core.worker.state

    def _then(self, actions: list[Action]) -> list[Action]:
        """The worker core's actions, and what follows a stop that ended among them (:meth:`_after_stop`)."""
        return actions + self._after_stop() if self.worker_core.stop_ended() else actions

    def _stop(self, why: str, *, planned: bool, peer_failed: bool = False) -> list[Action]:
        return self._then(self.worker_core.stop(why, planned=planned, peer_failed=peer_failed))

    # ------------------------------------------------------------------------------------------- session

    def coordinator_found(self) -> list[Action]:
        """Where the coordinator is is known, and a session is about to open: a node check that the next Join must
        carry and has not run yet runs first (a preparation)."""
        owed = RunNodeCheck("a node check is owed before the next Join")
        return [owed] if self._checks.must_run else []

    def session_starting(self) -> list[Action]:
        """The session opens next: a Join that may start a generation needs the restorable steps, the old worker's
        GPU memory and a fixed port first; one that attaches a running worker (etcd) does not."""
        return [] if self._worker_state.has_live_worker else self.worker_core.before_join()

    def node_check_ended(self) -> list[Action]:
        """The node check ran: when its result goes out in a Join on the open session now, what that Join needs
        first (its result follows in :meth:`node_checked`)."""
        return self.worker_core.before_join() if self._joins_after_check() else []

    def _joins_after_check(self) -> bool:
        return self._contact.open and self._worker_state is WorkerState.WAITING and not self.end.winding_down

    def gpus_released(self, waited: float | None, held: str) -> None:
        """The shell's wait for the GPU memory (:class:`WaitGpusReleased`) ended: after ``waited`` seconds (None:
        NVML lists no process here, no GPU or no driver: nothing was waited for), with ``held`` saying what still
        holds memory ("": all of it is back). Memory still held fails the node check the next Join carries, and is
        waited for again before the one after."""
        if waited is not None:
            self._metrics.gpu_release_wait.observe(waited)
        if held:
            self._checks.found(held)
        else:
            self.worker_core.gpus_back()

    def node_checked(self, failure: str) -> list[Action]:
        """The node check ended (``failure``: what failed, "" if it passed). It goes out in a Join now, or on
        the next session."""
        self._checks.ran(failure)
        if not self._joins_after_check():
            return []
        return self._checked_join()

    def _checked_join(self) -> list[Action]:
        """The shell listens for the coordinator's probe on the Join's port first (:meth:`probe_listening`)."""
        join = self._join(checked=True)
        self._checks.composed(join, self._contact.session)
        return [ListenForProbe(join.node.worker_port)]

    def probe_listening(self, problem: str) -> list[Action]:
        """The shell listens for the probe, or ``problem`` says why it cannot: the checked Join goes out, with
        that problem among its failures (the trainer could not bind the port either)."""
        join = self._checks.listening(problem)
        return [Send(join)] if join is not None and self._contact.open else []

    def session_opened(self) -> list[Action]:
        self._contact.opened()
        attaching = self._failover and self.worker_core.assignment is not None and self._worker_state.has_live_worker
        if self._checks.has_result and not attaching:
            return self._checked_join()
        join = self._join()
        if not join.attached_generation:
            return [Send(join)]
        running = self._worker_state is WorkerState.RUNNING
        return [Send(join), *self.worker_core.trainer.for_new_coordinator(join.attached_generation, running)]

    def received(self, message: api.CoordinatorMessage) -> list[Action]:
        """Any message on the session, heartbeats included: each renews the coordinator's lease."""
        self._contact.heard()
        self._checks.answered(self._contact.session, message)
        if isinstance(message, api.Assignment):
            launch = self.worker_core.assigned(message)
            # READY=1 carries a status of its own: the one before it (say, "retrying the coordinator") is over
            status = f"launching generation {message.generation} as rank {message.rank} of {message.world_size}"
            return [Announce(status if launch else "", ready=True), *launch]
        if isinstance(message, api.StopWorkers):
            return self._stop_ordered(message)
        if isinstance(message, api.Finished):
            return self._finished(message)
        if isinstance(message, api.DrainNode):
            log.info("drained by an operator (%s): checkpointing, stopping the worker and leaving the job",
                     message.reason)
            return self._leave(f"drained: {message.reason}", drained=True)
        if isinstance(message, api.CheckNode):
            if self._worker_state is not WorkerState.WAITING or self.end.winding_down:
                return []
            log.info("checking this node: %s", message.reason)
            self._checks.asked()
            return [RunNodeCheck(message.reason)]
        if isinstance(message, api.Waiting):
            log.info("waiting: %d node(s) joined (min %d, max %d): %s", message.joined, message.min_nodes,
                     message.max_nodes, message.detail)
            return [Announce(f"waiting in rendezvous: {message.joined} joined, need "
                             f"{message.min_nodes}-{message.max_nodes}", ready=True)]
        return []

    def tick(self) -> list[Action]:
        """Every half heartbeat interval while a session is open."""
        silent = self._contact.silence()
        if silent is not None:
            return [DropSession(f"no message from the coordinator for {silent:.1f}s")]
        actions = self._then(self.worker_core.due())
        if self._contact.heartbeat_due():
            w = self.worker_core
            actions.append((w.trainer.progress_report() if w.assignment else None) or Send(api.Heartbeat()))
        return actions

    def session_ended(self, problem: str | None) -> list[Action]:
        """The session is over: as planned (``problem`` None), or lost. A lost one fences this node: the others
        move on without it, so its worker must be gone first."""
        was_open = self._contact.open
        self._contact.closed()
        if problem is None:
            return self._fence()
        lost: list[Action] = [CoordinatorLost()] if was_open else []
        first = not self._contact.outage
        tls_problem = self._contact.lost(problem)
        if tls_problem is not None:  # a certificate that cannot be verified does not fix itself
            log.error("%s", tls_problem)
            self.end.exit_code = ExitCode.CONFIG
        if first:
            lost.append(Announce(f"retrying the coordinator at {self._contact.coordinator} (unreachable: {problem})"))
        return lost + self._fence()

    def etcd_observed(self, recorded: int | None, leader_known_for: float | None,
                      recorded_running: bool = True) -> list[Action]:
        """Between sessions, with etcd: what etcd says (the job's generation, None if it did not answer; how long
        the current coordinator has been known) decides whether to fence (agent/failover.py)."""
        a = self.worker_core.assignment
        if not self._failover or a is None or not self._worker_state.has_live_worker or self.end.winding_down:
            return []
        if self._worker_state is WorkerState.STOPPING:
            return []
        why = fence_reason(running=a.generation, recorded=recorded, silent=self._contact.silent(),
                           leader_known_for=leader_known_for, fence_after=self._contact.fence_after,
                           recorded_running=recorded_running)
        return self._stop(why, planned=False) if why is not None else []

    def session_closed(self) -> list[Action]:
        """The coordinator closed the session without an error: as planned when this agent's job is over or it is
        leaving, else a lost session like any other."""
        return self.session_ended(None if self.end.winding_down else "the coordinator closed the session")

    def between_sessions(self) -> list[Action]:
        """No session runs (it ended, or no coordinator was found): with etcd, what etcd says comes first
        (:class:`ObserveEtcd`, answered with :meth:`etcd_observed`), then :meth:`next_attempt`."""
        return [ObserveEtcd(self._etcd_patience())] if self._failover else []

    def next_attempt(self) -> list[Action]:
        """Once a fenced worker is gone: the agent's exit (:class:`ExitAgent`), or when to try the coordinator
        again (:class:`RetryAfter`: backing off while a foreign program or a TLS problem answers)."""
        code = self._verdict()
        return [ExitAgent(code)] if code is not None else [RetryAfter(self._contact.retry_delay())]

    def _etcd_patience(self) -> float:
        """How long to wait for etcd's answer. The coordinator counts this node lost after node_timeout of
        silence; rule 2 of failover.py must be decided half a heartbeat before that."""
        contact = self._contact
        return max(0.1, contact.fence_after + contact.heartbeat_interval / 2 - contact.silent())

    def worker_closed(self) -> list[Action]:
        """The agent's last worker and its standby are gone: a succeeded job's local snapshots go too (nothing will
        resume from them; a failed job, or an agent that only left, may be resumed)."""
        return [RemoveLocalTier()] if self.end.exit_code is ExitCode.SUCCEEDED else []

    def wind_down(self, *, hosting: bool) -> list[Action]:
        """The exit begins: a drained node that hosts the coordinator (``hosting``) keeps hosting it until the job
        ends. SIGTERM leaves too, but is no drain: the hosted coordinator goes with the agent."""
        if not (hosting and self.end.leaving is not None and self.end.leaving.drained):
            return []
        return [Announce("drained: hosting the coordinator until the job ends"), HostUntilJobEnds()]

    def hosting_ended(self, *, verdict_hosted: bool) -> list[Action]:
        """What hosting there was is over: after a failure, and on the node that hosted the coordinator after any
        verdict (``verdict_hosted``), /metrics stays up a while before the exit."""
        if self.end.exit_code is not ExitCode.FAILED and not verdict_hosted:
            return []
        return [KeepMetricsUp("failed" if self.end.exit_code is ExitCode.FAILED else "succeeded")]

    def refused(self, message: str, exit_code: ExitCode) -> None:
        """The coordinator refused this agent for good (wrong token, another job's settings, a duplicate id)."""
        log.error("%s", message)
        self.end.exit_code = exit_code

    def _verdict(self) -> ExitCode | None:
        """Between sessions: how the agent ends, or None to try the coordinator again."""
        if self.end.exit_code is not None:
            return self.end.exit_code
        if self.end.leaving is not None:
            return ExitCode.SUCCEEDED
        if self._contact.gave_up():
            if (handshake := self._contact.handshake_verdict()) is not None:
                log.error("%s", handshake)  # a certificate or a foreign program: retrying does not fix it
                return ExitCode.CONFIG
            log.error("the coordinator at %s stayed unreachable for join_timeout=%gs; giving up",
                      self._contact.coordinator, self.timing.join_timeout)
            return ExitCode.FAILED
        return None

    def final_stop(self) -> list[Action]:
        """The agent exits: nothing of its worker may outlive it."""
        self.worker_core.ps_task.cancel()
        clean = self.end.exit_code is ExitCode.SUCCEEDED or self.end.leaving is not None
        return self._stop("agent exiting", planned=clean)

    # ------------------------------------------------------------------------------------- local requests

    def signal_received(self, signum: int) -> list[Action]:
        """A signal to stop (agent.LEAVE_SIGNALS): leave the job cleanly (a planned leave, not a failure)."""
        return self._leave(f"agent stopped ({signal.Signals(signum).name})")

    # -------------------------------------------------------------------------------------------- orders

    def _stop_ordered(self, order: api.StopWorkers) -> list[Action]:
        reason = order.reason
        self.worker_core.ps_task.cancel()
        if self.end.leaving is not None:  # the stop a leaving parameter server or worker waited for: not a restart
            ordered = self.worker_core.current(order.generation)
            return self._stop(f"leaving ({reason.value})", planned=True) if ordered else []
        self._metrics.restarts.labels(reason=reason.value).inc()
        self.worker_core.trainer.failures.stop_ordered(after_failure=reason.counts_against_budget)
        if not self.worker_core.current(order.generation):
            mine = self.worker_core.assignment.generation if self.worker_core.assignment else None
            log.warning("ignored a stop order for generation %d: this node runs generation %s", order.generation,
                        mine)
            return []
        log.info("generation %d: stopping the worker (%s)", order.generation, reason.value)
        self.worker_core.rejoin_session = self._contact.session  # the Join after the stop confirms the worker is gone
        # The steps the trainer made since the last heartbeat: the coordinator counts the next generation's
        # redone steps from the furthest one.
        running = self._worker_state is WorkerState.RUNNING
        unsent = self.worker_core.trainer.progress_report(stopping=True) if running else None
        after_failure = reason.counts_against_budget
        return [Announce(f"restarting: {reason.value}"), *([unsent] if unsent else []),
                *self._stop(reason.value, planned=not after_failure, peer_failed=after_failure)]

    def _finished(self, order: api.Finished) -> list[Action]:
        level = logging.INFO if order.state is api.JobState.SUCCEEDED else logging.ERROR
        log.log(level, "job %s: %s", order.state.value, order.reason)
        self.end.exit_code = ExitCode.SUCCEEDED if order.state is api.JobState.SUCCEEDED else ExitCode.FAILED
        self.worker_core.ps_task.cancel()
        return [Announce(f"job {order.state.value}: {order.reason}"), HangUp()]

    def _leave(self, reason: str, *, drained: bool = False) -> list[Action]:
        if self.end.leaving is not None:
            return []
        serves = self.worker_core.ps_task.serves_only and self._worker_state is WorkerState.RUNNING and \
            self._contact.open
        self.end.leaving = Leaving(reason, drained, self._clock() + self.timing.stop_grace if serves else None)
        self.worker_core.cancel_standby()
        self.worker_core.ps_task.cancel()
        if not self._contact.open:
            return [StopRetrying()]  # between sessions: nobody to tell; the run loop ends
        if serves:
            # The chief may be saving now (every agent stopped at once: systemctl, scancel); its save reads this
            # task's variables or waits for its steps. The coordinator orders this stop once the chief's is done.
            log.info("%s: leaving the rendezvous; %s serves until the chief has stopped (at most %gs)", reason,
                     self.worker_core.ps_task.task_name(), self.timing.stop_grace)
            return [StopRetrying(), Announce("stopping: serving until the chief has saved"), Send(api.Leave(reason))]
        log.info("%s: leaving the rendezvous and stopping the worker", reason)
        return [StopRetrying(), Announce("stopping: draining the worker"), Send(api.Leave(reason)),
                *self._stop("agent stopping", planned=True)]

    # ------------------------------------------------------------------------------------------ internals

    def _fence(self) -> list[Action]:
        if self.end.leaving is not None and self.end.leaving.serve_until is not None:
            return self._stop("leaving: the coordinator's session ended", planned=True)  # nobody left to order it
        if self.end.winding_down or self._failover:  # with etcd, etcd_observed decides
            return []
        return self._stop("fencing: the coordinator is unreachable", planned=False)

    def _after_stop(self) -> list[Action]:
        if self.end.leaving is not None:
            return [HangUp()] if self._contact.open else []
        rejoin = self.worker_core.rejoin_session
        if rejoin is not None and rejoin == self._contact.session and self._contact.open and self.end.exit_code is None:
            self.worker_core.rejoin_session = None
            return self._checked_join() if self._checks.has_result else [Send(self._join())]
        return []

    def _join(self, *, checked: bool = False) -> api.Join:
        if self._worker_state in (WorkerState.INIT, WorkerState.STOPPED):
            self.worker_core.worker.to(WorkerState.WAITING)  # INIT|STOPPED -> WAITING
        ident, a = self.identity, self.worker_core.assignment
        self.worker_core.trainer.failures.joined()
        if self._failover and a is not None and self._worker_state.has_live_worker:
            # Its worker runs on: a coordinator that took the job over keeps it, on the port it has.
            port = next(m.worker_port for m in a.members if m.node_id == ident.node_id)
            node = api.NodeInfo(ident.node_id, ident.host, port, ident.incarnation, a.generation, a.rank,
                                version=VERSION, protocol=PROTOCOL, role=ident.role)
            return api.Join(node, ident.spec, a.restart_count, attached_generation=a.generation)
        port = ident.worker_port or self._pick_port(ident.host)
        node = api.NodeInfo(ident.node_id, ident.host, port, ident.incarnation, a.generation if a else 0,
                            a.rank if a else -1, self.restorable.steps, a.world_size if a else 0, VERSION, PROTOCOL,
                            ident.role, self.restorable.shared)
        return api.Join(node, ident.spec, a.restart_count if a else 0, checked=checked)
