"""The one state machine of an agent's local worker. Every transition is listed here and guarded.

::

    INIT ──join──▶ WAITING ──assignment──▶ RUNNING ──exit 0──────▶ SUCCEEDED
                      ▲                       │  └──exit ≠ 0 / stall──▶ FAILED ──┐
                      │                       │                                  │
                      │                       └──stop order / shutdown──▶ STOPPING ◀──┘ (clean up what is left)
                      │                                                  │
                      └──────────────── rejoin ◀── STOPPED ◀──every process gone

``INIT -> WAITING``        the agent sent Join and waits for the round to close
``WAITING -> RUNNING``     an Assignment arrived and the worker was launched for that generation
``RUNNING -> SUCCEEDED``   the trainer exited 0
``RUNNING -> FAILED``      the trainer exited non-zero, or reported no progress for ``stall_timeout``
``RUNNING -> STOPPING``    the coordinator ordered a stop, or the agent is shutting down or lost the coordinator
``FAILED -> STOPPING``     clean up whatever the failed trainer left behind
``SUCCEEDED -> STOPPING``  the job restarts after all (another rank failed before the job finished)
``STOPPING -> STOPPED``    SIGTERM, grace, SIGKILL: every process of the worker is confirmed gone
``STOPPED -> WAITING``     the agent joins the next round (the Join confirms the old worker is gone)
``WAITING -> STOPPED``     the job ended, or the agent left, while no worker was running
``INIT -> STOPPED``        the agent stopped before it ever joined
"""

from __future__ import annotations

import enum


class WorkerState(enum.Enum):
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
    WorkerState.INIT: frozenset({WorkerState.WAITING, WorkerState.STOPPED}),
    WorkerState.WAITING: frozenset({WorkerState.RUNNING, WorkerState.STOPPED}),
    WorkerState.RUNNING: frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPING}),
    WorkerState.SUCCEEDED: frozenset({WorkerState.STOPPING}),
    WorkerState.FAILED: frozenset({WorkerState.STOPPING}),
    WorkerState.STOPPING: frozenset({WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset({WorkerState.WAITING}),
}


class IllegalTransition(RuntimeError):
    pass


class WorkerStateMachine:
    """Holds the current state and refuses any transition not in the table above."""

    def __init__(self) -> None:
        self.state = WorkerState.INIT
        self.generation = 0

    def to(self, new: WorkerState) -> WorkerState:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"worker state {self.state.value} -> {new.value} is not allowed")
        old, self.state = self.state, new
        return old

    def can(self, new: WorkerState) -> bool:
        return new in _ALLOWED[self.state]
