"""What the coordinator knows of a parameter-server job's tasks, and what it decides from them. Pure logic.

Which failure costs what (docs/parameter-server.md has the why): a failed *worker* task is relaunched alone at
its address and the job trains on (:meth:`TaskBook.replaced`); a worker's lost or leaving *node* leaves its task
vacant while at least ``min_nodes`` members and one worker remain (:meth:`TaskBook.vacate`), and a node that joins
later takes it at a scale-up's planned restart; the *chief* or a *parameter server* failing restarts the job from
the chief's checkpoint; a planned restart stops the chief first (its save reads the parameter servers); the job
ends with its chief's exit.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from tfelastic.daemon.rendezvous.api import JobSpec, Member, NodeInfo, RestartReason
from tfelastic.daemon.rendezvous.roles import WORKER, Candidate, Role, RolesUnfilled, Task, assign, task_of_rank

log = logging.getLogger("tfelastic.coordinator")


class TaskBook:
    def __init__(self) -> None:
        self.tasks: dict[str, Task] = {}  # node id -> its task in the current generation
        self.vacant: dict[str, str] = {}  # node id -> why its task has no node now
        self.replacements: Counter[str] = Counter()  # node id -> its worker replaced alone, so far
        self.held: dict[str, RestartReason] = {}  # members whose stop waits for the chief's (a planned restart)

    def arrange(self, spec: JobSpec, waiting: Iterable[tuple[str, NodeInfo]]) -> list[str]:
        """The next generation's members in rank order (chief, parameter servers, workers), from the waiting nodes
        in order of preference; raises RolesUnfilled when they cannot fill the tasks."""
        candidates = [Candidate(node_id, Role(info.role), self._last_task(node_id, info, spec.ps))
                      for node_id, info in waiting]
        assigned = assign(candidates, spec.ps, spec.max_nodes)
        self.tasks = dict(assigned)
        self.vacant.clear()
        return [node_id for node_id, _ in assigned]

    def unfilled_without(self, spec: JobSpec, left: Iterable[tuple[str, NodeInfo]]) -> str:
        """What the job could not fill with only the ``left`` nodes ("" if they fill every task): the check before
        a drain. Changes nothing."""
        try:
            assign([Candidate(node_id, Role(info.role), self._last_task(node_id, info, spec.ps))
                    for node_id, info in left], spec.ps, spec.max_nodes)
        except RolesUnfilled as e:
            return str(e)
        return ""

    def take_over(self, ranks: dict[str, int], ps_count: int) -> None:
        """A coordinator that took the job over from etcd: the tasks follow from the recorded ranks."""
        self.tasks = {node_id: task_of_rank(rank, ps_count) for node_id, rank in ranks.items()}

    def member(self, node_id: str, rank: int, info: NodeInfo) -> Member:
        task = self.tasks[node_id]
        return Member(node_id, rank, info.host, info.worker_port, task.type, task.index)

    def vacate(self, node_id: str, members: int, spec: JobSpec, why: str) -> bool:
        """A member's node is lost or left: True if its task becomes vacant and the job trains on (a worker whose
        loss keeps ``min_nodes`` members and a worker), False if the job must restart."""
        task = self.tasks.get(node_id)
        if task is None or task.type != WORKER or node_id in self.vacant:
            return False
        left = members - len(self.vacant) - 1
        workers_left = sum(1 for n, t in self.tasks.items() if t.type == WORKER and n not in self.vacant) - 1
        if left < spec.min_nodes or workers_left < 1:
            return False
        self.vacant[node_id] = why
        log.warning("%s vacant (%s): the job trains on with %d worker(s); a node that joins takes the task in a "
                    "planned restart", task, why, workers_left)
        return True

    def hold(self, node_id: str, reason: RestartReason) -> None:
        self.held[node_id] = reason

    def release(self) -> list[tuple[str, RestartReason]]:
        released, self.held = list(self.held.items()), {}
        return released

    def replaced(self, node_id: str, detail: str) -> None:
        self.replacements[node_id] += 1
        log.warning("%s on node %s replaced alone (%d so far): %s", self.tasks.get(node_id, "its task"), node_id,
                    self.replacements[node_id], detail)

    def is_worker(self, node_id: str) -> bool:
        task = self.tasks.get(node_id)
        return task is not None and task.type == WORKER

    def described(self, node_id: str) -> str:
        """Its task for status ("chief", "ps 0", "worker 1"), or ""."""
        task = self.tasks.get(node_id)
        return str(task) if task is not None else ""

    def vacancies(self) -> tuple[str, ...]:
        return tuple(f"{self.tasks[n]}: node {n} {why}" for n, why in sorted(self.vacant.items())
                     if n in self.tasks)

    def _last_task(self, node_id: str, info: NodeInfo, ps_count: int) -> Task | None:
        if node_id in self.tasks:  # a survivor of this coordinator's last generation
            return self.tasks[node_id]
        if info.last_rank >= 0 and info.last_generation > 0:  # a coordinator that restarted learns it from the Join
            return task_of_rank(info.last_rank, ps_count)
        return None
