"""The coordinator's logic: what nodes and operators tell it (joins, reports, leaves, silence, drains, restarts)
and its durable state, over the rounds of :mod:`~tfelastic.daemon.rendezvous.rounds`, which it holds.

Plain code over an injected monotonic clock, with no sockets and no threads: every input is a method call that
returns the orders to send, and :meth:`Rendezvous.tick` fires the timers. The gRPC servicer is a thin adapter
that calls these methods from one event loop.
"""

from __future__ import annotations

import logging

from tfelastic.daemon import version
from tfelastic.daemon.rendezvous.api import (
    CheckNode,
    ClusterStatus,
    DrainNode,
    DuplicateNodeError,
    Evict,
    FailureCause,
    Finished,
    JobClosedError,
    JobSpec,
    JobState,
    Join,
    Member,
    NodeInfo,
    NodeState,
    OperatorRefusedError,
    ProbeWorkerPort,
    ProtocolError,
    ProtocolVersionError,
    RendezvousSettings,
    RestartReason,
    Send,
    StopWorkers,
    UnknownNodeError,
    WorkerProgress,
    WorkerReport,
    WorkerStatus,
)
from tfelastic.daemon.rendezvous.blame import PeerBlame
from tfelastic.daemon.rendezvous.cluster_status import cluster_status
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.goodput import ChiefReport
from tfelastic.daemon.rendezvous.membership import Node
from tfelastic.daemon.rendezvous.quarantine import COOLDOWN_OVER, QuarantineBook
from tfelastic.daemon.rendezvous.rounds import Clock, JobBooks, Rounds

log = logging.getLogger("tfelastic.coordinator")

__all__ = ["Clock", "Rendezvous"]

RESTART_ABSORB_SECONDS = 10.0  # an operator's restart this soon after another is absorbed into it
PROBE_SECONDS = 3.0  # the most the coordinator tries to reach a checked node's trainer port


