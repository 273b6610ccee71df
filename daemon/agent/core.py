"""The agent's decisions, as plain code over an injected clock: no sockets, no processes, no asyncio.

Every input (a session opened or lost, a message from the coordinator, a worker that started, exited or was
stopped, a progress report, a tick, a signal) is a method call that returns the :mod:`actions
<tfelastic.daemon.agent.api>` to carry out: send a message, launch or stop the worker, hang up, drop the
session, tell systemd. The asyncio shell (:mod:`tfelastic.daemon.agent.agent`) does the I/O and reports back.

The agent obeys the coordinator: it launches a worker on an Assignment, stops it on StopWorkers and joins again
(the Join confirms that every process of the old worker is gone), and exits on JobFinished. It decides on its own
only to fence itself: when the coordinator is silent for ``node_timeout - heartbeat_interval`` it drops the
session and stops its worker, one heartbeat before the coordinator's lease on it runs out and the others
re-form without it. A stall of its trainer it only reports: the coordinator decides the restart.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tfelastic.daemon.agent.api import (
    Action,
    Announce,
    DropSession,
    HangUp,
    Launch,
    ListenForProbe,
    RunNodeCheck,
    Send,
    Stop,
    StopResult,
)
from tfelastic.daemon.agent.contact import CoordinatorContact
from tfelastic.daemon.agent.failover import fence_reason
from tfelastic.daemon.agent.progress_tracker import FailureTimes, ProgressTracker
from tfelastic.daemon.exit_codes import CHECKPOINTED_AND_STOPPED, ExitCode
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.worker.output import exception_line
from tfelastic.daemon.worker.stall import StallDetector, StallLimits
from tfelastic.daemon.worker.states import WorkerState, WorkerStateMachine
from tfelastic.trainer.progress import Phase, ProgressMessage

log = logging.getLogger("tfelastic.agent")

Clock = Callable[[], float]


@dataclass(frozen=True)
class Identity:
    """What this agent says about itself in every Join."""

    node_id: str
    host: str  # where peers reach its trainer
    spec: api.JobSpec
    incarnation: str  # random per agent process: a reconnect replaces its stale session
    worker_port: int = 0  # 0: a free port, picked anew for every Join
    coordinator: str = ""  # the rendezvous endpoint, for messages


@dataclass(frozen=True)
class Timing:
    heartbeat_interval: float
    node_timeout: float
    join_timeout: float
    stall: StallLimits
    stop_grace: float
    tls: bool = False
    failover: bool = False  # etcd: a lost coordinator may be failing over; the worker runs on (agent/failover.py)


@dataclass(frozen=True)
class Leaving:
    reason: str  # sent in the Leave
    drained: bool  # an operator drained this node (else SIGTERM or SIGINT)


class AgentCore:
    def __init__(self, identity: Identity, timing: Timing, metrics: AgentMetrics, clock: Clock,
                 pick_port: Callable[[str], int]) -> None:
        self.identity, self.timing = identity, timing
        self._clock, self._metrics, self._pick_port = clock, metrics, pick_port
        self.worker = WorkerStateMachine(on_change=metrics.set_worker_state)
        self.assignment: api.Assignment | None = None
        self.exit_code: ExitCode | None = None
        self.leaving: Leaving | None = None
        self.signalled = False  # SIGTERM or SIGINT: nothing more to serve, not even a hosted coordinator
        self.tracker = ProgressTracker(clock, metrics)
        self._failures = FailureTimes(clock, metrics)
        self._stall = StallDetector(timing.stall, clock)
        metrics.stall_limit.set_function(self._stall_limit)
        self._contact = CoordinatorContact(clock, heartbeat_interval=timing.heartbeat_interval,
                                           node_timeout=timing.node_timeout, join_timeout=timing.join_timeout,
                                           tls=timing.tls)
        self._trainer_done = 0  # the generation whose trainer reported that training completed
        self._rejoin_session: int | None = None  # the session to send a Join on once the stop is done
        self._stopping: tuple[bool, bool] = (False, False)  # the stop under way: (planned, it was running)
        self._join_sent_at: float | None = None
        self._ended: Send | None = None  # how this generation's worker ended, reported again after a failover
        self._trainer = (0, 0)  # (generation, pid) of the running trainer, told again to a new coordinator
        self.gpus: tuple[int, float] = (0, 0.0)  # the node's GPU count and mean utilization, for reports
        self._check_owed = True  # the first Join of the process carries a node check; so does one asked for
        self._check_result: str | None = None  # a check's result the coordinator has not answered yet ("": passed)
        self._check_sent_on: int | None = None  # the session whose Join carries it
        # The snapshot steps this node can restore, newest first, as the shell last read them (it reads them
        # before each Join that may start a generation): every such Join carries them.
        self.restorable: tuple[int, ...] = ()

    @property
    def winding_down(self) -> bool:
        """The job is over for this agent, or it is leaving: a session that ends now ends as planned."""
        return self.exit_code is not None or self.leaving is not None

    # ------------------------------------------------------------------------------------------- session

    @property
    def rejoins_after_stop(self) -> bool:
        """The stop under way ends in a Join (a stop ordered by the coordinator): the shell reads the restorable
        snapshot steps before it reports the stop done."""
        return self._rejoin_session is not None and not self.winding_down

    @property
    def check_owed(self) -> bool:
        """The next Join must carry a node check that has not run yet: the shell runs it first."""
        return self._check_owed and self._check_result is None

    def node_checked(self, failure: str) -> list[Action]:
        """The node check ended (``failure``: what failed, "" if it passed). It goes out in a Join now, or on
        the next session."""
        self._check_owed, self._check_result = False, failure
        if failure:
            log.error("node check failed: %s", failure)
        if not self._contact.open or self.worker.state is not WorkerState.WAITING or self.winding_down:
            return []
        return self._checked_join()

    def _checked_join(self) -> list[Action]:
        """The Join with the check's result. It stays owed until the coordinator answers that session: a Join on
        a session that breaks first (the coordinator not up yet) is sent again on the next one."""
        self._check_sent_on = self._contact.session
        join = self._join(checked=True, failure=self._check_result or "")
        return [ListenForProbe(join.node.worker_port), Send(join)]

    def session_opened(self) -> list[Action]:
        self._contact.opened()
        attaching = self.timing.failover and self.assignment is not None and self.worker.state.has_live_worker
        if self._check_result is not None and not attaching:
            return self._checked_join()
        join = self._join()
        # A report the last coordinator may not have read (the worker ended while no coordinator answered).
        unread = [self._ended] if join.attached_generation and self._ended is not None else []
        # A coordinator that took the job over knows the members, not their trainers: tell it ours.
        running = [self._report(api.WorkerStatus.RUNNING, pid=self._trainer[1])] \
            if join.attached_generation and self.worker.state is WorkerState.RUNNING and \
            self._trainer[0] == join.attached_generation else []
        return [Send(join), *unread, *running]

    def received(self, message: api.CoordinatorMessage) -> list[Action]:
        """Any message on the session, heartbeats included: each renews the coordinator's lease."""
        self._contact.heard(self.identity.coordinator)
        if self._check_sent_on == self._contact.session and not isinstance(message, api.Heartbeat):
            # The coordinator answered the checked Join; a heartbeat may have been on its way before it read it.
            self._check_result = self._check_sent_on = None
        if isinstance(message, api.Assignment):
            return [Announce("", ready=True), *self._assigned(message)]
        if isinstance(message, api.StopWorkers):
            return self._stop_ordered(message)
        if isinstance(message, api.Finished):
            return self._finished(message)
        if isinstance(message, api.DrainNode):
            log.info("drained by an operator (%s): checkpointing, stopping the worker and leaving the job",
                     message.reason)
            return self._leave(f"drained: {message.reason}", drained=True)
        if isinstance(message, api.CheckNode):
            if self.worker.state is not WorkerState.WAITING or self.winding_down:
                return []
            log.info("checking this node: %s", message.reason)
            self._check_owed = True
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
        actions = self._check_stall()
        if self._contact.heartbeat_due():
            actions.append(self._progress_report() or Send(api.Heartbeat()))
        return actions

    def session_ended(self, problem: str | None) -> list[Action]:
        """The session is over: as planned (``problem`` None), or lost. A lost one fences this node: the others
        move on without it, so its worker must be gone first."""
        self._contact.closed()
        if problem is not None:
            first = not self._contact.outage
            tls_problem = self._contact.lost(self.identity.coordinator, problem)
            if tls_problem is not None:  # a certificate that cannot be verified does not fix itself
                log.error("%s", tls_problem)
                self.exit_code = ExitCode.CONFIG
            if first:
                return [Announce(f"retrying the coordinator at {self.identity.coordinator} (unreachable: "
                                 f"{problem})"), *self._fence()]
        return self._fence()

    def etcd_observed(self, recorded: int | None, leader_known_for: float | None,
                      recorded_running: bool = True) -> list[Action]:
        """Between sessions, with etcd: what etcd says (the job's generation, None if it did not answer; how long
        the current coordinator has been known) decides whether to fence (agent/failover.py)."""
        a = self.assignment
        if not self.timing.failover or a is None or not self.worker.state.has_live_worker or self.winding_down:
            return []
        if self.worker.state is WorkerState.STOPPING:
            return []
        why = fence_reason(running=a.generation, recorded=recorded, silent=self._contact.silent(),
                           leader_known_for=leader_known_for, fence_after=self._contact.fence_after,
                           recorded_running=recorded_running)
        return self._stop(why, planned=False) if why is not None else []

    @property
    def sessions_opened(self) -> int:
        return self._contact.session

    def etcd_patience(self) -> float:
        """Between sessions, with etcd: how long to wait for etcd's answer. The coordinator counts this node lost
        after node_timeout of silence; rule 2 of failover.py must be decided half a heartbeat before that."""
        contact = self._contact
        return max(0.1, contact.fence_after + contact.heartbeat_interval / 2 - contact.silent())

    def refused(self, message: str, exit_code: ExitCode) -> None:
        """The coordinator refused this agent for good (wrong token, another job's settings, a duplicate id)."""
        log.error("%s", message)
        self.exit_code = exit_code

    def verdict(self) -> ExitCode | None:
        """Between sessions: how the agent ends, or None to try the coordinator again."""
        if self.exit_code is not None:
            return self.exit_code
        if self.leaving is not None:
            return ExitCode.SUCCEEDED
        if self._contact.gave_up():
            log.error("the coordinator at %s stayed unreachable for join_timeout=%gs; giving up",
                      self.identity.coordinator, self.timing.join_timeout)
            return ExitCode.FAILED
        return None

    # -------------------------------------------------------------------------------------------- worker

    def worker_started(self, generation: int, pid: int) -> list[Action]:
        a = self.assignment
        if a is None or a.generation != generation:
            return []
        log.info("generation %d: started worker pid %d as rank %d of %d", generation, pid, a.rank, a.world_size)
        return [Announce(f"running generation {generation} as rank {a.rank} of {a.world_size}")]

    def trainer_pid(self, generation: int, pid: int) -> list[Action]:
        """The trainer itself (the keeper's child) is running: status shows its pid."""
        if not self._current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []
        self._trainer = (generation, pid)
        return [self._report(api.WorkerStatus.RUNNING, pid=pid)]

    def launch_failed(self, generation: int, error: str) -> list[Action]:
        """The agent could not start the worker: a failure of this node's worker, reported as such."""
        if not self._current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []
        self.worker.to(WorkerState.FAILED)  # RUNNING -> FAILED
        self._failures.worker_failed()
        log.error("generation %d: cannot start the trainer: %s", generation, error)
        return [self._ending(api.WorkerStatus.FAILED, detail=f"cannot start the trainer: {error}")]

    def worker_exited(self, generation: int, code: int, output: Sequence[str] = ()) -> list[Action]:
        """``output``: the trainer's last lines; the exception it died of goes into the report."""
        if not self._current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []  # we stopped it on purpose
        if code == 0:
            self.worker.to(WorkerState.SUCCEEDED)  # RUNNING -> SUCCEEDED
            log.info("generation %d: trainer exited 0", generation)
            return [self._ending(api.WorkerStatus.SUCCEEDED)]
        self.worker.to(WorkerState.FAILED)  # RUNNING -> FAILED
        self._failures.worker_failed()
        detail = describe_exit(code)
        if (exception := exception_line(output)) is not None:
            detail = f"{detail}: {exception}"
        log.warning("generation %d: trainer %s", generation, detail)
        return [self._ending(api.WorkerStatus.FAILED, exit_code=code, detail=f"trainer {detail}")]

    def worker_stopped(self, result: StopResult) -> list[Action]:
        """Every process of the worker is gone."""
        planned, was_running = self._stopping
        actions: list[Action] = []
        if planned and was_running:
            self._count_graceful_stop(result)
        if was_running and self._completed(result):
            # It finished training while we stopped it: the coordinator must know (see rendezvous/state.py).
            log.info("the trainer completed (exit 0) while stopping")
            actions.append(self._report(api.WorkerStatus.SUCCEEDED))
        self.worker.to(WorkerState.STOPPED)  # STOPPING -> STOPPED
        return actions + self._after_stop()

    def final_stop(self) -> list[Action]:
        """The agent exits: nothing of its worker may outlive it."""
        clean = self.exit_code is ExitCode.SUCCEEDED or self.leaving is not None
        return self._stop("agent exiting", planned=clean)

    def progress(self, message: ProgressMessage) -> list[Action]:
        if not self._current(message.generation):
            return []  # a report from an older generation's worker
        if message.done:
            self._trainer_done = message.generation
        if self.worker.state is not WorkerState.RUNNING:
            return []
        first = self.tracker.latest is None
        self._failures.progressed()
        self._stall.progress(message.step, message.phase, training_done=message.done)
        if first and _before_restore(message):
            return []  # its step (a new process's 0) is not where the generation resumes, nor steps made
        self.tracker.record(message)
        # The first report of a generation goes out at once: where it resumed tells the coordinator what a
        # restart cost (steps redone or lost), and status shows the new generation training.
        return [self._report(api.WorkerStatus.RUNNING, pid=message.pid)] if first else []

    # ------------------------------------------------------------------------------------- local requests

    def signal_received(self, signum: int) -> list[Action]:
        """SIGTERM, SIGINT, SIGHUP or SIGQUIT: leave the job cleanly (a planned leave, not a failure)."""
        self.signalled = True
        return self._leave(f"agent stopped ({signal.Signals(signum).name})")

    # -------------------------------------------------------------------------------------------- orders

    def _assigned(self, assignment: api.Assignment) -> list[Action]:
        if self.worker.state is not WorkerState.WAITING or self.leaving is not None:
            log.warning("ignored the assignment to generation %d: worker is %s", assignment.generation,
                        self.worker.state.value)
            return []
        self.assignment = assignment
        self._ended = None
        self._stall.reset()
        self.tracker.new_generation()
        self.worker.to(WorkerState.RUNNING)  # WAITING -> RUNNING: the shell launches it now
        self._metrics.new_generation(assignment.generation, assignment.rank, assignment.world_size)
        if self._join_sent_at is not None:
            self._metrics.rendezvous.observe(self._clock() - self._join_sent_at)
            self._join_sent_at = None
        return [Launch(assignment)]

    def _stop_ordered(self, order: api.StopWorkers) -> list[Action]:
        reason = order.reason
        self._metrics.restarts.labels(reason=reason.value).inc()
        self._failures.stop_ordered(after_failure=reason.counts_against_budget)
        if not self._current(order.generation):
            mine = self.assignment.generation if self.assignment else None
            log.warning("ignored a stop order for generation %d: this node runs generation %s", order.generation,
                        mine)
            return []
        log.info("generation %d: stopping the worker (%s)", order.generation, reason.value)
        self._rejoin_session = self._contact.session  # the Join after the stop confirms the worker is gone
        return [Announce(f"restarting: {reason.value}"),
                *self._stop(reason.value, planned=not reason.counts_against_budget)]

    def _finished(self, order: api.Finished) -> list[Action]:
        level = logging.INFO if order.state is api.JobState.SUCCEEDED else logging.ERROR
        log.log(level, "job %s: %s", order.state.value, order.reason)
        self.exit_code = ExitCode.SUCCEEDED if order.state is api.JobState.SUCCEEDED else ExitCode.FAILED
        return [Announce(f"job {order.state.value}: {order.reason}"), HangUp()]

    def _leave(self, reason: str, *, drained: bool = False) -> list[Action]:
        if self.leaving is not None:
            return []
        self.leaving = Leaving(reason, drained)
        if not self._contact.open:
            return []  # between sessions: nobody to tell; the run loop ends
        log.info("%s: leaving the rendezvous and stopping the worker", reason)
        return [Announce("stopping: draining the worker"), Send(api.Leave(reason)),
                *self._stop("agent stopping", planned=True)]

    # ------------------------------------------------------------------------------------------ internals

    def _current(self, generation: int) -> bool:
        return self.assignment is not None and self.assignment.generation == generation

    def _fence(self) -> list[Action]:
        if self.winding_down or self.timing.failover:  # with etcd, etcd_observed decides
            return []
        return self._stop("fencing: the coordinator is unreachable", planned=False)

    def _stop(self, why: str, *, planned: bool) -> list[Action]:
        state = self.worker.state
        if state is WorkerState.STOPPING:
            return []  # one stop at a time: the end of the one under way covers this request too
        if not state.has_live_worker:
            return self._after_stop()
        was_running = self.worker.to(WorkerState.STOPPING) is WorkerState.RUNNING  # RUNNING|FAILED|SUCCEEDED ->
        self._stopping = (planned, was_running)
        return [Stop(why, planned)]

    def _after_stop(self) -> list[Action]:
        if self.leaving is not None:
            return [HangUp()] if self._contact.open else []
        if self._rejoin_session is not None and self._rejoin_session == self._contact.session and \
                self._contact.open and self.exit_code is None:
            self._rejoin_session = None
            return [Send(self._join())]
        return []

    def _join(self, *, checked: bool = False, failure: str = "") -> api.Join:
        if self.worker.state in (WorkerState.INIT, WorkerState.STOPPED):
            self.worker.to(WorkerState.WAITING)  # INIT|STOPPED -> WAITING
        ident, a = self.identity, self.assignment
        self._join_sent_at = self._clock()
        if self.timing.failover and a is not None and self.worker.state.has_live_worker:
            # Its worker runs on: a coordinator that took the job over keeps it, on the port it has.
            port = next(m.worker_port for m in a.members if m.node_id == ident.node_id)
            node = api.NodeInfo(ident.node_id, ident.host, port, ident.incarnation, a.generation, a.rank)
            return api.Join(node, ident.spec, a.restart_count, attached_generation=a.generation)
        port = ident.worker_port or self._pick_port(ident.host)
        node = api.NodeInfo(ident.node_id, ident.host, port, ident.incarnation, a.generation if a else 0,
                            a.rank if a else -1, self.restorable)
        return api.Join(node, ident.spec, a.restart_count if a else 0, checked=checked, check_failure=failure)

    def _report(self, status: api.WorkerStatus, *, pid: int = 0, exit_code: int = 0, detail: str = "") -> Send:
        assert self.assignment is not None
        return Send(api.WorkerReport(self.assignment.generation, status, pid=pid, exit_code=exit_code,
                                     detail=detail, progress=self.tracker.for_report(), gpus=self.gpus[0],
                                     gpu_utilization=self.gpus[1]))

    def _ending(self, status: api.WorkerStatus, *, exit_code: int = 0, detail: str = "") -> Send:
        self._ended = self._report(status, exit_code=exit_code, detail=detail)
        return self._ended

    def _progress_report(self) -> Send | None:
        latest = self.tracker.latest
        if latest is None or not self.tracker.unsent() or self.assignment is None:
            return None
        return self._report(api.WorkerStatus.RUNNING, pid=latest.pid)

    def _stall_limit(self) -> float:
        return self._stall.limit_in_force() if self.worker.state is WorkerState.RUNNING else 0.0

    def _check_stall(self) -> list[Action]:
        if self.worker.state is not WorkerState.RUNNING:
            return []
        silent = self._stall.newly_stalled()
        if silent is None:
            return []
        self._failures.worker_failed()
        detail = f"no progress for {silent:.1f}s ({self._stall.explain()})"
        log.warning("trainer stalled: %s", detail)
        return [self._ending(api.WorkerStatus.STALLED, detail=detail)]

    def _completed(self, result: StopResult) -> bool:
        """An exit 0 is a completion if the trainer ended by itself, or told us it had completed; an exit 0
        in answer to SIGTERM may just be a trainer that checkpointed and stopped."""
        said_done = self.assignment is not None and self._trainer_done == self.assignment.generation
        return result.returncode == 0 and (result.exited_before_stop or said_done)

    def _count_graceful_stop(self, result: StopResult) -> None:
        code = result.returncode
        if code == CHECKPOINTED_AND_STOPPED:
            latest = self.tracker.latest
            log.info("the trainer checkpointed%s and stopped: no work lost",
                     f" after step {latest.step}" if latest is not None else "")
            outcome = "checkpointed"
        elif code == -signal.SIGKILL and not result.exited_before_stop:
            log.warning("the trainer did not stop within stop_grace=%gs and was killed: work since its last "
                        "checkpoint is lost", self.timing.stop_grace)
            outcome = "killed"
        else:
            outcome = "exited"
        self._metrics.graceful_stops.labels(outcome=outcome).inc()


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _before_restore(message: ProgressMessage) -> bool:
    """A report of start-up that names no restored step: the library's trainers send one before they restore (the
    tier's restore reports the step it restored, and training reports come after it)."""
    return message.phase is Phase.SETUP and message.restored_step is None and not message.done
