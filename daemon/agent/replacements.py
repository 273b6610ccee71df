"""A parameter-server job's worker task on this node: when to replace it alone, and when it counts as hung. Pure:
an injected clock, no sockets.

A worker task that fails is relaunched by its agent with the same TF_CONFIG, at the same address, and the chief's
ClusterCoordinator re-attaches it (docs/facts.md, fact 18); the chief and the parameter servers never stop. Each
node has its own budget for this (``--worker-replacements`` within ``--restart-window``): a worker that keeps
failing is reported as failed, and the coordinator restarts the job (which also counts it against the node's
quarantine). Replacements in a row back off like the coordinator's restarts: the first at once, the next after
``restart_backoff``, doubling up to ``restart_backoff_max``; a worker that served ``HEALTHY_SECONDS`` resets that.

A worker reports no training progress (the chief does), so hang detection cannot watch it. Instead the agent
probes the task's gRPC server every :data:`PROBE_INTERVAL` seconds: :data:`PROBES_TO_HANG` unanswered probes in a
row, once the server answered or :data:`STARTUP_SECONDS` after the launch, make it hung, and it is replaced.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tfelastic.daemon.options import default_of
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.roles import PS, WORKER

HEALTHY_SECONDS = 60.0
PROBE_INTERVAL = 2.0
PROBE_TIMEOUT = 2.0  # seconds a probe waits for the server's answer
PROBES_TO_HANG = 3
STARTUP_SECONDS = 120.0  # a worker whose server never answered is hung this long after its launch


class WorkerReplacements:
    def __init__(self, budget: int, window: float, backoff: float, backoff_max: float,
                 clock: Callable[[], float]) -> None:
        self._budget, self._window = budget, window
        self._backoff, self._backoff_max = backoff, backoff_max
        self._clock = clock
        self._times: deque[float] = deque()  # replacements within the window
        self._in_a_row = 0
        self._launched_at = clock()
        self.total = 0
        self.due_at: float | None = None  # a replacement waits for its backoff until then

    def launched(self) -> None:
        self._launched_at = self._clock()
        self.due_at = None

    def failed(self) -> float | None:
        """The worker failed: the seconds to wait before its replacement, or None when the budget is spent."""
        now = self._clock()
        while self._times and now - self._times[0] > self._window:
            self._times.popleft()
        if len(self._times) >= self._budget:
            return None
        self._times.append(now)
        self.total += 1
        self._in_a_row = 1 if now - self._launched_at >= HEALTHY_SECONDS else self._in_a_row + 1
        delay = 0.0 if self._in_a_row <= 1 else min(self._backoff_max,
                                                     self._backoff * (1 << min(self._in_a_row - 2, 32)))
        return delay

    def schedule(self, delay: float) -> None:
        self.due_at = self._clock() + delay

    def due(self) -> bool:
        return self.due_at is not None and self._clock() >= self.due_at

    def cancel(self) -> None:
        self.due_at = None

    def budget_text(self) -> str:
        return f"replaced {len(self._times)} times within {self._window:g}s (--worker-replacements {self._budget})"


class ServerProbe:
    """When to probe the worker task's server, and whether its answers so far make it hung."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._launched_at: float | None = None
        self._next = 0.0
        self._unanswered = 0
        self._answered_once = False
        self._in_flight = False
        self.serving_after: float | None = None  # seconds from the launch to the first answer

    def launched(self) -> None:
        now = self._clock()
        self._launched_at, self._next = now, now + PROBE_INTERVAL
        self._unanswered, self._answered_once, self._in_flight = 0, False, False
        self.serving_after = None

    def stopped(self) -> None:
        self._launched_at = None

    def due(self) -> bool:
        """True once per interval while the worker runs and no probe is out."""
        now = self._clock()
        if self._launched_at is None or self._in_flight or now < self._next:
            return False
        self._in_flight, self._next = True, now + PROBE_INTERVAL
        return True

    def answered(self, ok: bool) -> str | None:
        """A probe's result; the reason the worker counts as hung, or None."""
        self._in_flight = False
        if self._launched_at is None:
            return None
        if ok:
            if not self._answered_once:
                self.serving_after = self._clock() - self._launched_at
            self._unanswered, self._answered_once = 0, True
            return None
        self._unanswered += 1
        started = self._answered_once or self._clock() - self._launched_at >= STARTUP_SECONDS
        if started and self._unanswered >= PROBES_TO_HANG:
            self._launched_at = None  # one verdict per launch
            return (f"its server did not answer {self._unanswered} probes in a row"
                    if self._answered_once else f"its server never answered in {STARTUP_SECONDS:g}s")
        return None


