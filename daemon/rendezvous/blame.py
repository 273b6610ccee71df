"""Whose failure a restart is recorded as, when the first report is a survivor's: a peer's failure seen by a
worker whose collective was aborted under it. Pure.

A mirrored job's workers all fail when one dies: TensorFlow aborts the survivors' collectives at once ("Collective
ops is aborted by: ... Connection reset by peer", docs/facts.md, fact 3), so a survivor's report can reach the
coordinator before the dead worker's, and always does when the dead worker's whole node is lost (its loss is
known only after the node timeout). The restart is not delayed for it: the first report of a failure stops the
generation, whoever's it is. But while the set stops, the root cause (another member's death by a signal, out
of memory, a hang, a failed launch, or its node's loss) replaces the survivor's in the restart's record: its
reason, the ledger's line, the count by reason (held until the record is final) and the quarantine strike, which a
peer's failure never earns.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfelastic.daemon.rendezvous.api import FailureCause

# A member's failure that is its own for sure. An exception or an exit code may be a survivor's echo that the agent
# did not recognise as a peer's failure (an NCCL error, an agent of 0.3.0 that sends no cause): never a root cause.
ROOT_CAUSES = frozenset({FailureCause.SIGNAL, FailureCause.OUT_OF_MEMORY, FailureCause.HANG,
                         FailureCause.LAUNCH_FAILED})


@dataclass(frozen=True)
class PeerBlame:
    """A restart recorded, for now, as a survivor's report of a peer's failure."""

    generation: int
    node_id: str  # the survivor
    reason: str  # the restart's reason (a RestartReason's value)
    detail: str  # its report's detail

    @property
    def text(self) -> str:
        """The restart's record, as the coordinator wrote it: "worker_exit: a: trainer saw a peer fail ..."."""
        return record(self.reason, self.node_id, self.detail)


def record(reason: str, node_id: str, detail: str) -> str:
    """A restart's record: its reason, the node whose failure it is, and what that node said."""
    return f"{reason}: {node_id}: {detail}"


class BlameBook:
    """The restart, if any, that a peer's failure caused and whose root cause is still to come."""

    def __init__(self) -> None:
        self._open: PeerBlame | None = None

    def peer_failure_restarted(self, blame: PeerBlame) -> None:
        self._open = blame

    def root_cause(self, generation: int, node_id: str, cause: FailureCause | None) -> PeerBlame | None:
        """Another member of the same generation failed on its own (``cause`` among :data:`ROOT_CAUSES`; None: its
        node was lost), the record it replaces (now closed); None when there is none to replace."""
        blame = self._open
        if blame is None or blame.generation != generation or blame.node_id == node_id or \
                (cause is not None and cause not in ROOT_CAUSES):
            return None
        self._open = None
        return blame

    def closed(self) -> PeerBlame | None:
        """A new generation formed (or the job ended): the last restart's record is final. Returns the one that
        stayed open, if any."""
        blame, self._open = self._open, None
        return blame