class Rendezvous:
    """The coordinator's core: its inputs, over its :class:`~tfelastic.daemon.rendezvous.rounds.Rounds` and the
    books they share (:class:`~tfelastic.daemon.rendezvous.rounds.JobBooks`), with the quarantine and the drains,
    which only the inputs keep."""

    def __init__(self, settings: RendezvousSettings, clock: Clock, spec: JobSpec | None = None) -> None:
        self.settings = settings
        self._clock = clock
        books = JobBooks.new(settings, clock)
        self.nodes, self.restarts, self.tasks, self.goodput, self.blame = \
            books.nodes, books.restarts, books.tasks, books.goodput, books.blame
        self.rounds = Rounds(settings, clock, books, spec)
        self.quarantine = QuarantineBook(settings)
        self.drained: set[str] = set()  # drained by an operator (and not back since)
        self.wall_offset = 0.0  # wall clock minus this clock, for times shown to people (the host sets it)
        self._operator_restart: tuple[float, int, str] | None = None  # when, from which generation, why

    # ------------------------------------------------------------------------------------------ the view

    @property
    def state(self) -> JobState:
        return self.rounds.state

    @property
    def reason(self) -> str:
        return self.rounds.reason

    @property
    def generation(self) -> int:
        return self.rounds.generation

    @property
    def spec(self) -> JobSpec | None:
        return self.rounds.spec

    @property
    def restore_step(self) -> int | None:
        return self.rounds.restore_step

    @property
    def restarts_total(self) -> int:
        return self.restarts.total

    @property
    def world_size(self) -> int:
        return self.rounds.world_size

    def rank_of(self, node_id: str) -> int:
        return self.rounds.rank_of(node_id)

    def status(self) -> ClusterStatus:
        return cluster_status(self)

    def next_deadline(self) -> float | None:
        """A clock time by which :meth:`tick` must run (it may find nothing due yet), or None if no timer is
        armed. O(1) in the nodes (O(quarantined nodes) besides): the server asks after every message."""
        deadlines = [d for d in (self.nodes.lease_deadline, self.restarts.not_before,
                                 self.quarantine.next_deadline()) if d is not None]
        return min(deadlines + self.rounds.deadlines(), default=None)

    # ----------------------------------------------------------------------------------------------- inputs

    def probe_for(self, join: Join) -> ProbeWorkerPort | None:
        """Whether to try to reach a joining node's trainer port before its Join counts: a checked Join that passed
        the agent's own checks, of a job that would take it (the others are refused, or set aside already,
        without a connection made on their behalf).

        The session waits for the probe, so it must end well before either side's liveness timeout: the agent
        hears nothing on a session whose Join is unanswered, and fences after node_timeout - heartbeat."""
        if not (join.checked and not join.check_failure and self.settings.probe_nodes) or self.state.is_terminal:
            return None
        spec = join.spec
        if self.spec is not None and self.spec.differences(spec):
            return None
        timeout = min(PROBE_SECONDS, (spec.node_timeout_seconds - spec.heartbeat_interval_seconds) / 2)
        node = join.node
        return ProbeWorkerPort(node.node_id, node.host, node.worker_port, timeout)

    def join(self, info: NodeInfo, spec: JobSpec, *, restart_count: int = 0, rejoin: bool = False,
             attached_generation: int = 0, checked: bool = False, check_failure: str = "") -> list[Send]:
        """A node enters the rendezvous.

        ``rejoin`` marks a Join on a session that is already registered: the agent sends it after it confirmed
        that every process of its previous worker is gone, so it doubles as that confirmation.
        ``attached_generation``: the agent still runs a worker of that generation (it lost its coordinator, and
        etcd said its generation was current): a coordinator that took the job over keeps it running.
        ``checked``: the agent ran its node check for this Join; ``check_failure``: what failed (quarantined).
        """
        _check_protocol(info)
        if self.state.is_terminal:
            if rejoin:  # a member that confirmed its stop after the verdict: tell it again
                return [Send(info.node_id, Finished(self.state, self.reason))]
            raise JobClosedError(f"job {self.rounds.job_name()!r} has already {self.state.value}: {self.reason}")
        self.rounds.check_spec(spec)
        lost = [] if rejoin else self._reconnected(info)
        if self.state.is_terminal:  # its old session's loss ended the job
            return [*lost, Send(info.node_id, Finished(self.state, self.reason))]
        now = self._clock()
        existing = self.nodes.get(info.node_id)
        if attached_generation and not rejoin:
            return lost + self._attach(info, existing, attached_generation, now)
        if existing is not None and existing.restored and not rejoin:  # it comes back without its worker
            self.nodes.remove(info.node_id)
            lost += self.rounds.lost(info.node_id, existing, "its worker did not survive the coordinator's failover")
            existing = None
        if existing is not None and not rejoin:
            raise _duplicate(info.node_id)
        if existing is not None and existing.state in (NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.LEAVING):
            raise ProtocolError(f"node {info.node_id!r} joined again while {existing.state.value}")
        self.rounds.joined(info, now)
        self.restarts.continue_from(restart_count)
        self.nodes.add(info.node_id, Node(info, NodeState.WAITING, now, now))
        self.drained.discard(info.node_id)
        held = self._admission(info.node_id, checked, check_failure, now)
        return lost + (held if held is not None else self.rounds.after_join(info.node_id, now))

    def _reconnected(self, info: NodeInfo) -> list[Send]:
        """A Join on a new session from the same agent process as a member's (its incarnation): it gave up on its
        old stream before the coordinator noticed. That counts as the node lost and found again; the shell closes
        the old session. Another process with the node's id is a duplicate, refused below; a member restored from
        etcd has no session here, and is handled below."""
        member = self.nodes.get(info.node_id)
        if member is None or member.restored or not info.incarnation or member.info.incarnation != info.incarnation:
            return []
        log.info("node %s reconnected on a new session", info.node_id)
        return self.disconnect(info.node_id)

    def _admission(self, node_id: str, checked: bool, failure: str, now: float) -> list[Send] | None:
        """None: the joining node may take part. Otherwise it is (now, or still) quarantined: the orders."""
        was = self.quarantine.held.get(node_id)
        held = self.quarantine.admit(node_id, checked, failure, now)
        if held is None:
            if was is not None:  # one mark per readmission, when it happens
                self.goodput.marked("readmitted", node_id, "an operator readmitted it; it passed its node check"
                                    if was.by_operator else "it passed its node check")
            return None
        if failure:
            self.goodput.marked("quarantined", node_id, held.reason)
        self.nodes.set_state(self.nodes[node_id], NodeState.QUARANTINED)  # WAITING -> QUARANTINED
        sends = [self.rounds.waiting_notice(node_id, held.notice(now))]
        if held.checking and not failure:  # it was asked to check, and joined without: ask again
            sends.append(Send(node_id, CheckNode(COOLDOWN_OVER)))
        return sends + self.rounds.close_round(now)

    def _attach(self, info: NodeInfo, member: Node | None, generation: int, now: float) -> list[Send]:
        """A Join from an agent whose worker of ``generation`` still runs. A member of the running generation is
        taken in as it is: no restart. Any other worker is stale: stopped, and its Join after the stop counts."""
        if member is not None and member.restored and member.state is NodeState.RUNNING and \
                generation == self.generation and self.state is JobState.RUNNING:
            self.nodes.add(info.node_id, Node(info, NodeState.RUNNING, member.joined_at, now, member.worker_pid,
                                              member.progress))
            return []
        if member is not None and not member.restored:
            raise _duplicate(info.node_id)
        sends = []
        if member is not None:
            self.nodes.remove(info.node_id)
            sends = self.rounds.lost(info.node_id, member, "its worker is not of the running generation")
        self.nodes.add(info.node_id, Node(info, NodeState.STOPPING, now, now))  # ... -> STOPPING, until it rejoins
        return [*sends, Send(info.node_id, StopWorkers(generation, RestartReason.NODE_LOST))]

    # ------------------------------------------------------------------------------------------ durability

    def durable(self, wall_offset: float) -> DurableState:
        """What a coordinator that takes over must know (``wall_offset``: wall clock minus this clock)."""
        members = tuple(Member(n, rank, self.nodes[n].info.host, self.nodes[n].info.worker_port)
                        for rank, n in enumerate(self.rounds.members) if n in self.nodes)
        return DurableState(self.spec, self.state, self.reason, self.generation, members,
                            chief_succeeded=self.rounds.chief_succeeded, drained=tuple(sorted(self.drained)),
                            goodput=self.goodput.export(wall_offset),
                            **self.restarts.export(wall_offset), **self.quarantine.export(wall_offset))

    def take_over(self, recorded: DurableState, wall_offset: float, grace: float,
                  graces: dict[str, float] | None = None) -> None:
        """Continue the job etcd recorded. A running generation goes on: its members have ``grace`` (or their
        own in ``graces``) plus the node timeout to attach before they count as lost."""
        now = self._clock()
        self.rounds.take_over(recorded, now)
        self.drained = set(recorded.drained)
        self.restarts.take_over(recorded, wall_offset)
        self.quarantine.take_over(recorded.quarantined, wall_offset, now)
        if recorded.goodput is not None:
            self.goodput.take_over(recorded.goodput, wall_offset)
        if self.state is JobState.RUNNING:
            for m in recorded.members:
                wait = (graces or {}).get(m.node_id, grace)
                self.nodes.add(m.node_id, Node(NodeInfo(m.node_id, m.host, m.worker_port), NodeState.RUNNING, now,
                                               now + wait, restored=True))

    def heartbeat(self, node_id: str) -> None:
        self.nodes.heard(node_id, self._clock())

    def worker_started(self, node_id: str, generation: int, pid: int) -> None:
        node = self.rounds.member_of(node_id, generation)
        if node is not None:
            node.worker_pid = pid

    def progress(self, node_id: str, generation: int, progress: WorkerProgress) -> None:
        rank = self.rounds.listed_rank(node_id)
        if self.state is JobState.RESTARTING and generation == self.generation and rank is not None:
            # Its last steps before the stop: the furthest step the next generation's redone steps count from.
            self.restarts.resumes.reached(progress.step, progress.checkpoint_step)
            if rank == 0:
                self.goodput.reached(ChiefReport.of(progress))
            return
        node = self.rounds.member_of(node_id, generation)
        if node is not None:
            node.progress = progress
            self.restarts.progress(generation, progress.step, progress.checkpoint_step)
            if rank == 0 and self.state is JobState.RUNNING:
                self.goodput.reported(ChiefReport.of(progress))

    def node_gpus(self, node_id: str, gpus: int, utilization: float) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.gpus, node.gpu_utilization = gpus, utilization

    def report(self, node_id: str, report: WorkerReport) -> list[Send]:
        """What a member's agent says about its worker: its pid, GPUs and progress, and how it ended."""
        generation = report.generation
        if report.pid:
            self.worker_started(node_id, generation, report.pid)
        self.node_gpus(node_id, report.gpus, min(max(report.gpu_utilization, 0.0), 1.0))
        if report.progress is not None:
            self.progress(node_id, generation, report.progress)
        if report.status is WorkerStatus.SUCCEEDED:
            return self.worker_succeeded(node_id, generation)
        if report.status is WorkerStatus.FAILED:
            detail = report.detail or f"trainer exited with code {report.exit_code}"
            return self.worker_failed(node_id, generation, RestartReason.WORKER_EXIT, detail, report.cause)
        if report.status is WorkerStatus.STALLED:
            return self.worker_failed(node_id, generation, RestartReason.STALLED, report.detail or "stalled",
                                      report.cause)
        if report.status is WorkerStatus.REPLACED and self.rounds.member_of(node_id, generation) is not None:
            self.tasks.replaced(node_id, report.detail)  # the job trains on: nothing to send
            self.restarts.by_reason[RestartReason.WORKER_REPLACED.value] += 1
        return []

    def worker_succeeded(self, node_id: str, generation: int) -> list[Send]:
        is_chief = self.rounds.is_chief(node_id)
        if self.state is JobState.RESTARTING and generation == self.generation and is_chief:
            return self.rounds.finish(JobState.SUCCEEDED,
                                f"the chief of generation {generation} completed training while the set stopped")
        node = self.rounds.member_of(node_id, generation)
        if node is None or node.state is not NodeState.RUNNING:
            return []
        self.nodes.set_state(node, NodeState.SUCCEEDED)  # RUNNING -> SUCCEEDED
        if is_chief:
            self.rounds.chief_done()
        if is_chief and self.rounds.require_spec().parameter_server:  # its tasks serve until told to stop
            return self.rounds.finish(JobState.SUCCEEDED, f"the chief of generation {generation} completed training")
        if self.nodes.count(NodeState.SUCCEEDED) == len(self.rounds.members):
            return self.rounds.finish(JobState.SUCCEEDED, f"every trainer of generation {generation} exited 0")
        return []

    def worker_failed(self, node_id: str, generation: int, reason: RestartReason, detail: str,
                      cause: FailureCause | None = None) -> list[Send]:
        """A member's trainer exited non-zero or stalled. Stale reports (older generations) are ignored. A
        survivor's report of a peer's failure stops the generation like any other, but the restart is recorded as
        the root cause's when that comes while the set stops (rendezvous/blame.py)."""
        peer = cause is FailureCause.PEER_FAILURE
        if self.state is JobState.RESTARTING and cause is not None and \
                self.rounds.blame_instead(node_id, generation, reason, detail, cause):
            self._strike(node_id, detail)
            return []
        if self.rounds.member_of(node_id, generation) is None:
            return []
        first = self.state is JobState.RUNNING  # its failure is the one that stops the generation
        sends = self.rounds.restart(reason, f"{node_id}: {detail}", peer_failure=peer)
        if first and not self.state.is_terminal:  # not when it ended the job (budget spent, chief done)
            if peer:  # not this node's fault: no strike, and the root cause may still come
                self.blame.peer_failure_restarted(PeerBlame(generation, node_id, reason.value, detail))
            else:
                self._strike(node_id, detail)
        return sends

    def _strike(self, node_id: str, detail: str) -> None:
        """The node's worker failed first: a strike towards its quarantine (rendezvous/quarantine.py)."""
        others = sum(1 for n, node in self.nodes.items()
                     if n != node_id and node.state is not NodeState.LEAVING and not self.quarantine.is_held(n))
        min_nodes = self.rounds.require_spec().min_nodes
        note = self.quarantine.failed_first(node_id, detail, self._clock(), others, min_nodes)
        if note:
            self.goodput.marked("quarantined", node_id, self.quarantine.held[node_id].reason)
        self.rounds.note(note)

    def readmit(self, node_id: str) -> list[Send]:
        """An operator lifts a quarantine: the node checks itself at once and, if the check passes, joins."""
        if not self.quarantine.is_held(node_id):
            held = ", ".join(sorted(self.quarantine.held)) or "none"
            raise OperatorRefusedError(f"node {node_id!r} is not quarantined (quarantined nodes: {held})")
        self.quarantine.readmit(node_id, self._clock())  # marked on the timeline once its check passes
        log.info("operator readmits node %s", node_id)
        return [Send(node_id, CheckNode("readmitted by an operator"))] if node_id in self.nodes else []

    def leave(self, node_id: str, reason: str) -> list[Send]:
        """A planned leave: the job re-forms without the node at once, and it is not counted as a failure."""
        node = self.nodes.get(node_id)
        if node is None:
            return []
        if node.state in (NodeState.WAITING, NodeState.QUARANTINED):  # no worker to wait for: gone at once
            self.nodes.remove(node_id)
            return self.rounds.close_round(self._clock())
        was_member = node.state in (NodeState.RUNNING, NodeState.SUCCEEDED) and \
            self.rounds.listed_rank(node_id) is not None
        self.nodes.set_state(node, NodeState.LEAVING)  # RUNNING|SUCCEEDED|STOPPING -> LEAVING
        if was_member and self.state is JobState.RUNNING and self.rounds.vacated(node_id, f"left ({reason})"):
            # The chief trains on without it: its agent, which serves until told (agent/worker_core.py), stops now.
            return [Send(node_id, StopWorkers(self.generation, RestartReason.NODE_LEFT))]
        if was_member and self.state is JobState.RUNNING:
            return self.rounds.restart(RestartReason.NODE_LEFT, f"{node_id}: {reason}")
        return self.rounds.close_round(self._clock())

    def disconnect(self, node_id: str) -> list[Send]:
        """The node's session ended. Without a Leave before it, the node is lost."""
        node = self.nodes.remove(node_id)
        if node is None:
            return []
        if node.state is NodeState.LEAVING:
            return self.rounds.close_round(self._clock())
        return self.rounds.lost(node_id, node, "its session closed")

    def drain(self, node_id: str, reason: str, *, force: bool = False) -> list[Send]:
        """An operator's planned removal of a node: tell its agent to leave. The job re-forms when the agent's
        Leave arrives (see :meth:`leave`), after its trainer has checkpointed and stopped.

        Refused when fewer than ``min_nodes`` would remain, unless ``force``: the job would then wait up to
        ``join_timeout`` for a replacement, which an operator should choose knowingly.
        """
        if self.state.is_terminal:
            raise JobClosedError(f"job {self.rounds.job_name()!r} has already {self.state.value}: nothing to drain")
        node = self.nodes.get(node_id)
        if node is None:
            known = ", ".join(sorted(self.nodes)) or "none"
            raise UnknownNodeError(f"node {node_id!r} is not in job {self.rounds.job_name()!r} (nodes: {known})")
        if node.state is NodeState.LEAVING:
            return []
        spec = self.rounds.require_spec()
        remaining = len(self.nodes) - self.nodes.count(NodeState.LEAVING) - self.nodes.count(NodeState.QUARANTINED) \
            - 1
        # Draining a node that is set aside takes away nothing the job has.
        if remaining < spec.min_nodes and not force and node.state is not NodeState.QUARANTINED:
            raise OperatorRefusedError(
                f"draining {node_id!r} would leave {remaining} node(s), below min_nodes={spec.min_nodes}: the job "
                f"would wait up to join_timeout={self.settings.join_timeout_seconds:g}s for another node. Start "
                "a node first, or drain with --force")
        unfilled = self._unfilled_without(node_id) if spec.parameter_server and not force else ""
        if unfilled:
            raise OperatorRefusedError(
                f"draining {node_id!r} would leave a task nobody can take: {unfilled}. The job would wait up to "
                f"join_timeout={self.settings.join_timeout_seconds:g}s, then fail; start that node first, or "
                "drain with --force")
        self.drained.add(node_id)
        self.goodput.marked("drained", node_id, reason)
        return [Send(node_id, DrainNode(reason))]

    def _unfilled_without(self, node_id: str) -> str:
        """The parameter-server job's task that the nodes other than ``node_id`` (and those leaving or set aside)
        could not fill; "" if none."""
        left = ((n, node.info) for n, node in self.nodes.items()
                if n != node_id and node.state not in (NodeState.LEAVING, NodeState.QUARANTINED))
        return self.tasks.unfilled_without(self.rounds.require_spec(), left)

    def restart_job(self, reason: str) -> tuple[list[Send], str]:
        """An operator's restart: every member stops its trainer gracefully and the same nodes re-form.
        Planned, so it does not spend the restart budget. Returns the orders and what to tell the operator.

        A restart asked for while an operator's restart is under way, or within RESTART_ABSORB_SECONDS of one, is
        absorbed into it: two terminals, or a command retried after a timeout, restart the job once."""
        now = self._clock()
        absorbed = self._absorbed_restart(now)
        if absorbed is not None:
            return [], absorbed
        if self.state is not JobState.RUNNING:
            raise OperatorRefusedError(
                f"job {self.rounds.job_name()!r} is {self.state.value}"
                + (f" ({self.reason})" if self.reason else "") + ": only a running job can be restarted")
        generation = self.generation
        sends = self.rounds.restart(RestartReason.OPERATOR_RESTART, reason)
        if self.state.is_terminal:  # the chief had completed training: nothing restarts
            return sends, f"job {self.rounds.job_name()} ended instead: {self.reason}"
        self._operator_restart = (now, generation, reason)
        return sends, (f"restarting job {self.rounds.job_name()} from generation {generation}: every trainer "
                       "checkpoints and stops, and the same nodes re-form")

    def _absorbed_restart(self, now: float) -> str | None:
        """What to tell an operator whose restart joins the last one; None when it does not."""
        if self._operator_restart is None or self.state.is_terminal:
            return None
        asked_at, generation, reason = self._operator_restart
        under_way = self.generation == generation and self.state is not JobState.RUNNING
        if not under_way and now - asked_at >= RESTART_ABSORB_SECONDS:
            return None
        since = (f"absorbed into the restart of job {self.rounds.job_name()} from generation {generation} that an "
                 f"operator asked for {now - asked_at:.1f}s ago ({reason})")
        if under_way:
            return f"{since}, still under way: no second restart"
        return (f"{since}; generation {self.generation} runs now: no second restart (ask again after "
                f"{RESTART_ABSORB_SECONDS:g}s for another)")

    def tick(self) -> list[Send]:
        """Fire due timers: node leases, the last call, the scale-up settle delay, the join timeout."""
        now = self._clock()
        sends: list[Send] = []
        for node_id, node, silent in self.nodes.expire(now):
            sends.append(Send(node_id, Evict(f"no message for {silent:.1f}s")))
            sends += self.rounds.lost(node_id, node, f"silent for {silent:.1f}s")
        sends += [Send(n, CheckNode(COOLDOWN_OVER))
                  for n in self.quarantine.due(now) if n in self.nodes]
        if self.rounds.scale_up_due(now):
            waiting = self.nodes.count(NodeState.WAITING)
            sends += self.rounds.restart(RestartReason.SCALE_UP, f"{waiting} node(s) waiting to join")
        sends += self.rounds.close_round(now)
        return sends



def _check_protocol(info: NodeInfo) -> None:
    if not version.speaks(info.protocol):
        raise ProtocolVersionError(
            f"refused: node {info.node_id!r} runs tfelastic {info.version or '(older than 0.2.0)'} (protocol "
            f"{version.protocol_of(info.protocol)}); this coordinator runs {version.describe()}, which speaks "
            f"protocols {version.OLDEST_PROTOCOL}-{version.PROTOCOL}: upgrade every node to one release "
            "(docs/operations.md, Upgrades)")


def _duplicate(node_id: str) -> DuplicateNodeError:
    return DuplicateNodeError(f"node id {node_id!r} is already in the job (another agent process); "
                              "give each node a unique --node-id")
