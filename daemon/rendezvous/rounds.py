"""How the coordinator's generations form, stop and end: the round rules, below the inputs of
:mod:`~tfelastic.daemon.rendezvous.state`. Plain code over an injected clock; each method returns the orders to send.

Invariants: a round closes at ``max_nodes``, when every connected old member is back (recovery waits for no last
call), or ``last_call_seconds`` after ``min_nodes`` joined, and never while an old member has not confirmed its
workers gone (docs/facts.md, fact 4); below ``min_nodes`` it waits at most ``join_timeout_seconds``. Surviving
members keep their relative order (a surviving chief stays chief); new nodes follow in the order they joined.
Once the chief has exited 0, training is complete: a later failure ends the job SUCCEEDED and no scale-up starts
(docs/design.md, "Completion").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tfelastic.daemon.rendezvous.api import (
    Assignment,
    ClusterSnapshot,
    FailureCause,
    Finished,
    JobSpec,
    JobState,
    Member,
    NodeState,
    Order,
    ProtocolError,
    RendezvousSettings,
    RestartReason,
    Send,
    SpecMismatchError,
    StopWorkers,
    Waiting,
)
from tfelastic.daemon.rendezvous.blame import BlameBook, record
from tfelastic.daemon.rendezvous.goodput import GoodputLedger
from tfelastic.daemon.rendezvous.membership import Membership, Node
from tfelastic.daemon.rendezvous.ps_job import TaskBook
from tfelastic.daemon.rendezvous.quarantine import QuarantineBook
from tfelastic.daemon.rendezvous.restarts import RestartBook
from tfelastic.daemon.rendezvous.restore_point import common_restore_step, log_restore_step
from tfelastic.daemon.rendezvous.roles import RolesUnfilled
from tfelastic.daemon.rendezvous.round_timers import Reformation, RoundTimers
from tfelastic.daemon.rendezvous.snapshot import cluster_snapshot

log = logging.getLogger("tfelastic.coordinator")

Clock = Callable[[], float]
# A member's trainer may still run: one that left serves until the chief has saved (parameter-server jobs).
TRAINER_MAY_RUN = (NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.LEAVING)


class RoundKeeper:
    """The job's generations and their rounds; :class:`~tfelastic.daemon.rendezvous.state.Rendezvous` feeds it."""

    def __init__(self, settings: RendezvousSettings, clock: Clock, spec: JobSpec | None = None) -> None:
        self.settings = settings
        self._clock = clock
        self.spec = spec
        self.state = JobState.WAITING
        self.reason = ""
        self._unfilled_reason = ""  # the reason while the waiting nodes could not fill a parameter-server job's tasks
        self.generation = 0
        self.nodes = Membership(settings.node_timeout_seconds)
        self._members: list[str] = []  # node ids of the current generation, in rank order
        self._ranks: dict[str, int] = {}  # the same, as node id -> rank
        self._timers = RoundTimers(settings, clock())
        self._reformation = Reformation(settings.node_timeout_seconds)  # a coordinator that starts without state
        self._chief_succeeded = False  # the chief of the current generation exited 0
        self.restore_step: int | None = None  # the snapshot step the current generation restored
        self._seen_generation = 0  # the newest generation any joining agent took part in
        self.restarts = RestartBook(settings, clock)
        self.drained: set[str] = set()  # drained by an operator (and not back since)
        self.quarantine = QuarantineBook(settings)
        self.goodput = GoodputLedger(clock)
        self.tasks = TaskBook()  # a parameter-server job's tasks (rendezvous/ps_job.py)
        self.blame = BlameBook()  # a restart a survivor's report of a peer failure caused (rendezvous/blame.py)
        self.wall_offset = 0.0  # wall clock minus this clock, for times shown to people (the host sets it)

    @property
    def restarts_total(self) -> int:
        return self.restarts.total

    def next_deadline(self) -> float | None:
        """A clock time by which :meth:`tick` must run (it may find nothing due yet), or None if no timer is
        armed. O(1) in the nodes (O(quarantined nodes) besides): the server asks after every message."""
        deadlines = [d for d in (self.nodes.lease_deadline, self.restarts.not_before,
                                 self.quarantine.next_deadline()) if d is not None]
        round_open = self.spec is not None and self.state is JobState.WAITING
        deadlines += self._timers.deadlines(round_open=round_open)
        if round_open and (reformed := self._reformation.deadline()) is not None:
            deadlines.append(reformed)
        return min(deadlines, default=None)

    # ------------------------------------------------------------------------------------------- snapshot

    def snapshot(self) -> ClusterSnapshot:
        return cluster_snapshot(self)

    def rank_of(self, node_id: str) -> int:
        """The node's rank in the running (or just succeeded) generation; -1 for any other node."""
        return self._ranks[node_id] if self._is_current_member(node_id) else -1

    @property
    def world_size(self) -> int:
        return len(self._members) if self.state in (JobState.RUNNING, JobState.SUCCEEDED) else 0

    # ------------------------------------------------------------------------------------------ internals

    def _job_name(self) -> str:
        return self.spec.job if self.spec else ""

    def _check_spec(self, spec: JobSpec) -> None:
        if self.spec is None:
            self.spec = spec
            self._timers.open(self._clock())  # the join timeout counts from the first join, not from start-up
            return
        diffs = self.spec.differences(spec)
        if diffs:
            raise SpecMismatchError(
                f"refused: this agent's job settings differ from job {self.spec.job!r} "
                f"({'; '.join(diffs)}). Every agent of a job needs the same job name, command and settings."
            )

    def _member_of(self, node_id: str, generation: int) -> Node | None:
        if generation != self.generation or not self._is_current_member(node_id):
            return None
        return self.nodes.get(node_id)

    def _is_current_member(self, node_id: str) -> bool:
        return self.state in (JobState.RUNNING, JobState.SUCCEEDED) and node_id in self._ranks

    def _after_join(self, node_id: str, now: float) -> list[Send]:
        spec = self._require_spec()
        if self.state is JobState.RUNNING:
            if self._live_members() < spec.max_nodes:
                self._timers.schedule_scale_up(now)
                detail = "scale-up pending: the job will re-form to take this node in"
            else:
                detail = f"standby: the job is at max_nodes={spec.max_nodes}"
            return [self._waiting_notice(node_id, detail)]
        sends = self._try_close_round(now)
        if not any(s.node_id == node_id for s in sends):
            sends.append(self._waiting_notice(node_id, self._round_detail(now)))
        return sends

    def _round_detail(self, now: float) -> str:
        not_before = self.restarts.not_before
        if not_before is not None and now < not_before:
            return (f"backing off after {self.restarts.failed_in_a_row} failed generations in a row: the next "
                    f"forms in {not_before - now:.1f}s")
        return "waiting for the round to close"

    def _waiting_notice(self, node_id: str, detail: str) -> Send:
        spec = self._require_spec()
        return Send(node_id, Waiting(self.nodes.count(NodeState.WAITING), spec.min_nodes, spec.max_nodes, detail))

    def _require_spec(self) -> JobSpec:
        if self.spec is None:
            raise ProtocolError("no job spec yet: the first message of a session must be a Join")
        return self.spec

    def _scale_up_due(self, now: float) -> bool:
        if not self._timers.scale_up_due(now):
            return False
        spec = self._require_spec()
        waiting = self.nodes.count(NodeState.WAITING) > 0
        return self.state is JobState.RUNNING and waiting and self._live_members() < spec.max_nodes

    def _live_members(self) -> int:
        """The current generation's members whose task has a node (a parameter-server job's vacant ones do not)."""
        return len(self._members) - len(self.tasks.vacant)

    def _vacated(self, node_id: str, why: str) -> bool:
        """A parameter-server job trains on without a lost worker's node (rendezvous/ps_job.py)."""
        spec = self._require_spec()
        return spec.parameter_server and self.tasks.vacate(node_id, len(self._members), spec, why)

    def _lost(self, node_id: str, node: Node, why: str) -> list[Send]:
        if node.state is NodeState.RUNNING and self.state is JobState.RUNNING and \
                self._vacated(node_id, f"lost ({why})"):
            return []
        if node.state is NodeState.RUNNING and self.state is JobState.RUNNING:
            return self._restart(RestartReason.NODE_LOST, f"{node_id}: {why}")
        if node.state is NodeState.SUCCEEDED and self.state is JobState.RUNNING:
            return self._restart(RestartReason.NODE_LOST, f"{node_id}: {why} before the job finished")
        if self.state is JobState.RESTARTING and node_id in self._members:
            self._blame_instead(node_id, self.generation, RestartReason.NODE_LOST, why)
        return self._try_close_round(self._clock())

    def _blame_instead(self, node_id: str, generation: int, reason: RestartReason, detail: str,
                       cause: FailureCause | None = None) -> bool:
        """The root cause of a restart that a survivor's report of a peer failure started (rendezvous/blame.py):
        the restart's record names it instead. ``cause`` None: the node was lost. False when no such restart is
        open, or ``cause`` is no root cause."""
        blame = self.blame.root_cause(generation, node_id, cause) if node_id in self._ranks else None
        if blame is None:
            return False
        text = record(reason.value, node_id, detail)
        if self.reason.startswith(blame.text):  # keep what follows: a backoff, a quarantine
            self.reason = text + self.reason[len(blame.text):]
        self.goodput.blamed_instead(blame.text, text)
        self.restarts.settled(reason.value)
        log.warning("generation %d: %s (after %s reported a peer's failure): the restart is recorded as %s's",
                    self.generation, text, blame.node_id, node_id)
        return True

    def _restart(self, reason: RestartReason, detail: str, *, peer_failure: bool = False) -> list[Send]:
        """``peer_failure``: a survivor reported it; its count by reason waits for the root cause (blame.py)."""
        if self.state is not JobState.RUNNING:
            return []  # a restart is already under way; later reports of the same fault add nothing
        if self._chief_succeeded:  # training is complete; see the module docstring
            if reason is RestartReason.SCALE_UP:
                return []
            return self._finish(JobState.SUCCEEDED, f"training completed on the chief; then {reason.value}: {detail}")
        now = self._clock()
        spec = self._require_spec()
        self.goodput.restarting(f"{reason.value}: {detail}", planned=not reason.counts_against_budget)
        if self.restarts.budget_exhausted(reason, spec):
            return self._finish(
                JobState.FAILED,
                f"restart budget exhausted: {self.restarts.failures_in_window} failures within "
                f"{spec.restart_window_seconds:g}s exceed max_restarts={spec.max_restarts}; "
                f"last: {reason.value} ({detail})",
            )
        delay = self.restarts.restarted(reason, held=peer_failure)
        self.state = JobState.RESTARTING  # RUNNING -> RESTARTING
        self.reason = f"{reason.value}: {detail}"
        if delay:
            self.reason += f"; backing off {delay:g}s before generation {self.generation + 1}"
            log.info("backing off %gs before generation %d: %d failed generations in a row", delay,
                     self.generation + 1, self.restarts.failed_in_a_row)
        self._timers.cancel_scale_up()
        sends = []
        # The chief is members[0]: told first below; the others wait in tasks.held until it has stopped.
        chief_first = spec.parameter_server and not reason.counts_against_budget
        for node_id in self._members:
            node = self.nodes.get(node_id)
            if node is None:
                continue
            if chief_first and node_id != self._members[0] and node.state in TRAINER_MAY_RUN:
                self.tasks.hold(node_id, reason)  # its variables or steps serve the chief's last save
            elif node.state in (NodeState.RUNNING, NodeState.SUCCEEDED):
                self.nodes.set_state(node, NodeState.STOPPING)  # RUNNING -> STOPPING
                sends.append(Send(node_id, StopWorkers(self.generation, reason)))
        self._timers.open(now)
        return sends + self._try_close_round(now)

    def _chief_stopping(self) -> bool:
        """The chief's node is stopping its trainer."""
        chief = self.nodes.get(self._members[0]) if self._members else None
        return chief is not None and chief.state in (NodeState.STOPPING, NodeState.LEAVING)

    def _release_held(self) -> list[Send]:
        """A parameter-server job's planned stop stops the chief first, so that it saves while the parameter
        servers it reads still serve; the others are told once the chief's trainer is gone."""
        if not self.tasks.held or self._chief_stopping():
            return []
        sends = []
        for node_id, reason in self.tasks.release():
            node = self.nodes.get(node_id)
            if node is None or node.state not in TRAINER_MAY_RUN:
                continue
            if node.state is not NodeState.LEAVING:  # a leaving one stays LEAVING until its session ends
                self.nodes.set_state(node, NodeState.STOPPING)  # RUNNING -> STOPPING, after the chief
            sends.append(Send(node_id, StopWorkers(self.generation, reason)))
        return sends

    def _try_close_round(self, now: float) -> list[Send]:
        if released := self._release_held():
            return released
        if self.spec is None or self.state not in (JobState.WAITING, JobState.RESTARTING) or self.nodes.any_stopping():
            return []
        if self.state is JobState.RESTARTING:
            self.goodput.stopped()
        self.state = JobState.WAITING  # RESTARTING -> WAITING: every old worker is confirmed gone
        spec = self._require_spec()
        waiting = self.nodes.count(NodeState.WAITING)
        if waiting < spec.min_nodes:
            if self._unfilled_reason and self.reason == self._unfilled_reason:  # it named nodes no longer here
                self.reason = self._unfilled_reason = ""
            if self._timers.below_min(now):
                held = [n for n, node in self.nodes.items() if node.state is NodeState.QUARANTINED]
                return self._finish(
                    JobState.FAILED,
                    f"only {waiting} of min_nodes={spec.min_nodes} nodes joined within "
                    f"join_timeout={self.settings.join_timeout_seconds:g}s"
                    + (f" ({len(held)} quarantined: {', '.join(sorted(held))})" if held else ""),
                )
            return []
        # After a restart no old member is still stopping (checked above): every one still here has rejoined. A
        # coordinator that starts without the job's state learns the last generation from the Joins.
        survivors_back = bool(self._members) or self._reformation.closes(now)
        last_call_over = self._timers.last_call_over(now)
        if (waiting >= spec.max_nodes or survivors_back or last_call_over) and self.restarts.may_form(now):
            return self._form_generation(now)
        return []

    def _form_generation(self, now: float) -> list[Send]:
        spec = self._require_spec()
        chosen = self.nodes.next_ranks(self._members, spec.max_nodes)
        if spec.parameter_server:
            try:
                waiting = self.nodes.next_ranks(self._members, len(self.nodes))
                chosen = self.tasks.arrange(spec, ((n, self.nodes[n].info) for n in waiting))
            except RolesUnfilled as e:  # the round stays open for a node that may take the task, up to join_timeout
                if self._timers.unfilled(now):
                    return self._finish(JobState.FAILED, f"{e}; none joined within "
                                                         f"join_timeout={self.settings.join_timeout_seconds:g}s")
                if self.reason == str(e):
                    return []
                self.reason = self._unfilled_reason = str(e)
                return [self._waiting_notice(n, self.reason) for n in self.nodes.waiting()]
        self.generation = max(self.generation, self._seen_generation) + 1
        self._close_blame()
        self.restarts.formed()
        self._reformation.done()
        self.goodput.formed(self.generation, chosen)
        self._members = chosen
        self._ranks = {node_id: rank for rank, node_id in enumerate(chosen)}
        self.state = JobState.RUNNING  # WAITING -> RUNNING
        self.reason = ""
        self._chief_succeeded = False
        members = tuple(
            self.tasks.member(n, rank, self.nodes[n].info) if spec.parameter_server else
            Member(n, rank, self.nodes[n].info.host, self.nodes[n].info.worker_port)
            for rank, n in enumerate(chosen)
        )
        self.restore_step = common_restore_step(self.nodes[n].info.restorable_steps for n in chosen)
        log_restore_step(self.generation, self.restore_step,
                         {n: max(self.nodes[n].info.restorable_steps, default=-1) for n in chosen})
        sends: list[Send] = []
        for rank, node_id in enumerate(chosen):
            node = self.nodes[node_id]
            self.nodes.set_state(node, NodeState.RUNNING)  # WAITING -> RUNNING
            node.progress = None
            node.worker_pid = 0
            order: Order = Assignment(self.generation, rank, len(chosen), members, self.restarts.total,
                                      self.restore_step)
            sends.append(Send(node_id, order))
        for node_id in self.nodes.waiting():
            sends.append(self._waiting_notice(node_id, f"standby: the job is at max_nodes={spec.max_nodes}"))
        return sends

    def _close_blame(self) -> None:
        """The last restart's record is final: a survivor's report that no root cause replaced counts as is."""
        blame = self.blame.closed()
        if blame is not None:
            self.restarts.settled(blame.reason)

    def _finish(self, state: JobState, reason: str) -> list[Send]:
        self._close_blame()
        self.state = state  # RUNNING -> SUCCEEDED, * -> FAILED
        self.reason = reason
        self.goodput.finished(f"{state.value}: {reason}")
        return [Send(node_id, Finished(state, reason)) for node_id in self.nodes]
