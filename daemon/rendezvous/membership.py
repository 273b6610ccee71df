"""The nodes the coordinator knows, by state, with their leases. Pure: the clock readings come in as arguments.

Nodes are added, removed and moved between states only through :class:`Membership`, which keeps the counts by
state that make a join O(1), and the earliest lease expiry: rounds of thousands of nodes must not cost
O(nodes) per message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import ItemsView, Iterator
from dataclasses import dataclass

from tfelastic.daemon.rendezvous.api import NodeInfo, NodeState, WorkerProgress


@dataclass
class Node:
    info: NodeInfo
    state: NodeState
    joined_at: float
    last_seen: float
    worker_pid: int = 0
    progress: WorkerProgress | None = None
    gpus: int = 0
    gpu_utilization: float = 0.0
    restored: bool = False  # a member a new coordinator took over from etcd, whose agent has not attached yet


class Membership:
    def __init__(self, node_timeout: float) -> None:
        self._node_timeout = node_timeout
        self._nodes: dict[str, Node] = {}
        self._counts: Counter[NodeState] = Counter()
        # The earliest lease expiry as of the last scan. Heartbeats only move leases later, so this stays a lower
        # bound without a rescan.
        self._lease_deadline = float("inf")

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def __getitem__(self, node_id: str) -> Node:
        return self._nodes[node_id]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def items(self) -> ItemsView[str, Node]:
        return self._nodes.items()

    def count(self, state: NodeState) -> int:
        return self._counts[state]

    def add(self, node_id: str, node: Node) -> None:
        self.remove(node_id)
        self._nodes[node_id] = node
        self._counts[node.state] += 1
        self._lease_deadline = min(self._lease_deadline, node.last_seen + self._node_timeout)

    def remove(self, node_id: str) -> Node | None:
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._counts[node.state] -= 1
        return node

    def set_state(self, node: Node, state: NodeState) -> None:
        self._counts[node.state] -= 1
        self._counts[state] += 1
        node.state = state

    def waiting(self) -> list[str]:
        return [n for n, node in self._nodes.items() if node.state is NodeState.WAITING]

    def next_ranks(self, previous: list[str], max_nodes: int) -> list[str]:
        """The waiting nodes in rank order for the next generation: the survivors of ``previous`` keep their
        order (a surviving chief stays chief); then nodes from the newest earlier generation in their old rank
        order (so after a coordinator restart the old chief is chief again); then the others as they joined."""
        waiting = self.waiting()
        waiting_set = set(waiting)
        survivors = [m for m in previous if m in waiting_set]
        survivor_set = set(survivors)
        newcomers = sorted((n for n in waiting if n not in survivor_set), key=self._newcomer_order)
        return (survivors + newcomers)[:max_nodes]

    def _newcomer_order(self, node_id: str) -> tuple[int, int, float, str]:
        info, joined_at = self._nodes[node_id].info, self._nodes[node_id].joined_at
        old_rank = info.last_rank if info.last_rank >= 0 else 1 << 30
        return (-info.last_generation, old_rank, joined_at, node_id)

    def any_stopping(self) -> bool:
        return self._counts[NodeState.STOPPING] + self._counts[NodeState.LEAVING] > 0

    def heard(self, node_id: str, now: float) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.last_seen = now

    def expire(self, now: float) -> list[tuple[str, Node, float]]:
        """Removes the nodes silent for longer than the node timeout: (id, node, seconds of silence) each."""
        gone = []
        for node_id, node in list(self._nodes.items()):
            silent = now - node.last_seen
            if silent > self._node_timeout:
                self.remove(node_id)
                gone.append((node_id, node, silent))
        self._lease_deadline = min((n.last_seen + self._node_timeout for n in self._nodes.values()),
                                   default=float("inf"))
        return gone

    @property
    def lease_deadline(self) -> float | None:
        return self._lease_deadline if self._nodes else None
