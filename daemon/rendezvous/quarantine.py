"""Bad nodes set aside: which nodes are quarantined, why, until when, and the strikes that lead there. Pure: the
clock readings come in as arguments.

A node earns a strike when its worker's failure is the one that stopped a generation (the first report of a
fault; the others' reports of the same fault are its echo). ``quarantine_after`` strikes within
``quarantine_window`` quarantine it. So does a failed node check. A quarantined node's agent stays connected and
runs no trainer. Its cooldown starts at ``quarantine_cooldown`` and doubles with each quarantine of the same
node, up to ``quarantine_cooldown_max``. When the cooldown ends, the node is asked to check itself, and is
admitted again only once the check passes. An operator's readmit skips the wait (not the check) and forgets the
node's history: they fixed it.

Whether a node *may* be quarantined (at least ``min_nodes`` others left) is the rendezvous' decision; this book
only keeps the records.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from tfelastic.daemon.rendezvous.api import RendezvousSettings

log = logging.getLogger("tfelastic.coordinator")


WORKER_FAILURES = "worker_failures"
NODE_CHECK = "node_check"
QUARANTINE_KINDS = (WORKER_FAILURES, NODE_CHECK)
COOLDOWN_OVER = "the quarantine's cooldown is over"


@dataclass
class Quarantined:
    kind: str  # WORKER_FAILURES or NODE_CHECK
    reason: str
    until: float  # on the coordinator's clock
    checking: bool = False  # the cooldown is over (or an operator readmitted it): its node check was asked for
    by_operator: bool = False  # an operator readmitted it (not kept in etcd: it only words the timeline's mark)

    def notice(self, now: float) -> str:
        """What the node's agent is told while it waits."""
        if self.checking:
            return f"quarantined, waiting for its node check: {self.reason}"
        return f"quarantined for {max(0.0, self.until - now):.0f}s more: {self.reason}"


@dataclass
class _Record:
    strikes: deque[float] = field(default_factory=deque)  # times of first failures within the window
    quarantines: int = 0  # how many times it was quarantined: its next cooldown doubles this often


class QuarantineBook:
    def __init__(self, settings: RendezvousSettings) -> None:
        self._settings = settings
        self._records: dict[str, _Record] = {}
        self.held: dict[str, Quarantined] = {}
        self.by_kind: Counter[str] = Counter()  # quarantines since this coordinator started

    @property
    def enabled(self) -> bool:
        return self._settings.quarantine_after > 0

    def failed_first(self, node_id: str, detail: str, now: float, others: int, min_nodes: int) -> str:
        """The node's worker failed first (its failure stops the generation; ``others``: the nodes that could
        go on without it). Quarantines it at the ``quarantine_after``-th strike while ``min_nodes`` others
        remain. Returns a note for the restart's reason."""
        if not self.strike(node_id, now):
            return ""
        after = self._settings.quarantine_after
        if others < min_nodes:
            log.warning("node %s failed first in %d generations, but is not quarantined: only %d other node(s) "
                        "for min_nodes=%d", node_id, after, others, min_nodes)
            return ""
        reason = f"its worker failed first in {after} generations within " \
                 f"{self._settings.quarantine_window_seconds:g}s; last: {detail}"
        cooldown = self.quarantine(node_id, WORKER_FAILURES, reason, now)
        log.warning("node %s quarantined for %gs: %s", node_id, cooldown, reason)
        return f"; {node_id} quarantined for {cooldown:g}s"

    def admit(self, node_id: str, checked: bool, failure: str, now: float) -> Quarantined | None:
        """A node joins (``checked``: with a fresh node check; ``failure``: what it found). None: it may take
        part. A failed check quarantines the node whatever is left: a node known to be broken would only cost
        the job a generation."""
        if failure:
            cooldown = self.quarantine(node_id, NODE_CHECK, f"node check failed: {failure}", now)
            log.warning("node %s quarantined for %gs: its node check failed: %s", node_id, cooldown, failure)
        elif node_id not in self.held:
            return None
        elif checked and self.held[node_id].checking:
            self.release(node_id)
            log.info("node %s passed its node check after quarantine: admitted again", node_id)
            return None
        return self.held[node_id]

    def strike(self, node_id: str, now: float) -> bool:
        """The node's worker failed first; True when that makes ``quarantine_after`` strikes in the window."""
        if not self.enabled:
            return False
        strikes = self._records.setdefault(node_id, _Record()).strikes
        strikes.append(now)
        while strikes and now - strikes[0] > self._settings.quarantine_window_seconds:
            strikes.popleft()
        return len(strikes) >= self._settings.quarantine_after

    def quarantine(self, node_id: str, kind: str, reason: str, now: float) -> float:
        """Sets the node aside; returns its cooldown in seconds."""
        record = self._records.setdefault(node_id, _Record())
        record.strikes.clear()
        cooldown = self.cooldown(record.quarantines)
        record.quarantines += 1
        self.held[node_id] = Quarantined(kind, reason, now + cooldown)
        self.by_kind[kind] += 1
        return cooldown

    def cooldown(self, earlier_quarantines: int) -> float:
        s = self._settings
        return min(s.quarantine_cooldown_max_seconds,
                   s.quarantine_cooldown_seconds * (1 << min(earlier_quarantines, 32)))

    def is_held(self, node_id: str) -> bool:
        return node_id in self.held

    def due(self, now: float) -> list[str]:
        """Nodes whose cooldown is over and whose check was not asked for yet; marks them as checking."""
        ready = [n for n, q in self.held.items() if not q.checking and now >= q.until]
        for node_id in ready:
            self.held[node_id].checking = True
        return ready

    def readmit(self, node_id: str, now: float) -> None:
        """An operator lifts the quarantine: the node is checked at once, and its history is forgotten."""
        self._records.pop(node_id, None)
        held = self.held.get(node_id)
        if held is not None:
            held.checking, held.until, held.by_operator = True, now, True

    def times_quarantined(self, node_id: str) -> int:
        record = self._records.get(node_id)
        return record.quarantines if record is not None else 0

    def release(self, node_id: str) -> None:
        """The node passed its check: admitted again. Its quarantine count stays, for the next cooldown."""
        self.held.pop(node_id, None)

    def next_deadline(self) -> float | None:
        return min((q.until for q in self.held.values() if not q.checking), default=None)

    # ------------------------------------------------------------------------------------------ durability

    def export(self, wall_offset: float) -> dict[str, Any]:
        """The quarantined nodes for etcd, their ``until`` as wall-clock seconds. Strikes are not kept: a new
        coordinator starts counting them afresh."""
        return {"quarantined": {n: {"kind": q.kind, "reason": q.reason, "until": q.until + wall_offset,
                                    "checking": q.checking, "quarantines": self.times_quarantined(n)}
                                for n, q in self.held.items()}}

    def take_over(self, recorded: dict[str, dict[str, Any]], wall_offset: float, now: float) -> None:
        """No quarantine ends later than the longest cooldown from ``now``: one recorded further ahead (another
        machine's clock, a hand-edited state) would hold its node for that long."""
        latest = now + self._settings.quarantine_cooldown_max_seconds
        for node_id, entry in recorded.items():
            self.held[node_id] = Quarantined(entry["kind"], entry["reason"], min(entry["until"] - wall_offset, latest),
                                             entry["checking"])
            self._records[node_id] = _Record(quarantines=int(entry["quarantines"]))
