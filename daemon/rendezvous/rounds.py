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
from dataclasses import dataclass

from tfelastic.daemon.rendezvous.api import (
    Assignment,
    FailureCause,
    Finished,
    JobSpec,
    JobState,
    Member,
    NodeInfo,
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
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.goodput import GoodputLedger
from tfelastic.daemon.rendezvous.membership import Membership, Node
from tfelastic.daemon.rendezvous.ps_job import TaskBook
from tfelastic.daemon.rendezvous.restarts import RestartBook
from tfelastic.daemon.rendezvous.restore_point import common_restore_step, log_restore_step
from tfelastic.daemon.rendezvous.roles import RolesUnfilled
from tfelastic.daemon.rendezvous.round_timers import Reformation, RoundTimers

log = logging.getLogger("tfelastic.coordinator")

Clock = Callable[[], float]
# A member's trainer may still run: one that left serves until the chief has saved (parameter-server jobs).
TRAINER_MAY_RUN = (NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.LEAVING)


@dataclass(frozen=True)
class JobBooks:
    """What the coordinator records about the job besides its rounds, kept by both the rounds and the inputs of
    :class:`~tfelastic.daemon.rendezvous.state.Rendezvous`: one object each, shared."""

    nodes: Membership
    restarts: RestartBook
    tasks: TaskBook  # a parameter-server job's tasks (rendezvous/ps_job.py)
    goodput: GoodputLedger
    blame: BlameBook  # a restart a survivor's report of a peer failure caused (rendezvous/blame.py)

    @classmethod
    def new(cls, settings: RendezvousSettings, clock: Clock) -> JobBooks:
        return cls(Membership(settings.node_timeout_seconds), RestartBook(settings, clock), TaskBook(),
                   GoodputLedger(clock), BlameBook())


class Rounds:
    """The job's generations and their rounds: which nodes are members, in what rank, and the job's state and
    verdict. :class:`~tfelastic.daemon.rendezvous.state.Rendezvous` holds one and feeds it."""

    def __init__(self, settings: RendezvousSettings, clock: Clock, books: JobBooks,
                 spec: JobSpec | None = None) -> None:
        self.settings = settings
        self._clock = clock
        self.nodes, self.restarts, self.tasks = books.nodes, books.restarts, books.tasks
        self.goodput, self.blame = books.goodput, books.blame
        self.spec = spec
        self.state = JobState.WAITING
        self.reason = ""
        self._unfilled_reason = ""  # the reason while the waiting nodes could not fill a parameter-server job's tasks
        self.generation = 0
        self._members: list[str] = []  # node ids of the current generation, in rank order
        self._ranks: dict[str, int] = {}  # the same, as node id -> rank
        self._timers = RoundTimers(settings, clock())
        self._reformation = Reformation(settings.node_timeout_seconds)  # a coordinator that starts without state
        self._chief_succeeded = False  # the chief of the current generation exited 0
        self.restore_step: int | None = None  # the snapshot step the current generation restored
        self._seen_generation = 0  # the newest generation any joining agent took part in

    def deadlines(self) -> list[float]:
        """The rounds' armed timers (clock times); see Rendezvous.next_deadline."""
        round_open = self.spec is not None and self.state is JobState.WAITING
        deadlines = self._timers.deadlines(round_open=round_open)
        if round_open and (reformed := self._reformation.deadline()) is not None:
            deadlines.append(reformed)
        return deadlines

    # ------------------------------------------------------------------------------------------- the members

    @property
    def members(self) -> tuple[str, ...]:
        """The newest generation's node ids in rank order (kept while it stops, until the next one forms)."""
        return tuple(self._members)

    def rank_of(self, node_id: str) -> int:
        """The node's rank in the running (or just succeeded) generation; -1 for any other node."""
        return self._ranks[node_id] if self._is_current_member(node_id) else -1

    def listed_rank(self, node_id: str) -> int | None:
        """The node's rank in the newest generation, running or stopping; None if it is not one of its members."""
        return self._ranks.get(node_id)

    def is_chief(self, node_id: str) -> bool:
        return bool(self._members) and self._members[0] == node_id

    @property
    def world_size(self) -> int:
        return len(self._members) if self.state in (JobState.RUNNING, JobState.SUCCEEDED) else 0

    @property
    def chief_succeeded(self) -> bool:
        """The chief of the current generation exited 0: training is complete (see the module docstring)."""
        return self._chief_succeeded

    # ------------------------------------------------------------------------------ what the inputs report

    def joined(self, info: NodeInfo, now: float) -> None:
        """A node joins: a coordinator that was restarted continues the numbering (only a new round may change the
        generation), and one that starts without the job's state learns the last generation from the Joins."""
        self._seen_generation = max(self._seen_generation, info.last_generation)
        if not self._members:
            self._reformation.joined(info.last_generation, info.last_rank, info.last_world_size, now)

    def chief_done(self) -> None:
        """The current generation's chief exited 0."""
        self._chief_succeeded = True

    def note(self, text: str) -> None:
        """Append to the reason shown (a quarantine that followed the failure)."""
        self.reason += text

    def take_over(self, recorded: DurableState, now: float) -> None:
        """Continue the rounds etcd recorded: the generation, its members and the job's state."""
        self.spec, self.reason, self.generation = recorded.spec, recorded.reason, recorded.generation
        self._seen_generation = recorded.generation
        self._members = [m.node_id for m in recorded.members]
        self._ranks = {m.node_id: m.rank for m in recorded.members}
        self._chief_succeeded = recorded.chief_succeeded
        if recorded.spec is not None and recorded.spec.parameter_server:
            self.tasks.take_over(self._ranks, recorded.spec.ps)
        self.state = JobState.WAITING if recorded.state is JobState.RESTARTING else recorded.state
        self._timers.open(now)

    # ----------------------------------------------------------------------------------------- the rules

    def job_name(self) -> str:
        return self.spec.job if self.spec else ""

    def check_spec(self, spec: JobSpec) -> None:
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

    def member_of(self, node_id: str, generation: int) -> Node | None:
        if generation != self.generation or not self._is_current_member(node_id):
            return None
        return self.nodes.get(node_id)

    def _is_current_member(self, node_id: str) -> bool:
        return self.state in (JobState.RUNNING, JobState.SUCCEEDED) and node_id in self._ranks

    def after_join(self, node_id: str, now: float) -> list[Send]:
        spec = self.require_spec()
        if self.state is JobState.RUNNING:
            if self._live_members() < spec.max_nodes:
                self._timers.schedule_scale_up(now)
                detail = "scale-up pending: the job will re-form to take this node in"
            else:
                detail = f"standby: the job is at max_nodes={spec.max_nodes}"
            return [self.waiting_notice(node_id, detail)]
        sends = self.close_round(now)
        if not any(s.node_id == node_id for s in sends):
            sends.append(self.waiting_notice(node_id, self._round_detail(now)))
        return sends

    def _round_detail(self, now: float) -> str:
        not_before = self.restarts.not_before
        if not_before is not None and now < not_before:
            return (f"backing off after {self.restarts.failed_in_a_row} failed generations in a row: the next "
                    f"forms in {not_before - now:.1f}s")
        return "waiting for the round to close"

    def waiting_notice(self, node_id: str, detail: str) -> Send:
        spec = self.require_spec()
        return Send(node_id, Waiting(self.nodes.count(NodeState.WAITING), spec.min_nodes, spec.max_nodes, detail))

    def require_spec(self) -> JobSpec:
        if self.spec is None:
            raise ProtocolError("no job spec yet: the first message of a session must be a Join")
        return self.spec

    def scale_up_due(self, now: float) -> bool:
        if not self._timers.scale_up_due(now):
            return False
        spec = self.require_spec()
        waiting = self.nodes.count(NodeState.WAITING) > 0
        return self.state is JobState.RUNNING and waiting and self._live_members() < spec.max_nodes

    def _live_members(self) -> int:
        """The current generation's members whose task has a node (a parameter-server job's vacant ones do not)."""
        return len(self._members) - len(self.tasks.vacant)

    def vacated(self, node_id: str, why: str) -> bool:
        """A parameter-server job trains on without a lost worker's node (rendezvous/ps_job.py)."""
        spec = self.require_spec()
        return spec.parameter_server and self.tasks.vacate(node_id, len(self._members), spec, why)

    def lost(self, node_id: str, node: Node, why: str) -> list[Send]:
        if node.state is NodeState.RUNNING and self.state is JobState.RUNNING and \
                self.vacated(node_id, f"lost ({why})"):
            return []
        if node.state is NodeState.RUNNING and self.state is JobState.RUNNING:
            return self.restart(RestartReason.NODE_LOST, f"{node_id}: {why}")
        if node.state is NodeState.SUCCEEDED and self.state is JobState.RUNNING:
            return self.restart(RestartReason.NODE_LOST, f"{node_id}: {why} before the job finished")
        if self.state is JobState.RESTARTING and node_id in self._members:
            self.blame_instead(node_id, self.generation, RestartReason.NODE_LOST, why)
        return self.close_round(self._clock())

    def blame_instead(self, node_id: str, generation: int, reason: RestartReason, detail: str,
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

    def restart(self, reason: RestartReason, detail: str, *, peer_failure: bool = False) -> list[Send]:
        """``peer_failure``: a survivor reported it; its count by reason waits for the root cause (blame.py)."""
        if self.state is not JobState.RUNNING:
            return []  # a restart is already under way; later reports of the same fault add nothing
        if self._chief_succeeded:  # training is complete; see the module docstring
            if reason is RestartReason.SCALE_UP:
                return []
            return self.finish(JobState.SUCCEEDED, f"training completed on the chief; then {reason.value}: {detail}")
        now = self._clock()
        spec = self.require_spec()
        self.goodput.restarting(f"{reason.value}: {detail}", planned=not reason.counts_against_budget)
        if self.restarts.budget_exhausted(reason, spec):
            return self.finish(
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
        return sends + self.close_round(now)

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

    def close_round(self, now: float) -> list[Send]:
        if released := self._release_held():
            return released
        if self.spec is None or self.state not in (JobState.WAITING, JobState.RESTARTING) or self.nodes.any_stopping():
            return []
        if self.state is JobState.RESTARTING:
            self.goodput.stopped()
        self.state = JobState.WAITING  # RESTARTING -> WAITING: every old worker is confirmed gone
        spec = self.require_spec()
        waiting = self.nodes.count(NodeState.WAITING)
        if waiting < spec.min_nodes:
            if self._unfilled_reason and self.reason == self._unfilled_reason:  # it named nodes no longer here
                self.reason = self._unfilled_reason = ""
            if self._timers.below_min(now):
                held = [n for n, node in self.nodes.items() if node.state is NodeState.QUARANTINED]
                return self.finish(
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
        spec = self.require_spec()
        chosen = self.nodes.next_ranks(self._members, spec.max_nodes)
        if spec.parameter_server:
            try:
                waiting = self.nodes.next_ranks(self._members, len(self.nodes))
                chosen = self.tasks.arrange(spec, ((n, self.nodes[n].info) for n in waiting))
            except RolesUnfilled as e:  # the round stays open for a node that may take the task, up to join_timeout
                if self._timers.unfilled(now):
                    return self.finish(JobState.FAILED, f"{e}; none joined within "
                                                         f"join_timeout={self.settings.join_timeout_seconds:g}s")
                if self.reason == str(e):
                    return []
                self.reason = self._unfilled_reason = str(e)
                return [self.waiting_notice(n, self.reason) for n in self.nodes.waiting()]
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
        self.restore_step = common_restore_step((self.nodes[n].info.restorable_steps for n in chosen),
                                                [s for n in chosen for s in self.nodes[n].info.shared_steps])
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
            sends.append(self.waiting_notice(node_id, f"standby: the job is at max_nodes={spec.max_nodes}"))
        return sends

    def _close_blame(self) -> None:
        """The last restart's record is final: a survivor's report that no root cause replaced counts as is."""
        blame = self.blame.closed()
        if blame is not None:
            self.restarts.settled(blame.reason)

    def finish(self, state: JobState, reason: str) -> list[Send]:
        self._close_blame()
        self.state = state  # RUNNING -> SUCCEEDED, * -> FAILED
        self.reason = reason
        self.goodput.finished(f"{state.value}: {reason}")
        return [Send(node_id, Finished(state, reason)) for node_id in self.nodes]
