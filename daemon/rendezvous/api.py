"""Interfaces of the rendezvous: the job spec every agent must agree on, what a generation is, the orders the
coordinator sends, and the errors it raises.

The coordinator's logic (:mod:`tfelastic.daemon.rendezvous.state`) speaks only these types; the gRPC servicer
translates them to and from ``tfelastic.v1`` messages.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from tfelastic.daemon.netutil import host_port


class JobState(enum.Enum):
    """State of the whole job, as the coordinator sees it.

    ``WAITING -> RUNNING``      a round closed and a generation was formed
    ``RUNNING -> RESTARTING``   a failure, a scale-up or a planned leave; members were told to stop
    ``RESTARTING -> WAITING``   every old member that is still connected confirmed its workers are gone
    ``RUNNING -> SUCCEEDED``    every member's trainer exited 0
    ``* -> FAILED``             restart budget exhausted, or too few nodes for ``join_timeout``
    """

    WAITING = "waiting"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


class RestartReason(enum.Enum):
    WORKER_EXIT = "worker_exit"  # a trainer exited non-zero
    NODE_LOST = "node_lost"  # an agent died or was cut off
    STALLED = "stalled"  # a trainer reported no progress for stall_timeout
    SCALE_UP = "scale_up"  # nodes joined while the world was below max_nodes
    NODE_LEFT = "node_left"  # an agent left on purpose (SIGTERM, drain)
    OPERATOR_RESTART = "operator_restart"  # an operator restarted the job (tfelastic restart)
    # A parameter-server job's worker task failed and its agent relaunched it alone: counted by reason, never a
    # restart of the job (rendezvous/ps_job.py).
    WORKER_REPLACED = "worker_replaced"

    @property
    def counts_against_budget(self) -> bool:
        """Only failures spend the restart budget; growing the job, draining a node or an operator's restart
        does not. A worker replaced alone spends its agent's own budget (agent/replacements.py)."""
        return self not in (RestartReason.SCALE_UP, RestartReason.NODE_LEFT, RestartReason.OPERATOR_RESTART,
                            RestartReason.WORKER_REPLACED)


class FailureCause(enum.Enum):
    """Why a trainer failed, from its exit status and last lines of output (daemon/worker/output.py): a fixed set,
    so that a metric labelled by it stays small."""

    OUT_OF_MEMORY = "out_of_memory"  # ResourceExhaustedError, a CUDA or host out-of-memory error
    PEER_FAILURE = "peer_failure"  # a collective or a connection to a peer failed: another worker's fault
    EXCEPTION = "exception"  # a Python exception (its type is in the detail)
    SIGNAL = "signal"  # killed by a signal (its name is in the detail)
    EXIT_CODE = "exit_code"  # a non-zero exit with no exception seen (or a serving task's exit 0)
    HANG = "hang"  # alive, and no progress for longer than its limit (where it hung is in the detail)
    LAUNCH_FAILED = "launch_failed"  # the agent could not start it
    OTHER = "other"  # a cause a newer agent sent that this version does not know


class NodeState(enum.Enum):
    """A node as the coordinator sees it."""

    WAITING = "waiting"  # in the open round, or a standby while the job is at max_nodes
    RUNNING = "running"  # a member of the current generation
    SUCCEEDED = "succeeded"  # a member whose trainer exited 0
    STOPPING = "stopping"  # a member told to stop; it has not yet confirmed its workers are gone
    LEAVING = "leaving"  # left on purpose; removed once its workers are gone and its session closed
    QUARANTINED = "quarantined"  # set aside as a bad node: connected, runs no trainer (rendezvous/quarantine.py)
    # Only in a status client's view: a state a newer coordinator sent that this version does not know. The
    # coordinator never puts a node in it.
    UNKNOWN = "unknown"


