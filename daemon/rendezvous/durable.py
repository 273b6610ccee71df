"""The job's state that outlives its coordinator: what a new coordinator must know to take over the running
generation without restarting it. Written to etcd on every change of state (never per heartbeat) and read by the
next leader. Pure: JSON in and out.

Times cross machines, so they are stored as wall-clock seconds (the budget's failure times); the coordinator
turns them into readings of its own monotonic clock.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from tfelastic.daemon.rendezvous.api import JobSpec, JobState, Member
from tfelastic.daemon.rendezvous.durable_check import VERSION, state_fields


@dataclass(frozen=True)
class DurableState:
    spec: JobSpec | None
    state: JobState
    reason: str
    generation: int
    members: tuple[Member, ...]  # the current (or last) generation, in rank order
    restarts_total: int = 0
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    failures: tuple[float, ...] = ()  # wall-clock times of the failures inside the budget's window
    failed_in_a_row: int = 0
    chief_succeeded: bool = False
    drained: tuple[str, ...] = ()
    reached_step: int = -1
    checkpoint_step: int = -1
    steps_redone: int = 0
    steps_lost: int = 0
    warnings: tuple[str, ...] = ()
    quarantined: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> kind, reason, until, count
    goodput: dict[str, Any] | None = None  # the goodput ledger (rendezvous/goodput.py), times as wall-clock

    def to_json(self) -> bytes:
        doc: dict[str, Any] = dataclasses.asdict(self)
        doc["version"] = VERSION
        doc["state"] = self.state.value
        if self.spec is not None:
            doc["spec"]["command_digest"] = self.spec.command_digest.hex()
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DurableState:
        """Raises ValueError for anything that is not a state this version wrote: BadField (durable_check.py),
        naming the first field whose type or range is wrong, when it is JSON."""
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as e:  # RecursionError: nested arrays too deep for the parser
            raise ValueError(f"not JSON: {type(e).__name__}: {str(e)[:200]}") from None
        return cls(**state_fields(doc))


@dataclass(frozen=True)
class Takeover:
    """What a coordinator that wins an election continues: the recorded state, and members that need not be
    waited for as long as the others (the previous leader's own node, when its lease ran out)."""

    recorded: DurableState
    graces: dict[str, float] = field(default_factory=dict)  # node id -> grace, instead of node_timeout


class StoreUnavailable(Exception):
    """The durable store did not answer (etcd unreachable, or without quorum): the write is retried."""


class Deposed(Exception):
    """Another coordinator leads the job now: this one's writes are refused (its fencing token is stale)."""


class JobStore(Protocol):
    """Where a coordinator keeps the job's state: on etcd, `Leadership` (daemon/etcd/election.py)."""

    async def save(self, state: DurableState) -> None:
        """Raises StoreUnavailable or Deposed."""
