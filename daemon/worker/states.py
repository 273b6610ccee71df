"""The one state machine of an agent's local worker: :class:`WorkerState` names every transition, and
:class:`WorkerStateMachine` refuses any other.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class WorkerState(enum.Enum):
    """The states of a node's worker, and every transition between them::

        INIT ──join──▶ WAITING ──assignment──▶ RUNNING ──exit 0──────▶ SUCCEEDED ──┐
                          ▲                       │  └──exit ≠ 0────────▶ FAILED ─────┤
                          │                       │                                    │
                          │                       └──stop order / shutdown / fence──▶ STOPPING
                          │                                                            │
                          └──────────────── rejoin ◀── STOPPED ◀──every process gone──┘

    ``INIT -> WAITING``        the agent sent Join and waits for the round to close
    ``WAITING -> RUNNING``     an Assignment arrived and the worker was launched for that generation
    ``RUNNING -> SUCCEEDED``   the trainer exited 0
    ``RUNNING -> FAILED``      the trainer exited non-zero
    ``RUNNING -> STOPPING``    the coordinator ordered a stop (a failure elsewhere, a stall reported by this
                               agent, a scale-up), or the agent is shutting down, or it lost the coordinator
                               (fencing)
    ``FAILED -> STOPPING``     clean up whatever the failed trainer left behind
    ``SUCCEEDED -> STOPPING``  the same, after a trainer that exited 0
    ``STOPPING -> STOPPED``    SIGTERM, grace, SIGKILL: every process of the worker is confirmed gone
    ``STOPPED -> WAITING``     the agent joins the next round (the Join confirms the old worker is gone)
    ``STOPPED -> RUNNING``     a parameter-server job's failed worker task is relaunched alone, with the same
                               assignment (agent/replacements.py); the chief and the parameter servers run on

    A stalled trainer stays RUNNING until the coordinator's stop order: the agent only reports the stall.
    """

    INIT = "init"
    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def has_live_worker(self) -> bool:
        """Whether processes of a worker may still exist in this state."""
        return self in (WorkerState.RUNNING, WorkerState.FAILED, WorkerState.SUCCEEDED, WorkerState.STOPPING)


_ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.INIT: frozenset({WorkerState.WAITING}),
    WorkerState.WAITING: frozenset({WorkerState.RUNNING}),
    WorkerState.RUNNING: frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPING}),
    WorkerState.SUCCEEDED: frozenset({WorkerState.STOPPING}),
    WorkerState.FAILED: frozenset({WorkerState.STOPPING}),
    WorkerState.STOPPING: frozenset({WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset({WorkerState.WAITING, WorkerState.RUNNING}),
}


class IllegalTransition(RuntimeError):
    pass


class WorkerStateMachine:
    """Holds the current state and refuses any transition not in :class:`WorkerState`'s table."""

    def __init__(self, on_change: Callable[[WorkerState], None] | None = None) -> None:
        self.state = WorkerState.INIT
        self._on_change = on_change

    def to(self, new: WorkerState) -> WorkerState:
        """Move to ``new``; returns the state it left."""
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"worker state {self.state.value} -> {new.value} is not allowed")
        old, self.state = self.state, new
        if self._on_change is not None:
            self._on_change(new)
        return old
