"""This node's worker, as plain code over an injected clock: its launch on an assignment, its start, exits and
progress, its stop, a parameter-server task relaunched alone, its standby and its stalls.

A collaborator of :class:`~tfelastic.daemon.agent.core.AgentCore`, which holds the coordinator's session and is the
shells' one way in: every input returns the :mod:`actions <tfelastic.daemon.agent.api>` to carry out. What follows a
stop that no relaunch follows (a Join, a hang-up, nothing) is the session's decision: this core says that the stop
ended (:meth:`WorkerCore.stop_ended`), and the session's side asks it after each call.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Callable, Sequence

from tfelastic.daemon.agent.api import (
    Action,
    AgentEnd,
    Announce,
    DumpStacks,
    EndStopSoon,
    ExtendStop,
    Identity,
    Launch,
    PrepareStandby,
    ProbeServer,
    RestorableSteps,
    ScanSnapshots,
    Send,
    Stop,
    StopResult,
    Timing,
    WaitGpusReleased,
    WaitPortFree,
    WorkerPolicy,
)
from tfelastic.daemon.agent.progress_tracker import ProgressTracker
from tfelastic.daemon.agent.replacements import PsTask
from tfelastic.daemon.agent.standby_schedule import StandbySchedule
from tfelastic.daemon.agent.trainer_watch import STACKS_PATIENCE, StepMarkReader, TrainerWatch
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.worker.states import WorkerState, WorkerStateMachine
from tfelastic.trainer.progress import ProgressMessage

log = logging.getLogger("tfelastic.agent")

Clock = Callable[[], float]

# How long a trainer that announced its exit code, its state saved, has to end during a stop before its tree is
# SIGKILLed: what is left is teardown (tf.data's autotuning thread can hold fit's return for up to a minute).
EXIT_PATIENCE = 1.0
# The same after a failure, whose next generation waits for this stop: the quarter second a failure stop's grace
# gives any trainer (failure_stop_grace's default), for its last lines of output.
FAILURE_EXIT_PATIENCE = 0.25
# How long a stop waits, at least, for a trainer that announced the survivors' save (a peer failed; it saves the
# step it holds for the next generation): a flash snapshot of ~400 MB takes under a second to local storage, a few
# to a shared file system. A save that takes longer is cut, and the next generation restores an older snapshot.
SURVIVOR_SAVE_PATIENCE = 10.0
# A failure stop of a mirrored job's trainer on the fast tier holds its SIGTERM about this many of its steps, for the
# trainer to reach the collective its peer's failure breaks (its step's compute comes first), save the step it
# holds and end; bounded by SURVIVOR_WINDOW_MAX, SURVIVOR_WINDOW_UNKNOWN before its rate is known. Not for a
# trainer found hung: it cannot reach it. (A SIGTERM first would start a graceful stop, whose agreement waits for
# the peer that is gone.)
SURVIVOR_WINDOW_STEPS = 2.0
SURVIVOR_WINDOW_MAX = 5.0
SURVIVOR_WINDOW_UNKNOWN = 1.0


class WorkerCore:
    """The worker's side of the agent. ``end`` is the agent's, read here: a worker stopped while the agent winds
    down is neither relaunched nor rejoined."""

    def __init__(self, identity: Identity, timing: Timing, policy: WorkerPolicy, metrics: AgentMetrics, clock: Clock,
                 end: AgentEnd, step_mark: StepMarkReader | None = None) -> None:
        self.identity, self.timing = identity, timing
        self._metrics, self._clock, self._end = metrics, clock, end
        self.worker = WorkerStateMachine(on_change=metrics.set_worker_state)
        self.assignment: api.Assignment | None = None
        self.trainer = TrainerWatch(timing.stall, timing.stop_grace, metrics, clock, step_mark)
        metrics.stall_limit.set_function(self._stall_limit)
        self._standby = StandbySchedule(clock, policy.standby_at_launch)
        self.rejoin_session: int | None = None  # the session to send a Join on once the stop is done (its side's)
        self._stop_ended = False  # a stop ended, and no relaunch follows: the session's side decides what does
        self._gpu_holders: tuple[int, ...] = ()  # a stopped worker's processes whose GPU memory is not seen back
        self._stopping: tuple[bool, bool] = (False, False)  # the stop under way: (planned, it was running)
        self._announced_exit: int | None = None  # the exit code the trainer announced during the stop under way
        self._survivor_save: int | None = None  # the step this launch's trainer saves for the survivors, announced
        # The pid of this launch's trainer when it said (in its restore report) that it saves as a survivor and
        # listens for PEER_FAILED_SIGNAL; 0 otherwise.
        self._hears_peer_failure = 0
        self.ps_task = PsTask(policy.replacement, clock)  # a parameter-server job's task on this node

    @property
    def tracker(self) -> ProgressTracker:
        return self.trainer.tracker

    @property
    def gpu_holders(self) -> tuple[int, ...]:
        """The stopped worker's processes that may still hold GPU memory, waited for (:class:`WaitGpusReleased`)
        before the next trainer starts here."""
        return self._gpu_holders

    @property
    def restorable(self) -> RestorableSteps:
        """The snapshot steps the next Join reports."""
        return self.trainer.node.restorable

    def describe(self) -> str:
        """The worker's state and generation, for an operator's SIGUSR1."""
        a = self.assignment
        return (f"worker {self.worker.state.value}, generation {a.generation if a else '-'}"
                f"{f' as rank {a.rank}' if a else ''}")

    def node_read(self, *, gpus: tuple[int, float] | None = None, restorable: RestorableSteps | None = None) -> None:
        """What the shell read of the node: its GPU count and mean utilization, the snapshot steps it can
        restore (newest first)."""
        node = self.trainer.node
        if gpus is not None:
            node.gpus, node.gpu_utilization = gpus
        if restorable is not None:
            node.restorable = restorable

    # -------------------------------------------------------------------------------------------- worker

    def worker_started(self, generation: int, pid: int, *, warm: bool = False) -> list[Action]:
        a = self.assignment
        self._metrics.launches.labels(start="warm" if warm else "cold").inc()
        if a is None or a.generation != generation:
            return []
        log.info("generation %d: started worker pid %d as rank %d of %d", generation, pid, a.rank, a.world_size)
        return [Announce(f"running generation {generation} as rank {a.rank} of {a.world_size}")]

    def trainer_pid(self, generation: int, pid: int) -> list[Action]:
        """The trainer itself (the keeper's child) is running: status shows its pid."""
        if not self.current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []
        return [self.trainer.trainer_started(pid)]

    def launch_failed(self, generation: int, error: str) -> list[Action]:
        """The agent could not start the worker: a failure of this node's worker, reported as such."""
        if not self.current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []
        self.worker.to(WorkerState.FAILED)  # RUNNING -> FAILED
        return [self.trainer.launch_failed(error)]

    def worker_exited(self, generation: int, code: int, output: Sequence[str] = (), *,
                      oom_killed: bool = False) -> list[Action]:
        """``output``: the trainer's last lines; the exception it died of goes into the report. ``oom_killed``: its
        memory cgroup counted an OOM kill while it ran."""
        if not self.current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []  # we stopped it on purpose
        # A parameter server or a worker serves until the job ends: an exit of any code is its task's failure.
        failed = code != 0 or self.ps_task.serves_only
        self.worker.to(WorkerState.FAILED if failed else WorkerState.SUCCEEDED)  # RUNNING -> SUCCEEDED|FAILED
        ended = self.trainer.exited(code, list(output), serves_only=self.ps_task.serves_only, oom_killed=oom_killed)
        return self._replace(ended) if failed and self.ps_task.replaceable else [ended]

    def worker_gone(self, pids: tuple[int, ...]) -> list[Action]:
        """Every process of the stopped worker is gone, before the stop is reported done. Returns what the next
        trainer here needs first, in order: before the Join that a coordinator's stop ends in, the snapshot steps
        to report, the old worker's GPU memory back and a fixed worker port free; before a worker task's relaunch
        alone, its GPU memory and its own port; nothing when no trainer follows."""
        self._gpu_holders = tuple(sorted({*self._gpu_holders, *pids}))
        if self.rejoin_session is not None and not self._end.winding_down:
            return self.before_join()
        return self._released() if self._relaunches_after_stop() else []

    def worker_stopped(self, result: StopResult) -> list[Action]:
        """Every process of the worker is gone."""
        planned, was_running = self._stopping
        result = self._as_announced(result)
        # A step in flight when the stop was ordered may have ended since: the coordinator counts from the last one.
        last = self.trainer.progress_report(stopping=True) if was_running else None
        actions: list[Action] = [last] if last is not None else []
        if planned and was_running:
            self.trainer.count_graceful_stop(result)
        if was_running and self.trainer.completed(result):
            # It finished training while we stopped it: the coordinator must know (see rendezvous/rounds.py).
            log.info("the trainer completed (exit 0) while stopping")
            actions.append(self.trainer.report(api.WorkerStatus.SUCCEEDED))
        self.worker.to(WorkerState.STOPPED)  # STOPPING -> STOPPED
        relaunches = self._relaunches_after_stop()  # read before ps_task.stopped() hands the report over
        replaced = self.ps_task.stopped()
        if relaunches and replaced is not None:
            return [*actions, Send(replaced), *self._serving_due()]
        self._stop_ended = True
        return actions

    def progress(self, message: ProgressMessage) -> list[Action]:
        if not self.current(message.generation):
            return []  # a report from an older generation's worker
        if message.exit_code is not None:
            return self._exit_announced(message.pid, message.exit_code)
        if message.survivor_save is not None:
            return self._survivor_save_announced(message.pid, message.survivor_save)
        if message.restored_tier is not None:
            self._hears_peer_failure = message.pid if message.hears_peer_failure else 0
        if message.done:
            self.tracker.done = True
        if self.worker.state is not WorkerState.RUNNING:
            return []
        self._standby.progressed(message.generation)
        # The first report that counts goes out at once (where the generation resumed: what a restart cost), and
        # the first past it (the end of the start-up in the goodput ledger); the rest ride on heartbeats.
        first = [self.trainer.report(api.WorkerStatus.RUNNING, pid=message.pid)] \
            if self.trainer.progressed(message) else []
        return first + self._standby_due()

    def stacks_dumped(self, generation: int, stacks: Sequence[str], missing: str = "") -> list[Action]:
        """The answer to DumpStacks: the lines the hung trainer printed (its Python stacks), or why there are none;
        the hang's report goes out with where it hangs."""
        if not self.current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []  # it ended meanwhile, and its end was reported
        return self._hang_reported(stacks, missing)

    def server_probed(self, generation: int, answered: bool) -> list[Action]:
        """The answer to ProbeServer: a worker task whose server stopped answering is replaced like one that
        exited (agent/replacements.py)."""
        if not self.current(generation) or self.worker.state is not WorkerState.RUNNING:
            return []
        probe = self.ps_task.probe
        first = probe.serving_after is None
        hung = probe.answered(answered)
        if first and probe.serving_after is not None:
            log.info("generation %d: %s serves, %.1fs after its launch", generation, self.ps_task.task_name(),
                     probe.serving_after)
            self._standby.progressed(generation)  # it reports no steps: serving is its progress (standby timing)
        if hung is None:
            return []
        log.warning("generation %d: %s is hung: %s", generation, self.ps_task.task_name(), hung)
        return self._replace(self.trainer.ending(api.WorkerStatus.STALLED, detail=f"hung: {hung}",
                                                 cause=api.FailureCause.HANG))

    # ---------------------------------------------------------------------------- the session's side asks

    def assigned(self, assignment: api.Assignment) -> list[Action]:
        """The coordinator's Assignment: launch its worker (ignored while a worker runs or the agent leaves)."""
        if self.worker.state is not WorkerState.WAITING or self._end.leaving is not None:
            log.warning("ignored the assignment to generation %d: worker is %s", assignment.generation,
                        self.worker.state.value)
            return []
        self.assignment = assignment
        self.ps_task.assigned(assignment, self.identity.node_id, self.identity.spec)
        self.ps_task.launched()
        self._launching(assignment.generation)
        self.worker.to(WorkerState.RUNNING)  # WAITING -> RUNNING: the shell launches it now
        self._metrics.new_generation(assignment.generation, assignment.rank, assignment.world_size)
        return [Launch(assignment)]

    def due(self) -> list[Action]:
        """Every tick of an open session: a hang's report, a standby, a relaunch or probe, a leaving task's stop."""
        return self._check_stall() + self._standby_due() + self._serving_due() + self._served_long_enough()

    def gpus_back(self) -> None:
        """NVML lists none of the stopped worker's processes any more: nothing to wait for before the next one."""
        self._gpu_holders = ()

    def cancel_standby(self) -> None:
        self._standby.cancel()

    def before_join(self) -> list[Action]:
        """What a Join that may start a generation needs first: the steps it reports, and what the old worker held."""
        return [ScanSnapshots(), *self._released()]

    def current(self, generation: int) -> bool:
        """``generation`` is the one this node was last assigned."""
        return self.assignment is not None and self.assignment.generation == generation

    def stop(self, why: str, *, planned: bool, peer_failed: bool = False) -> list[Action]:
        """Stop the worker (one stop at a time); with none alive, the stop has ended at once (:meth:`stop_ended`).
        ``peer_failed``: the coordinator's order after a member's failure, which the trainer may survive."""
        state = self.worker.state
        if state is WorkerState.STOPPING:
            return []  # one stop at a time: the end of the one under way covers this request too
        if not state.has_live_worker:
            self._stop_ended = True
            return []
        was_running = self.worker.to(WorkerState.STOPPING) is WorkerState.RUNNING  # RUNNING|FAILED|SUCCEEDED ->
        self._stopping = (planned, was_running)
        # Announced before the stop: a peer's stop request reached this trainer first (TensorFlow's agreement).
        # A survivors' save announced before the stop: the peer's failure reached the trainer first (its collective
        # failed at once) and the save is under way.
        kept = [ExtendStop(SURVIVOR_SAVE_PATIENCE)] if self._survivor_save is not None else []
        end_soon = [EndStopSoon(self._exit_patience())] if self._announced_exit is not None else []
        hold = self._survivor_window() if peer_failed and not planned else 0.0
        return [Stop(why, planned, hold, self._hears_peer_failure if hold else 0), *kept, *end_soon]

    def stop_ended(self) -> bool:
        """Whether a stop ended since the last call, with no relaunch to follow (asked after every input)."""
        ended, self._stop_ended = self._stop_ended, False
        return ended

    # ------------------------------------------------------------------------------------------ internals

    def _served_long_enough(self) -> list[Action]:
        """A leaving parameter server or worker that no stop order reached within stop_grace stops anyway."""
        leaving = self._end.leaving
        if leaving is None or leaving.serve_until is None or self.worker.state is not WorkerState.RUNNING or \
                self._clock() < leaving.serve_until:
            return []
        log.warning("no stop order within stop_grace=%gs of leaving: stopping %s now", self.timing.stop_grace,
                    self.ps_task.task_name())
        return self.stop("leaving: stop_grace passed", planned=True)

    def _exit_announced(self, pid: int, code: int) -> list[Action]:
        """The trainer says it exits ``code`` with its state saved: a stop ends EXIT_PATIENCE later
        (FAILURE_EXIT_PATIENCE after a failure), the one under way or the next one (the agent stops a trainer that
        its peers' stop request reached first, or whose survivors' save ended). Nothing is cut short outside a
        stop: the trainer exits by itself, or the hang detection sees it. Only the process that reports the
        trainer's progress speaks for it."""
        state, latest = self.worker.state, self.tracker.latest
        if state not in (WorkerState.RUNNING, WorkerState.STOPPING) or self._announced_exit is not None or \
                (latest is not None and latest.pid != pid):
            return []
        self._announced_exit = code
        if state is not WorkerState.STOPPING:
            log.info("the trainer (pid %d) saved its state and exits %d: a stop of it ends soon after it begins",
                     pid, code)
            return []
        log.info("the trainer (pid %d) saved its state and exits %d: its stop ends %gs from now if its processes "
                 "are still there", pid, code, self._exit_patience())
        return [EndStopSoon(self._exit_patience())]

    def _exit_patience(self) -> float:
        """How long the stop under way waits for a trainer that announced its exit (see EXIT_PATIENCE)."""
        planned, _ = self._stopping
        return EXIT_PATIENCE if planned else FAILURE_EXIT_PATIENCE

    def _survivor_window(self) -> float:
        """How long a failure stop holds its SIGTERM for the survivors' save (see SURVIVOR_WINDOW_STEPS)."""
        a = self.assignment
        if not self._hears_peer_failure or self.trainer.found_hung or self.ps_task.task is not None or a is None or \
                a.world_size < 2 or self.worker.state is not WorkerState.STOPPING or not self._stopping[1]:
            return 0.0
        rate = self.tracker.steps_per_second()
        return min(SURVIVOR_WINDOW_MAX, SURVIVOR_WINDOW_STEPS / rate) if rate > 0 else SURVIVOR_WINDOW_UNKNOWN

    def _survivor_save_announced(self, pid: int, step: int) -> list[Action]:
        """A peer failed and the trainer saves ``step``, the state it holds, for the next generation: the stop
        under way, or the next one, waits SURVIVOR_SAVE_PATIENCE for it at least (the trainer announces its exit
        once the save is durable). Only the process that reports the trainer's progress speaks for it."""
        state, latest = self.worker.state, self.tracker.latest
        if state not in (WorkerState.RUNNING, WorkerState.STOPPING) or self._survivor_save is not None or \
                (latest is not None and latest.pid != pid):
            return []
        self._survivor_save = step
        log.info("a peer of the trainer (pid %d) failed; it saves step %d, the state it holds, for the next "
                 "generation: %s waits up to %gs for it", pid, step,
                 "the stop" if state is WorkerState.STOPPING else "the stop that follows", SURVIVOR_SAVE_PATIENCE)
        return [ExtendStop(SURVIVOR_SAVE_PATIENCE)] if state is WorkerState.STOPPING else []

    def _as_announced(self, result: StopResult) -> StopResult:
        """A trainer SIGKILLed after it announced its exit code ended as it said it would: with that code."""
        code, self._announced_exit = self._announced_exit, None
        if code is None or result.returncode != -signal.SIGKILL or result.exited_before_stop:
            return result
        log.info("the trainer was SIGKILLed after it announced exit %d with its state saved: counted as that exit",
                 code)
        return dataclasses.replace(result, returncode=code)

    def _launching(self, generation: int) -> None:
        """A trainer of ``generation`` starts: nothing it says has come in yet."""
        self.trainer.launched(generation)
        self._standby.launched(generation)
        self._announced_exit = self._survivor_save = None
        self._hears_peer_failure = 0

    def _relaunches_after_stop(self) -> bool:
        """The stop under way ends in this worker task's relaunch alone (a parameter-server job)."""
        return self.ps_task.replacing and not self._end.winding_down and self.rejoin_session is None

    def _released(self) -> list[Action]:
        """The old worker's GPU memory given back, then a port the next trainer binds again free of it: a fixed
        worker port (a fresh port per Join is free), or the task's own port before it is relaunched alone at the
        same address."""
        gpus: list[Action] = [WaitGpusReleased(self._gpu_holders)] if self._gpu_holders else []
        a = self.assignment
        port = a.members[a.rank].worker_port if self._relaunches_after_stop() and a is not None \
            else self.identity.worker_port
        return gpus + ([WaitPortFree(port)] if port else [])

    def _stall_limit(self) -> float:
        return self.trainer.stall.limit_in_force() if self.worker.state is WorkerState.RUNNING else 0.0

    def _check_stall(self) -> list[Action]:
        a = self.assignment
        if self.worker.state is not WorkerState.RUNNING or self.ps_task.serves_only or a is None:
            return []
        if (held := self.trainer.held_hang_due()) is not None:
            return [held]
        if self.trainer.hang_overdue():
            return self._hang_reported([], f"they did not come within {STACKS_PATIENCE:g}s")
        if not self.trainer.stall_found():
            return []
        latest = self.tracker.latest
        return [DumpStacks(a.generation, latest.pid if latest is not None else 0)]

    def _hang_reported(self, stacks: Sequence[str], missing: str) -> list[Action]:
        report = self.trainer.hang_report(stacks, missing)
        return [report] if report is not None else []

    def _replace(self, ended: Send) -> list[Action]:
        """A parameter-server job's worker task ended or hung: stop what is left of it and relaunch it alone, or,
        its budget spent, report it (the coordinator restarts the job)."""
        assert isinstance(ended.message, api.WorkerReport)
        report = self.ps_task.failed(ended.message)
        if report.status is not api.WorkerStatus.REPLACED:
            log.error("%s", report.detail)
            return [Send(report)]
        return self.stop(f"replacing {self.ps_task.task_name()}", planned=False)

    def _serving_due(self) -> list[Action]:
        """A replacement whose backoff is over, or a probe of the worker task's server."""
        a = self.assignment
        if a is None or self._end.winding_down:
            return []
        if self.worker.state is WorkerState.STOPPED and self.rejoin_session is None and self.ps_task.due():
            self.worker.to(WorkerState.RUNNING)  # STOPPED -> RUNNING: the same assignment, at the same address
            self.ps_task.launched()
            self._launching(a.generation)
            self._metrics.restarts.labels(reason=api.RestartReason.WORKER_REPLACED.value).inc()
            log.info("generation %d: relaunching %s alone", a.generation, self.ps_task.task_name())
            return [Announce(f"relaunching {self.ps_task.task_name()}"), Launch(a)]
        if self.worker.state is WorkerState.RUNNING and self.ps_task.replaceable and self.ps_task.probe.due():
            return [ProbeServer(a.generation, a.members[a.rank].address)]
        return []

    def _standby_due(self) -> list[Action]:
        generation = self._standby.due()
        if generation is None or self._end.winding_down or not self.current(generation) or self.assignment is None:
            return []
        return [PrepareStandby(self.assignment)]
