"""Roles of a parameter-server job: who is chief, who holds the variables, who computes. Pure logic.

A ``parameter-server`` job (``--strategy parameter-server --ps N``) runs TensorFlow's ParameterServerStrategy: one
*chief* runs the training loop and dispatches steps, N *parameter servers* hold the variables, and the other
members are *workers* that only serve. Members are in rank order ``chief, ps 0..N-1, worker 0..W-1``, so a task
is known from its rank and N alone (:func:`task_of_rank`): a coordinator that restarts without the job's state
finds each node's last task from the rank its Join carries.

Each node says what it is willing to be (``--role``); :func:`assign` fills the tasks from the nodes of a round,
keeping every node's last task where it can (a replaced worker's address stays the one the chief knows, and the
parameter servers stay on the hosts an operator placed them on).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

CHIEF, PS, WORKER = "chief", "ps", "worker"  # TF_CONFIG's task types


class Strategy(enum.Enum):
    MIRRORED = "mirrored"  # MultiWorkerMirroredStrategy: every member a worker; any failure restarts all
    PARAMETER_SERVER = "parameter-server"  # ParameterServerStrategy: see the module docstring


class Role(enum.Enum):
    """What a node is willing to be in a parameter-server job."""

    ANY = "any"
    CHIEF = "chief"
    PS = "ps"
    WORKER = "worker"

    def may_be(self, task_type: str) -> bool:
        return self is Role.ANY or self.value == task_type


@dataclass(frozen=True)
class Task:
    type: str  # CHIEF, PS or WORKER
    index: int

    def __str__(self) -> str:
        return f"{self.type} {self.index}" if self.type != CHIEF else CHIEF

    @classmethod
    def parse(cls, described: str) -> Task | None:
        """The inverse of str(): "chief", "ps 0", "worker 1"; None for anything else ("" outside a job)."""
        kind, _, index = described.partition(" ")
        if kind == CHIEF and not index:
            return cls(CHIEF, 0)
        if kind in (PS, WORKER) and index.isdigit():
            return cls(kind, int(index))
        return None


def task_of_rank(rank: int, ps_count: int) -> Task:
    """The task of a member of a parameter-server job from its rank (see the module docstring)."""
    if rank == 0:
        return Task(CHIEF, 0)
    if rank <= ps_count:
        return Task(PS, rank - 1)
    return Task(WORKER, rank - 1 - ps_count)


def rank_of_task(task: Task, ps_count: int) -> int:
    if task.type == CHIEF:
        return 0
    return 1 + task.index if task.type == PS else 1 + ps_count + task.index


@dataclass(frozen=True)
class Candidate:
    node_id: str
    willing: Role
    last_task: Task | None = None  # its task in the last generation it took part in


class RolesUnfilled(Exception):
    """The nodes of a round cannot fill the job's tasks; the message names the task and why."""


def assign(candidates: Sequence[Candidate], ps_count: int, max_nodes: int) -> list[tuple[str, Task]]:
    """The members of the next generation in rank order, each with its task; ``candidates`` in the order of
    preference (survivors first). At most ``max_nodes`` members; raises :class:`RolesUnfilled` when no chief, too
    few parameter servers or no worker can be found among them."""
    free = list(candidates)
    chief = _take(free, CHIEF, 1)
    if not chief:
        raise RolesUnfilled(_missing(candidates, CHIEF, 1, 0))
    servers = _take(free, PS, ps_count)
    if len(servers) < ps_count:
        raise RolesUnfilled(_missing(candidates, PS, ps_count, len(servers)))
    workers = _take(free, WORKER, max_nodes - 1 - ps_count)
    if not workers:
        raise RolesUnfilled(_missing(candidates, WORKER, 1, 0))
    return [(chief[0].node_id, Task(CHIEF, 0)), *_indexed(servers, PS), *_indexed(workers, WORKER)]


def _take(free: list[Candidate], task_type: str, count: int) -> list[Candidate]:
    """Up to ``count`` candidates for ``task_type``, removed from ``free``: those that had this task first, then
    those that asked for it, then those that take any task (each group in the given order)."""
    able = [c for c in free if c.willing.may_be(task_type)]
    had = [c for c in able if c.last_task is not None and c.last_task.type == task_type]
    asked = [c for c in able if c not in had and c.willing is not Role.ANY]
    taken = (had + asked + [c for c in able if c not in had and c not in asked])[:max(count, 0)]
    for c in taken:
        free.remove(c)
    return taken


def _indexed(chosen: list[Candidate], task_type: str) -> list[tuple[str, Task]]:
    """Task indices 0..len-1: each keeps its last index of this type where it is in range and not taken twice;
    the others fill the free indices in order."""
    size = len(chosen)
    kept: dict[int, Candidate] = {}
    for c in chosen:
        last = c.last_task
        if last is not None and last.type == task_type and last.index < size and last.index not in kept:
            kept[last.index] = c
    rest = iter(c for c in chosen if c not in kept.values())
    return [(kept[i].node_id if i in kept else next(rest).node_id, Task(task_type, i)) for i in range(size)]


def _missing(candidates: Sequence[Candidate], task_type: str, needed: int, found: int) -> str:
    willing = sorted({c.willing.value for c in candidates})
    return (f"the job needs {needed} {task_type} task{'s' if needed > 1 else ''} and only {found} of the "
            f"{len(candidates)} waiting nodes may take one (their --role: {', '.join(willing) or 'none'}); start a "
            f"node with --role {task_type} or --role any")
