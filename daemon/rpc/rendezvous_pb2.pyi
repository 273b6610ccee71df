from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATUS_UNSPECIFIED: _ClassVar[WorkerStatus]
    WORKER_STATUS_RUNNING: _ClassVar[WorkerStatus]
    WORKER_STATUS_SUCCEEDED: _ClassVar[WorkerStatus]
    WORKER_STATUS_FAILED: _ClassVar[WorkerStatus]
    WORKER_STATUS_STALLED: _ClassVar[WorkerStatus]
    WORKER_STATUS_REPLACED: _ClassVar[WorkerStatus]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_WAITING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RESTARTING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
WORKER_STATUS_UNSPECIFIED: WorkerStatus
WORKER_STATUS_RUNNING: WorkerStatus
WORKER_STATUS_SUCCEEDED: WorkerStatus
WORKER_STATUS_FAILED: WorkerStatus
WORKER_STATUS_STALLED: WorkerStatus
WORKER_STATUS_REPLACED: WorkerStatus
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_WAITING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RESTARTING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState

class JobSpec(_message.Message):
    __slots__ = ("job", "command_digest", "min_nodes", "max_nodes", "max_restarts", "restart_window_seconds", "stall_timeout_seconds", "backup_dir", "heartbeat_interval_seconds", "node_timeout_seconds", "strategy", "ps")
    JOB_FIELD_NUMBER: _ClassVar[int]
    COMMAND_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTART_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_DIR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PS_FIELD_NUMBER: _ClassVar[int]
    job: str
    command_digest: bytes
    min_nodes: int
    max_nodes: int
    max_restarts: int
    restart_window_seconds: float
    stall_timeout_seconds: float
    backup_dir: str
    heartbeat_interval_seconds: float
    node_timeout_seconds: float
    strategy: str
    ps: int
    def __init__(self, job: _Optional[str] = ..., command_digest: _Optional[bytes] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., max_restarts: _Optional[int] = ..., restart_window_seconds: _Optional[float] = ..., stall_timeout_seconds: _Optional[float] = ..., backup_dir: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., node_timeout_seconds: _Optional[float] = ..., strategy: _Optional[str] = ..., ps: _Optional[int] = ...) -> None: ...