STALL_LEARNED = -1.0  # JobSpec.stall_timeout_seconds: hang detection learns its limit (daemon/worker/stall.py)
# The heartbeat and the silence that loses a node, by default: the option table's defaults (daemon/options.py),
# and what a job spec or a recorded state written without them means.
HEARTBEAT_INTERVAL_SECONDS = 0.5
NODE_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class JobSpec:
    """Settings that must be equal on every agent of a job."""

    job: str
    command_digest: bytes
    min_nodes: int
    max_nodes: int
    max_restarts: int
    restart_window_seconds: float
    stall_timeout_seconds: float
    backup_dir: str
    heartbeat_interval_seconds: float = HEARTBEAT_INTERVAL_SECONDS
    node_timeout_seconds: float = NODE_TIMEOUT_SECONDS
    strategy: str = "mirrored"  # or "parameter-server" (rendezvous/roles.py)
    ps: int = 0  # parameter servers of a parameter-server job

    @property
    def parameter_server(self) -> bool:
        return self.strategy == "parameter-server"

    def differences(self, other: JobSpec) -> list[str]:
        """Human-readable differences, naming each setting, ``other`` being the joining agent's."""
        diffs = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                if f.name == "command_digest":
                    diffs.append("the trainer command differs")
                else:
                    diffs.append(f"{f.name}: job has {mine!r}, joining agent has {theirs!r}")
        return diffs


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    host: str
    worker_port: int
    incarnation: str = ""  # the agent process's random id
    last_generation: int = 0  # the newest generation the agent took part in
    last_rank: int = -1  # its rank there
    # Steps of complete snapshots the node can restore (trainer/snapshots.py), newest first, as of this Join.
    restorable_steps: tuple[int, ...] = ()
    last_world_size: int = 0  # how many members last_generation had
    version: str = ""  # the agent's tfelastic version ("": older than the field)
    protocol: int = 0  # the protocol it speaks (0: older than the field, which is protocol 1)
    role: str = "any"  # what it is willing to be in a parameter-server job: any, chief, ps or worker
    # Those of restorable_steps in the backup dir, which every member reads (a survivors' snapshot among them).
    shared_steps: tuple[int, ...] = ()


@dataclass(frozen=True)
class Member:
    node_id: str
    rank: int
    host: str
    worker_port: int
    task_type: str = "worker"  # TF_CONFIG's task type: "worker" in a mirrored job; chief, ps or worker
    task_index: int = -1  # its index among its type's tasks; -1: the rank (a mirrored job)

    @property
    def task(self) -> tuple[str, int]:
        return self.task_type, self.rank if self.task_index < 0 else self.task_index

    @property
    def address(self) -> str:
        return host_port(self.host, self.worker_port)


@dataclass(frozen=True)
class Assignment:
    """A node's place in a generation: everything its trainer needs to join the collective."""

    generation: int
    rank: int
    world_size: int
    members: tuple[Member, ...]
    restart_count: int
    restore_step: int | None = None  # the snapshot step every member can restore; None: none in common


@dataclass(frozen=True)
class WorkerProgress:
    step: int
    examples: int = 0
    loss: float | None = None
    checkpoint_step: int = -1
    reported_at: float = 0.0  # on the coordinator's clock
    steps_per_second: float = 0.0
    checkpoint_at: float | None = None  # on the coordinator's clock
    save_seconds: float = 0.0  # this generation's saves held the trainer up this long (goodput: checkpoint)
    other_seconds: float = 0.0  # and it spent this long in evaluations (goodput: other)
    training_done: bool = False  # it reported its training complete (goodput: what follows is other)


# What an agent sends the coordinator on its session.
@dataclass(frozen=True)
class Join:
    """The first message of a session, and again after each stop: it confirms the old worker is gone."""

    node: NodeInfo
    spec: JobSpec
    restart_count: int = 0  # the restart count the agent saw, so that a restarted coordinator continues it
    attached_generation: int = 0  # the generation whose worker it still runs after losing its coordinator
    # The agent checked its node for this Join (its first, or when asked to) and listens on its worker port
    # until answered, so that the coordinator can try to reach it there; what failed, if anything.
    checked: bool = False
    check_failure: str = ""