@dataclass(frozen=True)
class ReplacementPolicy:
    budget: int  # --worker-replacements
    window: float  # --restart-window
    backoff: float  # --restart-backoff
    backoff_max: float  # --restart-backoff-max

    @classmethod
    def defaults(cls) -> ReplacementPolicy:
        """The options' built-in values (daemon/options.py)."""
        return cls(default_of("worker_replacements"), default_of("restart_window"), default_of("restart_backoff"),
                   default_of("restart_backoff_max"))


class PsTask:
    """This node's task in a parameter-server job, and the replacement of its worker task under way."""

    def __init__(self, policy: ReplacementPolicy, clock: Callable[[], float]) -> None:
        self.task: tuple[str, int] | None = None  # (type, index); None: a mirrored job, or no assignment yet
        self.replacements = WorkerReplacements(policy.budget, policy.window, policy.backoff, policy.backoff_max,
                                               clock)
        self.probe = ServerProbe(clock)
        self._report: api.WorkerReport | None = None  # what the replacement under way tells the coordinator
        self._delay = 0.0

    def assigned(self, assignment: api.Assignment, node_id: str, spec: api.JobSpec) -> None:
        member = next((m for m in assignment.members if m.node_id == node_id), None)
        self.task = member.task if spec.parameter_server and member is not None else None
        self.cancel()

    @property
    def serves_only(self) -> bool:
        """A parameter server or worker: it reports no training progress, so hang detection does not watch it."""
        return self.task is not None and self.task[0] in (PS, WORKER)

    @property
    def replaceable(self) -> bool:
        return self.task is not None and self.task[0] == WORKER

    def launched(self) -> None:
        self.replacements.launched()
        if self.replaceable:
            self.probe.launched()

    def failed(self, ended: api.WorkerReport) -> api.WorkerReport:
        """The worker task ended (``ended``: the report of its end, FAILED or STALLED). Returns the report to send
        now when the budget is spent (the coordinator restarts the job); else keeps a replacement report for
        :meth:`stopped` and returns a REPLACED report whose status the caller checks."""
        self.probe.stopped()
        delay = self.replacements.failed()
        if delay is None:
            return dataclasses.replace(ended, detail=f"{ended.detail}; {self.replacements.budget_text()}")
        self._delay = delay
        self._report = dataclasses.replace(ended, status=api.WorkerStatus.REPLACED,
                                           detail=f"{self.task_name()} {ended.detail}: replaced alone")
        return self._report

    @property
    def replacing(self) -> bool:
        """A failed worker task is being stopped, to be relaunched alone."""
        return self._report is not None

    def stopped(self) -> api.WorkerReport | None:
        """The failed worker's processes are gone: the replacement's report, once; its launch waits until
        :meth:`due`."""
        report, self._report = self._report, None
        if report is not None:
            self.replacements.schedule(self._delay)
        return report

    def due(self) -> bool:
        if not self.replacements.due():
            return False
        self.replacements.cancel()
        return True

    def cancel(self) -> None:
        """The job restarts, ends, or this agent leaves: no replacement."""
        self._report = None
        self.replacements.cancel()
        self.probe.stopped()

    def task_name(self) -> str:
        return f"{self.task[0]} {self.task[1]}" if self.task is not None else "the worker"
