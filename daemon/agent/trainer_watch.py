"""What the agent knows of its current trainer, and the reports it makes of it (pure): its progress
(:class:`ProgressTracker`), hang detection (:class:`StallDetector`), the failure timings, its pid, how the worker
ended (told again to a coordinator that takes the job over), and the node's GPU summary that every report
carries. The core decides when a report goes out; this module composes it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tfelastic.daemon.agent.api import RestorableSteps, Send, StopResult
from tfelastic.daemon.agent.progress_tracker import FailureTimes, ProgressTracker, before_restore
from tfelastic.daemon.exit_codes import CHECKPOINTED_AND_STOPPED
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.worker.output import cause_in_words, describe_exit, exception_line, failure_cause
from tfelastic.daemon.worker.stacks import hang_site, waits_in_a_library
from tfelastic.daemon.worker.stall import StallDetector, StallLimits
from tfelastic.trainer.progress import ProgressMessage

log = logging.getLogger("tfelastic.agent")


@dataclass
class NodeReadings:
    """What the shell last read of this node, for the messages that carry it."""

    gpus: int = 0
    gpu_utilization: float = 0.0
    # The snapshot steps this node can restore, newest first, read before each Join that may start a generation.
    restorable: RestorableSteps = field(default_factory=RestorableSteps)


StepMarkReader = Callable[[int], "int | None"]  # generation -> the step its trainer last marked, if any
# How long a hang's report waits for the trainer's stacks (the shell's own bound is 2 s): then it goes without.
STACKS_PATIENCE = 5.0
# A trainer found waiting in a library call (a collective, a lock) may be a victim of a peer hung in its own code,
# whose agent finds the hang at about the same time (the same limit, reports 0.1 s apart, ticks 0.25 s apart): its
# report goes this much later, so that the first report, which the restart is recorded as, is the culprit's.
WAITING_HANG_DELAY = 0.5


@dataclass(frozen=True)
class Hang:
    """A stall found, whose report waits for the trainer's stacks."""

    detail: str
    found_at: float


@dataclass(frozen=True)
class HeldHang:
    """A hang's report held back: its trainer waits in a library call (:data:`WAITING_HANG_DELAY`)."""

    detail: str
    due_at: float