@dataclass(frozen=True)
class Heartbeat:
    """Sent both ways every heartbeat_interval when there is nothing else to say."""


class WorkerStatus(enum.Enum):
    RUNNING = "running"  # started (its pid), or progress
    SUCCEEDED = "succeeded"  # the trainer exited 0
    FAILED = "failed"  # the trainer exited non-zero, or could not be started
    STALLED = "stalled"  # no progress for the stall timeout
    REPLACED = "replaced"  # a parameter-server job's worker task failed; its agent relaunches it alone


@dataclass(frozen=True)
class WorkerReport:
    generation: int
    status: WorkerStatus
    pid: int = 0
    exit_code: int = 0
    detail: str = ""
    progress: WorkerProgress | None = None
    gpus: int = 0  # GPUs NVML sees on the node
    gpu_utilization: float = 0.0  # their mean utilization, 0..1
    cause: FailureCause | None = None  # why a FAILED or STALLED trainer ended


@dataclass(frozen=True)
class Leave:
    reason: str


AgentMessage = Join | Heartbeat | WorkerReport | Leave


@dataclass(frozen=True)
class DrainRequest:
    """An operator's ``tfelastic drain``."""

    node_id: str
    reason: str
    force: bool = False


# Orders from the coordinator to one agent. The servicer pushes each down that agent's stream.
@dataclass(frozen=True)
class Waiting:
    joined: int
    min_nodes: int
    max_nodes: int
    detail: str


@dataclass(frozen=True)
class StopWorkers:
    generation: int
    reason: RestartReason


@dataclass(frozen=True)
class Finished:
    state: JobState
    reason: str


@dataclass(frozen=True)
class DrainNode:
    """An operator drained this node: its agent stops the worker gracefully, leaves, and exits."""

    reason: str


@dataclass(frozen=True)
class CheckNode:
    """Run the node check and join again with its result: a quarantine's cooldown ended, or an operator
    readmitted the node."""

    reason: str


@dataclass(frozen=True)
class Evict:
    """Close this node's session: it was declared lost and must join again from scratch."""

    reason: str


Order = Waiting | Assignment | StopWorkers | Finished | DrainNode | CheckNode | Evict


@dataclass(frozen=True)
class ProbeWorkerPort:
    """For the coordinator's shell: try to reach a joining node's trainer port before its Join counts (the last
    part of its node check, from this side); what failed becomes the Join's ``check_failure``."""

    node_id: str
    host: str
    port: int
    timeout: float  # the most the try may take, the wait for a free slot among other probes included
CoordinatorMessage = Order | Heartbeat  # what an agent reads off its session (an Evict closes it instead)


@dataclass(frozen=True)
class Send:
    node_id: str
    order: Order


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    rank: int
    host: str
    worker_port: int
    state: NodeState
    worker_pid: int
    progress: WorkerProgress | None
    gpus: int = 0
    gpu_utilization: float = 0.0
    quarantine_reason: str = ""  # why it is quarantined (state QUARANTINED)
    quarantined_until: float | None = None  # on the coordinator's clock; None: not quarantined
    quarantine_kind: str = ""  # "worker_failures" or "node_check"
    version: str = ""  # its agent's tfelastic version
    role: str = ""  # its task in a parameter-server job ("chief", "ps 0", "worker 1"); "" otherwise
    replacements: int = 0  # times its worker task was replaced alone (a parameter-server job)


@dataclass(frozen=True)
class CoordinatorInfo:
    """Who serves the job: an agent's node id (or a standalone coordinator's name), where, and since when."""

    node: str
    address: str
    since: float  # wall clock
    version: str = ""
    protocol: int = 0


