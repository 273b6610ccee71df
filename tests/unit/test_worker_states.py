"""Unit tests of the agent's worker state machine (:mod:`tfelastic.daemon.worker.states`).

The table of allowed transitions is written out here on purpose, not imported: a change to the table in the code
must fail a test until this file is changed with it.
"""

from __future__ import annotations

import itertools

import pytest
from tfelastic.daemon.worker.states import IllegalTransition, WorkerState, WorkerStateMachine

S = WorkerState

ALLOWED: frozenset[tuple[WorkerState, WorkerState]] = frozenset({
    (S.INIT, S.WAITING),
    (S.WAITING, S.RUNNING),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.STOPPING),
    (S.SUCCEEDED, S.STOPPING),
    (S.FAILED, S.STOPPING),
    (S.STOPPING, S.STOPPED),
    (S.STOPPED, S.WAITING),
    (S.STOPPED, S.RUNNING),  # a parameter-server job's worker task, replaced alone (agent/replacements.py)
})
ALL_PAIRS: list[tuple[WorkerState, WorkerState]] = list(itertools.product(WorkerState, WorkerState))
FORBIDDEN = [pair for pair in ALL_PAIRS if pair not in ALLOWED]
ALLOWED_IN_ORDER = [pair for pair in ALL_PAIRS if pair in ALLOWED]

# A legal way from INIT to every state, so each test starts from a state the machine really reached.
PATH_TO: dict[WorkerState, list[WorkerState]] = {
    S.INIT: [],
    S.WAITING: [S.WAITING],
    S.RUNNING: [S.WAITING, S.RUNNING],
    S.SUCCEEDED: [S.WAITING, S.RUNNING, S.SUCCEEDED],
    S.FAILED: [S.WAITING, S.RUNNING, S.FAILED],
    S.STOPPING: [S.WAITING, S.RUNNING, S.STOPPING],
    S.STOPPED: [S.WAITING, S.RUNNING, S.STOPPING, S.STOPPED],
}


def machine_in(state: WorkerState) -> WorkerStateMachine:
    machine = WorkerStateMachine()
    for step in PATH_TO[state]:
        machine.to(step)
    assert machine.state is state
    return machine


def test_the_table_covers_every_state() -> None:
    assert set(PATH_TO) == set(WorkerState)
    assert len(ALL_PAIRS) == 49
    assert len(FORBIDDEN) == 49 - 10


def test_a_new_machine_starts_in_init() -> None:
    assert WorkerStateMachine().state is S.INIT


@pytest.mark.parametrize(("old", "new"), ALLOWED_IN_ORDER, ids=lambda s: s.value)
def test_allowed_transition(old: WorkerState, new: WorkerState) -> None:
    machine = machine_in(old)
    assert machine.to(new) is old  # to() returns the state it left
    assert machine.state is new


@pytest.mark.parametrize(("old", "new"), FORBIDDEN, ids=lambda s: s.value)
def test_forbidden_transition_raises_naming_both_states(old: WorkerState, new: WorkerState) -> None:
    machine = machine_in(old)
    with pytest.raises(IllegalTransition) as excinfo:
        machine.to(new)
    assert str(excinfo.value) == f"worker state {old.value} -> {new.value} is not allowed"
    assert machine.state is old  # a refused transition changes nothing


def test_illegal_transition_is_a_runtime_error() -> None:
    assert issubclass(IllegalTransition, RuntimeError)


@pytest.mark.parametrize("state", list(WorkerState), ids=lambda s: s.value)
def test_has_live_worker(state: WorkerState) -> None:
    live = {S.RUNNING, S.FAILED, S.SUCCEEDED, S.STOPPING}
    assert state.has_live_worker is (state in live)


def test_full_lifecycle_through_a_failure_and_back_to_waiting() -> None:
    machine = WorkerStateMachine()
    lifecycle = [S.WAITING, S.RUNNING, S.FAILED, S.STOPPING, S.STOPPED, S.WAITING]
    seen = [machine.state]
    for new in lifecycle:
        old = machine.to(new)
        assert old is seen[-1]
        seen.append(machine.state)
    assert seen == [S.INIT, S.WAITING, S.RUNNING, S.FAILED, S.STOPPING, S.STOPPED, S.WAITING]
    assert [s.has_live_worker for s in seen] == [False, False, True, True, True, False, False]
    # and the next generation can run again
    machine.to(S.RUNNING)
    assert machine.state is S.RUNNING


def test_a_failed_worker_cannot_be_relaunched_before_it_is_stopped() -> None:
    machine = machine_in(S.FAILED)
    with pytest.raises(IllegalTransition, match=r"^worker state failed -> running is not allowed$"):
        machine.to(S.RUNNING)
