"""Roles of a parameter-server job (rendezvous/roles.py)."""

from __future__ import annotations

import pytest
from tfelastic.daemon.rendezvous.roles import (
    CHIEF,
    PS,
    WORKER,
    Candidate,
    Role,
    RolesUnfilled,
    Task,
    assign,
    rank_of_task,
    task_of_rank,
)


def names(assigned: list[tuple[str, Task]]) -> list[tuple[str, str]]:
    return [(node, str(task)) for node, task in assigned]


def test_rank_order_is_chief_then_ps_then_workers() -> None:
    tasks = [task_of_rank(rank, 2) for rank in range(5)]
    assert tasks == [Task(CHIEF, 0), Task(PS, 0), Task(PS, 1), Task(WORKER, 0), Task(WORKER, 1)]
    assert [rank_of_task(t, 2) for t in tasks] == list(range(5))


@pytest.mark.parametrize("task", [Task(CHIEF, 0), Task(PS, 0), Task(PS, 3), Task(WORKER, 0), Task(WORKER, 12)])
def test_a_tasks_description_parses_back_to_it(task: Task) -> None:
    assert Task.parse(str(task)) == task


@pytest.mark.parametrize("described", ["", "chief 1", "ps", "worker x", "worker -1", "evaluator 0", "ps  0"])
def test_anything_else_is_no_task(described: str) -> None:
    assert Task.parse(described) is None


def test_any_nodes_fill_in_the_given_order() -> None:
    got = assign([Candidate(n, Role.ANY) for n in "abcd"], ps_count=1, max_nodes=4)
    assert names(got) == [("a", "chief"), ("b", "ps 0"), ("c", "worker 0"), ("d", "worker 1")]


def test_stated_roles_are_honoured_before_any() -> None:
    nodes = [Candidate("gpu1", Role.WORKER), Candidate("any1", Role.ANY), Candidate("cpu1", Role.PS),
             Candidate("gpu2", Role.WORKER), Candidate("boss", Role.CHIEF)]
    got = assign(nodes, ps_count=1, max_nodes=8)
    assert names(got) == [("boss", "chief"), ("cpu1", "ps 0"), ("gpu1", "worker 0"), ("gpu2", "worker 1"),
                          ("any1", "worker 2")]


def test_last_tasks_and_indices_are_kept() -> None:
    # b was worker 1 and c worker 0; a newcomer d takes the index nobody kept
    nodes = [Candidate("a", Role.ANY, Task(CHIEF, 0)), Candidate("b", Role.ANY, Task(WORKER, 1)),
             Candidate("e", Role.ANY, Task(PS, 0)), Candidate("d", Role.ANY), Candidate("c", Role.ANY, Task(WORKER, 0))]
    got = assign(nodes, ps_count=1, max_nodes=5)
    assert names(got) == [("a", "chief"), ("e", "ps 0"), ("c", "worker 0"), ("b", "worker 1"),
                          ("d", "worker 2")]


def test_a_kept_index_out_of_range_is_renumbered() -> None:
    nodes = [Candidate("a", Role.ANY, Task(CHIEF, 0)), Candidate("p", Role.ANY, Task(PS, 0)),
             Candidate("w", Role.ANY, Task(WORKER, 3))]
    assert names(assign(nodes, ps_count=1, max_nodes=3)) == [("a", "chief"), ("p", "ps 0"), ("w", "worker 0")]


def test_at_most_max_nodes_members() -> None:
    got = assign([Candidate(n, Role.ANY) for n in "abcdef"], ps_count=2, max_nodes=4)
    assert [node for node, _ in got] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("roles", "missing"), [
    ((Role.WORKER, Role.WORKER, Role.PS), "1 chief task"),
    ((Role.CHIEF, Role.WORKER, Role.WORKER), "1 ps task"),
    ((Role.CHIEF, Role.PS, Role.PS), "1 worker task"),
    ((Role.ANY, Role.ANY), "1 worker task"),
])
def test_roles_nobody_may_take_are_named(roles: tuple[Role, ...], missing: str) -> None:
    with pytest.raises(RolesUnfilled, match=missing) as e:
        assign([Candidate(f"n{i}", r) for i, r in enumerate(roles)], ps_count=1, max_nodes=4)
    assert "--role" in str(e.value)
