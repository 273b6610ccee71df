"""The agent's contracts: what its core is built with, the actions it decides and the shell carries out, what the
shell tells the core back about a stopped worker, and the agent's errors.

The core (:mod:`tfelastic.daemon.agent.core`) is pure: each of its inputs returns a list of these actions, and
the asyncio shell (:mod:`tfelastic.daemon.agent.agent`) performs them in order. A *preparation* (a node check
before a session, a scan of the snapshots, a wait for GPU memory or a port) is awaited, and answered, before the
next action of its list: the order "stop, wait for the GPUs, wait for the port, then rejoin or relaunch" is the
core's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tfelastic.daemon.agent.replacements import ReplacementPolicy
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.worker.stall import StallLimits


@dataclass(frozen=True)
class Identity:
    """What this agent says about itself in every Join."""

    node_id: str
    host: str  # where peers reach its trainer
    spec: api.JobSpec
    incarnation: str  # random per agent process: a reconnect replaces its stale session
    worker_port: int = 0  # 0: a free port, picked anew for every Join
    role: str = "any"  # the task it may take in a parameter-server job (--role)


@dataclass(frozen=True)
class Timing:
    heartbeat_interval: float
    node_timeout: float
    join_timeout: float
    stall: StallLimits
    stop_grace: float


@dataclass(frozen=True)
class WorkerPolicy:
    """How this node runs its worker, beyond its timings."""

    standby_at_launch: bool = False  # the node has cores to spare: the next standby is built at each launch
    replacement: ReplacementPolicy = field(default_factory=ReplacementPolicy.defaults)  # a parameter-server job's


@dataclass(frozen=True)
class Connection:
    """How this agent reaches its coordinator."""

    coordinator: str  # the rendezvous endpoint, for messages
    tls: bool = False
    failover: bool = False  # etcd: a lost coordinator may be failing over; the worker runs on (agent/failover.py)


@dataclass(frozen=True)
class Leaving:
    reason: str  # sent in the Leave
    drained: bool  # an operator drained this node (else one of the agent's LEAVE_SIGNALS)
    # A parameter server's or worker's task serves on until the coordinator orders its stop (after the chief's),
    # or until this monotonic time: the chief's last save reads the variables and runs the steps it scheduled.
    serve_until: float | None = None


@dataclass
class AgentEnd:
    """How this agent's part in the job ends, once that is known: the session's side of the core sets it, the
    worker's side reads it (a worker stopped now is not relaunched or rejoined)."""

    exit_code: ExitCode | None = None  # the job's verdict or a refusal: the agent exits with it
    leaving: Leaving | None = None  # a drain or a signal to stop

    @property
    def winding_down(self) -> bool:
        """The job is over for this agent, or it is leaving: a session that ends now ends as planned."""
        return self.exit_code is not None or self.leaving is not None


@dataclass(frozen=True)
class Send:
    """Queue a message on the current session."""

    message: api.AgentMessage


@dataclass(frozen=True)
class Launch:
    """Start the worker of this assignment. The shell answers with ``worker_started`` or ``launch_failed``, and
    later ``worker_exited``."""

    assignment: api.Assignment


@dataclass(frozen=True)
class Stop:
    """Stop the worker (SIGTERM, ``stop_grace`` if planned else ``failure_stop_grace``, SIGKILL of the tree). The
    shell answers with ``worker_stopped`` once every process is gone. ``hold``: seconds to wait first, without a
    signal, for the trainer to meet its peer's failure itself and save the step it holds (the survivors' save); a
    SIGTERM would start a graceful stop whose agreement waits for the peer that is gone."""

    reason: str
    planned: bool
    hold: float = 0.0
    notify: int = 0  # with a hold: the trainer's pid, told at once that a peer failed (trainer/peer_failure.py)


@dataclass(frozen=True)
class RestorableSteps:
    """The snapshot steps this node can restore, newest first (its local tier and the backup dir), and those of
    them in the backup dir, which every member reads (ScanSnapshots)."""

    steps: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExtendStop:
    """A peer failed and the trainer saves the step it holds (the survivors' save): the stop under way, or the
    next one, SIGKILLs the tree no sooner than ``within`` seconds from now, rather than after its failure grace.
    The trainer announces its exit once the save is durable (EndStopSoon)."""

    within: float


@dataclass(frozen=True)
class EndStopSoon:
    """The trainer announced its exit code with its state saved: end the stop under way ``within`` seconds from
    now (SIGKILL of the tree) if its processes have not ended by then, rather than wait out the stop's grace. What
    it still does then is teardown (the input pipeline's, the interpreter's), which can take a minute."""

    within: float


@dataclass(frozen=True)
class HangUp:
    """Close the sending side of the session: nothing more to say (the job ended, or the agent left)."""