class TrainerWatch:
    def __init__(self, limits: StallLimits, stop_grace: float, metrics: AgentMetrics,
                 clock: Callable[[], float], step_mark: StepMarkReader | None = None) -> None:
        self._metrics, self._stop_grace, self._clock = metrics, stop_grace, clock
        self._step_mark = step_mark
        self._hang: Hang | None = None
        # A hang of this launch's trainer was reported: not one held as waiting in a library call, which may be a
        # peer's victim (a survivor's collective, whose abort lets it save the step it holds).
        self.found_hung = False
        self._held: HeldHang | None = None
        self.tracker = ProgressTracker(clock, metrics)
        self.failures = FailureTimes(clock, metrics)
        self.stall = StallDetector(limits, clock)
        self.node = NodeReadings()
        self.ended: Send | None = None  # how this generation's worker ended, reported again after a failover
        self._generation = 0
        self._pid = 0  # the running trainer's, told again to a new coordinator
        self._resumed_at: int | None = None  # the step the generation resumed at, until a step past it is reported

    def launched(self, generation: int) -> None:
        """A new worker starts: nothing it reports has come in yet."""
        self._generation, self._pid, self.ended = generation, 0, None
        self._resumed_at = None
        self._hang = self._held = None
        self.found_hung = False
        self.stall.reset()
        self.tracker.new_generation()
        self.failures.assigned()

    def trainer_started(self, pid: int) -> Send:
        self._pid = pid
        return self.report(api.WorkerStatus.RUNNING, pid=pid)

    def report(self, status: api.WorkerStatus, *, pid: int = 0, exit_code: int = 0, detail: str = "",
               cause: api.FailureCause | None = None) -> Send:
        return Send(api.WorkerReport(self._generation, status, pid=pid, exit_code=exit_code, detail=detail,
                                     progress=self.tracker.for_report(), gpus=self.node.gpus,
                                     gpu_utilization=self.node.gpu_utilization, cause=cause))

    def progress_report(self, *, stopping: bool = False) -> Send | None:
        """The latest progress, if the coordinator has not seen it yet; ``stopping``: the trainer is about to be
        stopped, with the steps it made since its last report (its step mark)."""
        if stopping:
            self._read_step_mark()
        latest = self.tracker.latest
        if latest is None or not self.tracker.unsent():
            return None
        return self.report(api.WorkerStatus.RUNNING, pid=latest.pid)

    def for_new_coordinator(self, generation: int, running: bool) -> list[Send]:
        """What a coordinator that took the job over cannot know: how the worker ended, if it did while no
        coordinator answered, and the trainer of a worker that runs."""
        unread = [self.ended] if self.ended is not None else []
        trainer = [self.report(api.WorkerStatus.RUNNING, pid=self._pid)] \
            if running and self._pid and generation == self._generation else []
        return unread + trainer

    def progressed(self, message: ProgressMessage) -> bool:
        """A report of the running worker's; True when it goes to the coordinator at once: the first that counts
        (where the generation resumed: what the restart cost) and the first past that step (the end of the
        start-up, in the coordinator's goodput ledger; at the next heartbeat, half a second of training would be
        counted as start-up, and a generation shorter than that as no training at all)."""
        first = self.tracker.latest is None
        self.failures.progressed()
        self.stall.progress(message.step, message.phase, training_done=message.done)
        self.tracker.phase(message)
        if first and before_restore(message):
            return False  # its step (a new process's 0) is neither where it resumed nor steps made
        self.tracker.record(message)
        if first:
            self._resumed_at = message.step
            return True
        if self._resumed_at is not None and message.step > self._resumed_at:
            self._resumed_at = None
            return True
        return False

    def exited(self, code: int, output: tuple[str, ...] | list[str], *, serves_only: bool = False,
               oom_killed: bool = False) -> Send:
        """The worker ended by itself: the report of its end. ``serves_only``: a parameter-server job's ps or
        worker task, which serves until the job ends, so that even an exit 0 is a failure. ``oom_killed``: its
        memory cgroup counted an OOM kill while it ran (worker/oom.py)."""
        if code == 0 and not serves_only:
            log.info("generation %d: trainer exited 0", self._generation)
            return self.ending(api.WorkerStatus.SUCCEEDED)
        self.failures.worker_failed()
        cause = failure_cause(code, output, oom_killed=oom_killed)
        detail = describe_exit(code) if code != 0 else "exited 0, but its task serves until the job ends"
        if cause is api.FailureCause.OUT_OF_MEMORY and oom_killed:
            detail += " (the kernel's OOM killer: its memory cgroup counted the kill)"
        if (exception := exception_line(output)) is not None:
            detail = f"{detail}: {exception}"
        detail = cause_in_words(cause) + detail
        log.warning("generation %d: trainer %s (cause: %s)", self._generation, detail, cause.value)
        return self.ending(api.WorkerStatus.FAILED, exit_code=code, detail=f"trainer {detail}", cause=cause)

    def launch_failed(self, error: str) -> Send:
        self.failures.worker_failed()
        log.error("generation %d: cannot start the trainer: %s", self._generation, error)
        return self.ending(api.WorkerStatus.FAILED, detail=f"cannot start the trainer: {error}",
                           cause=api.FailureCause.LAUNCH_FAILED)

    def stall_found(self) -> bool:
        """True the first time the running trainer is silent for longer than its limit: its stacks are asked for,
        and :meth:`hang_report` reports the hang with them."""
        silent = self.stall.newly_stalled()
        if silent is None:
            return False
        self.failures.worker_failed()
        self._hang = Hang(f"no progress for {silent:.1f}s ({self.stall.explain()})", self._clock())
        return True

    def hang_overdue(self) -> bool:
        """The stacks asked for have not come within :data:`STACKS_PATIENCE`."""
        return self._hang is not None and self._clock() - self._hang.found_at >= STACKS_PATIENCE

    def hang_report(self, stacks: Sequence[str], missing: str) -> Send | None:
        """The stall's report, with where the trainer hangs (worker/stacks.py) or why that is not known; None
        while it is held (:data:`WAITING_HANG_DELAY`: :meth:`held_hang_due` sends it)."""
        hang, self._hang = self._hang, None
        if hang is None:
            return None
        site = hang_site(stacks)
        where = site or f"no Python stacks: {missing or 'the trainer printed no stack dump'}"
        log.warning("trainer stalled: %s; %s%s", hang.detail, where,
                    " (its stacks are the lines of its output just above)" if site else "")
        detail = f"{hang.detail}; {where}"
        if waits_in_a_library(stacks):
            self._held = HeldHang(detail, self._clock() + WAITING_HANG_DELAY)
            return None
        return self._hung(detail)

    def held_hang_due(self) -> Send | None:
        """The held report, once its delay is over (unless the worker was stopped meanwhile: a new launch drops
        it)."""
        held = self._held
        if held is None or self._clock() < held.due_at:
            return None
        self._held = None
        return self._hung(held.detail)

    def _hung(self, detail: str) -> Send:
        self.found_hung = True
        return self.ending(api.WorkerStatus.STALLED, detail=detail, cause=api.FailureCause.HANG)

    def ending(self, status: api.WorkerStatus, *, exit_code: int = 0, detail: str = "",
               cause: api.FailureCause | None = None) -> Send:
        """The report of the worker's end; a failure's ``cause`` is counted here, once per end."""
        self._read_step_mark()  # a trainer that died or hung between two reports made steps they do not show
        if cause is not None:
            self._metrics.trainer_failures.labels(cause=cause.value).inc()
        self.ended = self.report(status, exit_code=exit_code, detail=detail, cause=cause)
        return self.ended

    def _read_step_mark(self) -> None:
        step = self._step_mark(self._generation) if self._step_mark is not None else None
        if step is not None:
            self.tracker.reached(step)

    def completed(self, result: StopResult) -> bool:
        """An exit 0 is a completion if the trainer ended by itself, or told us it had completed; an exit 0
        in answer to SIGTERM may just be a trainer that checkpointed and stopped."""
        return result.returncode == 0 and (result.exited_before_stop or self.tracker.done)

    def count_graceful_stop(self, result: StopResult) -> None:
        code = result.returncode
        if code == CHECKPOINTED_AND_STOPPED:
            latest = self.tracker.latest
            log.info("the trainer checkpointed%s and stopped: no work lost",
                     f" after step {latest.step}" if latest is not None else "")
            outcome = "checkpointed"
        elif code == -signal.SIGKILL and not result.exited_before_stop:
            log.warning("the trainer did not stop within stop_grace=%gs and was killed: work since its last "
                        "checkpoint is lost", self._stop_grace)
            outcome = "killed"
        else:
            outcome = "exited"
        self._metrics.graceful_stops.labels(outcome=outcome).inc()