@dataclass(frozen=True)
class GenerationSummary:
    """One generation in the job's goodput timeline (rendezvous/goodput.py)."""

    generation: int
    formed_at: float  # Unix time
    size: int  # its members
    members: tuple[str, ...]  # the first of them, in rank order
    restored_step: int | None  # where its chief resumed
    startup_seconds: float | None  # from its formation to its chief's first report
    steps_redone: int
    ended: str  # why it ended ("" while it runs)
    seconds: dict[str, float]  # by goodput category, while it was the last formed
    reached_step: int | None = None  # the furthest step its chief reported


@dataclass(frozen=True)
class TimelineMark:
    """A node's event on the job's timeline: quarantined, readmitted or drained (rendezvous/goodput.py)."""

    at: float  # Unix time
    kind: str
    node: str
    detail: str


@dataclass(frozen=True)
class GoodputView:
    """The job's goodput ledger: seconds by category to now, and its timeline (the most recent generations)."""

    seconds: dict[str, float]
    generations: tuple[GenerationSummary, ...] = ()
    steps_redone: int = 0  # of every generation, those dropped from the timeline too
    marks: tuple[TimelineMark, ...] = ()  # the most recent, oldest first


@dataclass(frozen=True)
class ClusterStatus:
    job: str
    state: JobState | None  # None: a status that carried none
    reason: str
    generation: int
    world_size: int
    min_nodes: int
    max_nodes: int
    max_restarts: int
    restarts_total: int
    restarts_by_reason: dict[str, int]
    nodes: Sequence[NodeStatus] = field(default_factory=tuple)
    warnings: tuple[str, ...] = ()  # the most recent things an operator should know (steps lost)
    steps_redone: int = 0  # steps trained again after restarts, below the furthest step reached
    steps_lost: int = 0  # of those, steps below a checkpoint the job had saved
    coordinator: CoordinatorInfo | None = None
    quarantines_by_kind: dict[str, int] = field(default_factory=dict)  # "worker_failures" or "node_check"
    goodput: GoodputView | None = None
    vacant: tuple[str, ...] = ()  # a parameter-server job's tasks without a node ("worker 1: node b lost")


@dataclass(frozen=True)
class RendezvousSettings:
    """Timing of the coordinator. Defaults favour fast recovery; every one is a documented option."""

    last_call_seconds: float = 30.0  # after min_nodes joined, how long to wait for more (first round only)
    settle_seconds: float = 3.0  # after a node joins a running job below max_nodes, wait for more
    join_timeout_seconds: float = 600.0  # how long a round may stay below min_nodes before the job fails
    node_timeout_seconds: float = NODE_TIMEOUT_SECONDS  # silence after which a node is declared lost
    restart_backoff_seconds: float = 1.0  # the wait before a generation after two failed ones in a row; doubles
    restart_backoff_max_seconds: float = 30.0  # the longest such wait
    quarantine_after: int = 2  # first failures of one node within the window that quarantine it (0: never)
    quarantine_window_seconds: float = 3600.0
    quarantine_cooldown_seconds: float = 600.0  # the first quarantine of a node; each next one doubles it
    quarantine_cooldown_max_seconds: float = 21600.0
    probe_nodes: bool = True  # try to reach each checked node's trainer port (server.py)


class RendezvousError(Exception):
    """A join or message the coordinator refuses. The message says what is wrong and how to fix it."""


class SpecMismatchError(RendezvousError):
    pass


class ProtocolVersionError(RendezvousError):
    """An agent whose protocol the coordinator does not speak."""


class DuplicateNodeError(RendezvousError):
    pass


class JobClosedError(RendezvousError):
    pass


class ProtocolError(RendezvousError):
    pass


class UnknownNodeError(RendezvousError):
    """An operator named a node that is not in the job."""


class OperatorRefusedError(RendezvousError):
    """An operator command that cannot be carried out in the job's current state."""