@dataclass(frozen=True)
class DropSession:
    """Give up on the session at once: the coordinator is silent, so this node fences itself."""

    reason: str


@dataclass(frozen=True)
class Announce:
    """Tell the service manager what the agent does (systemd's STATUS=); ``ready``: READY=1."""

    status: str
    ready: bool = False


@dataclass(frozen=True)
class RunNodeCheck:
    """Check this node (agent/nodecheck.py) off the loop; the shell answers with ``node_checked``."""

    reason: str


@dataclass(frozen=True)
class ListenForProbe:
    """Listen on the worker port until the coordinator answers the checked Join, so that it can try to reach this
    node there (the shell stops listening before it handles the answer). The shell answers with
    ``probe_listening``, which returns the Join."""

    port: int


@dataclass(frozen=True)
class PrepareStandby:
    """Build a standby interpreter for launches like this assignment's (worker/warm.py)."""

    assignment: api.Assignment


@dataclass(frozen=True)
class ProbeServer:
    """Ask the worker task's gRPC server on this port for an answer (agent/replacements.py); the shell answers
    with ``server_probed``."""

    generation: int
    address: str  # host:port of the task's server


@dataclass(frozen=True)
class DumpStacks:
    """Ask the running trainer, found hung, for its Python stacks (worker/stacks.py); the shell answers with
    ``stacks_dumped``. ``pid``: the process that reported its progress (0: not known)."""

    generation: int
    pid: int = 0


@dataclass(frozen=True)
class StopRetrying:
    """The agent is leaving: end the wait between attempts to reach the coordinator now."""


@dataclass(frozen=True)
class CoordinatorLost:
    """A session that had opened broke: the coordinator it reached may be gone, so where it is is looked up anew
    (with etcd, its key may linger a lease TTL and no longer names a known coordinator: agent/placement.py)."""


@dataclass(frozen=True)
class ScanSnapshots:
    """A preparation: read the snapshot steps this node can restore (agent/snapshot_scan.py); the shell answers
    with ``node_read(restorable=...)`` before it carries out the next action."""


@dataclass(frozen=True)
class WaitGpusReleased:
    """A preparation: wait (bounded) until NVML lists none of these processes, a stopped worker's, on the trainer's
    GPUs (a trainer started into memory a killed one still holds fails with out-of-memory); the shell answers with
    ``gpus_released``."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class WaitPortFree:
    """A preparation: wait (bounded) until the old trainer lets go of a port the next one binds again."""

    port: int


@dataclass(frozen=True)
class ObserveEtcd:
    """A preparation between sessions, with etcd: read the job's recorded generation and how long its coordinator
    has been known, waiting at most ``within`` seconds; the shell answers with ``etcd_observed``."""

    within: float


@dataclass(frozen=True)
class ExitAgent:
    """Between sessions: stop trying the coordinator; the agent exits with ``code``."""

    code: ExitCode


@dataclass(frozen=True)
class RetryAfter:
    """Between sessions: try the coordinator again after ``seconds`` (sooner if the agent leaves or etcd names
    another coordinator)."""

    seconds: float


@dataclass(frozen=True)
class RemoveLocalTier:
    """A preparation of the exit: the job succeeded, nothing will resume from this node's local snapshots."""


@dataclass(frozen=True)
class HostUntilJobEnds:
    """A preparation of the exit: this drained node hosts the coordinator, which the other nodes still need; serve
    it until the job ends or a signal to stop."""


@dataclass(frozen=True)
class KeepMetricsUp:
    """A preparation of the exit: /metrics stays up for ``metrics_linger`` (after the hosted coordinator's agents
    hung up), so that Prometheus records the verdict; the alerts tell a finished job from a dead daemon by it."""

    verdict: str  # "failed" or "succeeded", for the log


Action = (Send | Launch | Stop | ExtendStop | EndStopSoon | HangUp | DropSession | Announce | RunNodeCheck |
          ListenForProbe | PrepareStandby | StopRetrying | ProbeServer | DumpStacks | CoordinatorLost | ScanSnapshots |
          WaitGpusReleased | WaitPortFree | ObserveEtcd | ExitAgent | RetryAfter | RemoveLocalTier | HostUntilJobEnds |
          KeepMetricsUp)


@dataclass(frozen=True)
class StopResult:
    """How a stop ended."""

    returncode: int | None  # the keeper's, None if no worker had been started
    exited_before_stop: bool  # it had ended by itself before it was signalled
    pids: tuple[int, ...] = ()  # every process of the worker (WorkerProcess.pids): what may still hold GPU memory


class FatalSessionError(Exception):
    """The coordinator refused this agent for a reason that retrying cannot fix."""

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SessionLost(Exception):
    """The session with the coordinator broke, or the coordinator fell silent: retry (and fence)."""