class Join(_message.Message):
    __slots__ = ("node_id", "spec", "host", "worker_port", "last_generation", "restart_count", "incarnation", "last_rank", "attached_generation", "checked", "check_failure", "restorable_steps", "last_world_size", "version", "protocol", "role", "shared_steps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_PORT_FIELD_NUMBER: _ClassVar[int]
    LAST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    CHECK_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SHARED_STEPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    spec: JobSpec
    host: str
    worker_port: int
    last_generation: int
    restart_count: int
    incarnation: str
    last_rank: int
    attached_generation: int
    checked: bool
    check_failure: str
    restorable_steps: _containers.RepeatedScalarFieldContainer[int]
    last_world_size: int
    version: str
    protocol: int
    role: str
    shared_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., host: _Optional[str] = ..., worker_port: _Optional[int] = ..., last_generation: _Optional[int] = ..., restart_count: _Optional[int] = ..., incarnation: _Optional[str] = ..., last_rank: _Optional[int] = ..., attached_generation: _Optional[int] = ..., checked: bool = ..., check_failure: _Optional[str] = ..., restorable_steps: _Optional[_Iterable[int]] = ..., last_world_size: _Optional[int] = ..., version: _Optional[str] = ..., protocol: _Optional[int] = ..., role: _Optional[str] = ..., shared_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "loss", "has_loss", "examples", "age_seconds", "checkpoint_step", "steps_per_second", "checkpoint_age_seconds", "save_seconds", "other_seconds", "training_done")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OTHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_DONE_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    has_loss: bool
    examples: int
    age_seconds: float
    checkpoint_step: int
    steps_per_second: float
    checkpoint_age_seconds: float
    save_seconds: float
    other_seconds: float
    training_done: bool
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., has_loss: bool = ..., examples: _Optional[int] = ..., age_seconds: _Optional[float] = ..., checkpoint_step: _Optional[int] = ..., steps_per_second: _Optional[float] = ..., checkpoint_age_seconds: _Optional[float] = ..., save_seconds: _Optional[float] = ..., other_seconds: _Optional[float] = ..., training_done: bool = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("generation", "status", "exit_code", "pid", "progress", "has_progress", "detail", "gpus", "gpu_utilization", "cause")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    status: WorkerStatus
    exit_code: int
    pid: int
    progress: Progress
    has_progress: bool
    detail: str
    gpus: int
    gpu_utilization: float
    cause: str
    def __init__(self, generation: _Optional[int] = ..., status: _Optional[_Union[WorkerStatus, str]] = ..., exit_code: _Optional[int] = ..., pid: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., has_progress: bool = ..., detail: _Optional[str] = ..., gpus: _Optional[int] = ..., gpu_utilization: _Optional[float] = ..., cause: _Optional[str] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("join", "heartbeat", "report", "leave")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    join: Join
    heartbeat: Heartbeat
    report: WorkerReport
    leave: Leave
    def __init__(self, join: _Optional[_Union[Join, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("node_id", "rank", "host", "worker_port", "task_type", "task_index")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_PORT_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    TASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    rank: int
    host: str
    worker_port: int
    task_type: str
    task_index: int
    def __init__(self, node_id: _Optional[str] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., worker_port: _Optional[int] = ..., task_type: _Optional[str] = ..., task_index: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "members", "restart_count", "restore_step", "has_restore_step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    restart_count: int
    restore_step: int
    has_restore_step: bool
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., restart_count: _Optional[int] = ..., restore_step: _Optional[int] = ..., has_restore_step: bool = ...) -> None: ...

class StopWorkers(_message.Message):
    __slots__ = ("generation", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class JobFinished(_message.Message):
    __slots__ = ("state", "reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    reason: str
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Waiting(_message.Message):
    __slots__ = ("joined", "min_nodes", "max_nodes", "detail")
    JOINED_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    joined: int
    min_nodes: int
    max_nodes: int
    detail: str
    def __init__(self, joined: _Optional[int] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class DrainNode(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CheckNode(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("heartbeat", "waiting", "assignment", "stop", "finished", "drain", "check")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    waiting: Waiting
    assignment: Assignment
    stop: StopWorkers
    finished: JobFinished
    drain: DrainNode
    check: CheckNode
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., waiting: _Optional[_Union[Waiting, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., stop: _Optional[_Union[StopWorkers, _Mapping]] = ..., finished: _Optional[_Union[JobFinished, _Mapping]] = ..., drain: _Optional[_Union[DrainNode, _Mapping]] = ..., check: _Optional[_Union[CheckNode, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "rank", "host", "worker_port", "state", "worker_pid", "progress", "has_progress", "gpus", "gpu_utilization", "quarantine_reason", "quarantine_seconds_left", "quarantine_kind", "version", "role", "replacements")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_PORT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    rank: int
    host: str
    worker_port: int
    state: str
    worker_pid: int
    progress: Progress
    has_progress: bool
    gpus: int
    gpu_utilization: float
    quarantine_reason: str
    quarantine_seconds_left: float
    quarantine_kind: str
    version: str
    role: str
    replacements: int
    def __init__(self, node_id: _Optional[str] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., worker_port: _Optional[int] = ..., state: _Optional[str] = ..., worker_pid: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., has_progress: bool = ..., gpus: _Optional[int] = ..., gpu_utilization: _Optional[float] = ..., quarantine_reason: _Optional[str] = ..., quarantine_seconds_left: _Optional[float] = ..., quarantine_kind: _Optional[str] = ..., version: _Optional[str] = ..., role: _Optional[str] = ..., replacements: _Optional[int] = ...) -> None: ...

class RestartCount(_message.Message):
    __slots__ = ("reason", "count")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    count: int
    def __init__(self, reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("job", "state", "reason", "generation", "world_size", "min_nodes", "max_nodes", "restarts_total", "restarts_by_reason", "max_restarts", "nodes", "warnings", "steps_redone", "steps_lost", "coordinator", "quarantines", "goodput", "vacant")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    STEPS_REDONE_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    QUARANTINES_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    VACANT_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: JobState
    reason: str
    generation: int
    world_size: int
    min_nodes: int
    max_nodes: int
    restarts_total: int
    restarts_by_reason: _containers.RepeatedCompositeFieldContainer[RestartCount]
    max_restarts: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    steps_redone: int
    steps_lost: int
    coordinator: CoordinatorInfo
    quarantines: _containers.RepeatedCompositeFieldContainer[QuarantineCount]
    goodput: Goodput
    vacant: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., restarts_total: _Optional[int] = ..., restarts_by_reason: _Optional[_Iterable[_Union[RestartCount, _Mapping]]] = ..., max_restarts: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ..., steps_redone: _Optional[int] = ..., steps_lost: _Optional[int] = ..., coordinator: _Optional[_Union[CoordinatorInfo, _Mapping]] = ..., quarantines: _Optional[_Iterable[_Union[QuarantineCount, _Mapping]]] = ..., goodput: _Optional[_Union[Goodput, _Mapping]] = ..., vacant: _Optional[_Iterable[str]] = ...) -> None: ...

class CategorySeconds(_message.Message):
    __slots__ = ("category", "seconds")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    category: str
    seconds: float
    def __init__(self, category: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerationLine(_message.Message):
    __slots__ = ("generation", "formed_at", "size", "members", "restored_step", "has_restored_step", "startup_seconds", "has_startup_seconds", "steps_redone", "ended", "seconds", "reached_step", "has_reached_step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FORMED_AT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    STARTUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_STARTUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_REDONE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REACHED_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_REACHED_STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    formed_at: float
    size: int
    members: _containers.RepeatedScalarFieldContainer[str]
    restored_step: int
    has_restored_step: bool
    startup_seconds: float
    has_startup_seconds: bool
    steps_redone: int
    ended: str
    seconds: _containers.RepeatedCompositeFieldContainer[CategorySeconds]
    reached_step: int
    has_reached_step: bool
    def __init__(self, generation: _Optional[int] = ..., formed_at: _Optional[float] = ..., size: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., restored_step: _Optional[int] = ..., has_restored_step: bool = ..., startup_seconds: _Optional[float] = ..., has_startup_seconds: bool = ..., steps_redone: _Optional[int] = ..., ended: _Optional[str] = ..., seconds: _Optional[_Iterable[_Union[CategorySeconds, _Mapping]]] = ..., reached_step: _Optional[int] = ..., has_reached_step: bool = ...) -> None: ...

class TimelineMark(_message.Message):
    __slots__ = ("at", "kind", "node", "detail")
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    at: float
    kind: str
    node: str
    detail: str
    def __init__(self, at: _Optional[float] = ..., kind: _Optional[str] = ..., node: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class Goodput(_message.Message):
    __slots__ = ("seconds", "generations", "steps_redone", "marks")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_REDONE_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    seconds: _containers.RepeatedCompositeFieldContainer[CategorySeconds]
    generations: _containers.RepeatedCompositeFieldContainer[GenerationLine]
    steps_redone: int
    marks: _containers.RepeatedCompositeFieldContainer[TimelineMark]
    def __init__(self, seconds: _Optional[_Iterable[_Union[CategorySeconds, _Mapping]]] = ..., generations: _Optional[_Iterable[_Union[GenerationLine, _Mapping]]] = ..., steps_redone: _Optional[int] = ..., marks: _Optional[_Iterable[_Union[TimelineMark, _Mapping]]] = ...) -> None: ...

class QuarantineCount(_message.Message):
    __slots__ = ("kind", "count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    count: int
    def __init__(self, kind: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class CoordinatorInfo(_message.Message):
    __slots__ = ("node", "address", "since", "version", "protocol")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    since: float
    version: str
    protocol: int
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., since: _Optional[float] = ..., version: _Optional[str] = ..., protocol: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id", "reason", "force")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    force: bool
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ..., force: bool = ...) -> None: ...

class RestartJobRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ReadmitRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class OperatorReply(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: str
    def __init__(self, detail: _Optional[str] = ...) -> None: ...
