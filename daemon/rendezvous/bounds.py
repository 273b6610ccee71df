"""Every bound on a value an agent sends, in one place: the coordinator refuses a message that breaks one, and the
agent's configuration is checked against the same rules before anything starts (a value the coordinator would
refuse must fail as a bad option, exit 78, not as a refused Join after the agent is up).

The rules on plain values and :class:`~tfelastic.daemon.rendezvous.api.JobSpec` return :class:`Problem` s that
name the field; each caller puts its own name on it (``spec.max_restarts`` on the wire, ``--max-restarts`` in
the configuration). :func:`validate_join` and :func:`check_message` apply them to what arrives off the wire.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from tfelastic.daemon.rendezvous import api, convert, roles
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.trainer import progress

# The largest legitimate request is a Join: ids and names of at most 128 characters, a host of 255, a backup_dir
# of 4096, a 32-byte digest and 64 steps, about 5.3 KiB with the field tags (limits.MAX_REQUEST_BYTES leaves 10x
# room).
MAX_NODES = 100_000  # min_nodes, max_nodes, max_restarts and ranks
MAX_RESTART_COUNT = 1 << 31  # a Join's restart_count ends up in uint32 fields, plus the restarts still to come
MAX_GENERATION = 1 << 53  # far beyond any job, and exact in every field it reaches
MAX_SECONDS = 1e9  # about 31 years: any age or duration beyond it is not a clock reading
MAX_NAME_CHARS = 128  # job names and node ids
MAX_HOST_CHARS = 255
MAX_PATH_CHARS = 4096  # backup_dir
MAX_INCARNATION_CHARS = 64
MAX_DETAIL_CHARS = 4096  # WorkerReport.detail
MAX_REASON_CHARS = 1024  # Leave.reason
MAX_GPUS = 4096
MAX_RESTORABLE_STEPS = 64  # a Join's restorable_steps (agents send at most trainer.snapshots.MAX_REPORTED)
MAX_STEP = progress.MAX_STEP  # a training step (or examples), exact in every field and metric it reaches
DIGEST_BYTES = 32  # SHA-256 of the trainer command

# How much of a value from the network a log line or a reply shows (printable): enough to read it, never a flood.
SHOWN_REASON_CHARS = 200  # a Leave's or an operator's reason
# A WorkerReport's detail (an exit, a signal, the trainer's last error; a hang's site with two paths of the
# trainer's own code), as the coordinator keeps and shows it.
SHOWN_DETAIL_CHARS = 600
SHOWN_CHECK_FAILURE_CHARS = 500  # what a node check found
SHOWN_VALUE_CHARS = 32  # a bad enum value (a strategy, a role) quoted in a refusal
SHOWN_STORED_VALUE_CHARS = 80  # a bad value read back from etcd
SHOWN_STATUS_TEXT_CHARS = 4096  # any text of a status reply (a coordinator's reasons and warnings run long)
SHOWN_NUMBER = 1e11  # any number of a status reply, either sign (a wall-clock time in the year 5138)

NODE_ID_RULE = f"1-{MAX_NAME_CHARS} letters, digits, '.', '_', ':', '@' or '-', starting with a letter or digit"
JOB_NAME_RULE = f"non-empty letters, digits, '-', '_' or '.' (ASCII, starting with a letter or digit, at most " \
                f"{MAX_NAME_CHARS})"
# A job's name names its backup and tier folders and /etc/tfelastic/JOB.toml: '.', '..' and names that differ only
# in how a file system normalises Unicode would collide there.
_JOB_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_CHARS - 1}}}")
_NODE_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:@-]{{0,{MAX_NAME_CHARS - 1}}}")
_TIMINGS = tuple(f.name for f in dataclasses.fields(api.JobSpec) if f.name.endswith("_seconds"))


@dataclass(frozen=True)
class Problem:
    field: str  # as api.JobSpec (or the Join) names it
    text: str  # what is wrong with the value, starting with the value itself


def node_id_problem(node_id: str) -> Problem | None:
    if _NODE_ID.fullmatch(node_id):
        return None
    return Problem("node_id", f"{node_id[:64]!r} must be {NODE_ID_RULE}")


def job_name_problem(name: str) -> Problem | None:
    if _JOB_NAME.fullmatch(name):
        return None
    return Problem("job", f"{name[:64]!r} must be {JOB_NAME_RULE}")


def seconds_problem(field: str, value: float) -> Problem | None:
    if 0 <= value <= MAX_SECONDS:  # NaN fails too
        return None
    return Problem(field, f"timing {value} is out of range 0..{MAX_SECONDS:g} seconds")


def spec_problems(spec: api.JobSpec) -> list[Problem]:
    """What the coordinator refuses in a job spec (the agent's configuration checks the same)."""
    problems = [p for p in (job_name_problem(spec.job),) if p]
    if len(spec.command_digest) != DIGEST_BYTES:
        problems.append(Problem("command_digest", f"has {len(spec.command_digest)} bytes, not {DIGEST_BYTES} "
                                                  "(SHA-256)"))
    if not 1 <= spec.min_nodes <= spec.max_nodes <= MAX_NODES:
        problems.append(Problem("max_nodes" if spec.min_nodes >= 1 else "min_nodes",
                                f"node range {spec.min_nodes}:{spec.max_nodes} is out of range 1..{MAX_NODES}, the "
                                f"most a coordinator accepts"))
    if spec.max_restarts > MAX_NODES:
        problems.append(Problem("max_restarts", f"{spec.max_restarts} is more than {MAX_NODES}, the most a "
                                                "coordinator accepts"))
    learned = spec.stall_timeout_seconds == api.STALL_LEARNED
    timings = [name for name in _TIMINGS if not (learned and name == "stall_timeout_seconds")]
    problems += [p for p in (seconds_problem(name, getattr(spec, name)) for name in timings) if p]
    if not spec.node_timeout_seconds > spec.heartbeat_interval_seconds:
        problems.append(Problem("node_timeout_seconds", f"{spec.node_timeout_seconds}s must exceed "
                                                        f"heartbeat_interval {spec.heartbeat_interval_seconds}s"))
    if len(spec.backup_dir) > MAX_PATH_CHARS:
        problems.append(Problem("backup_dir", f"has {len(spec.backup_dir)} characters, more than {MAX_PATH_CHARS}"))
    return problems + strategy_problems(spec)


def strategy_problems(spec: api.JobSpec) -> list[Problem]:
    """A parameter-server job needs its chief, its N parameter servers and at least one worker within the node
    range; a mirrored job has no parameter servers."""
    strategies = [s.value for s in roles.Strategy]
    if spec.strategy not in strategies:
        shown = printable(spec.strategy, SHOWN_VALUE_CHARS)
        return [Problem("strategy", f"{shown!r} is not one of {', '.join(strategies)}")]
    if not spec.parameter_server:
        if spec.ps:
            return [Problem("ps", f"{spec.ps} needs --strategy parameter-server (only such a job has parameter "
                                  f"servers; this job is "
                                  f"{spec.strategy}); drop --ps or set the strategy")]
        return []
    if spec.ps < 1:
        return [Problem("ps", "a parameter-server job needs at least 1 parameter server: set --ps N")]
    if spec.min_nodes < spec.ps + 2:
        return [Problem("min_nodes", f"{spec.min_nodes} nodes cannot hold the chief, {spec.ps} parameter "
                                     f"server{'s' if spec.ps > 1 else ''} and a worker: the minimum must be at "
                                     f"least {spec.ps + 2} (--ps {spec.ps} + 2)")]
    return []


def printable(text: str, limit: int) -> str:
    """Text from the network, made safe to log and to show: printable, and bounded."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


# ------------------------------------------------------------------------------------------- off the wire


def validate_join(join: pb.Join) -> None:
    """Refuses (ProtocolError, naming each field) a Join whose values are out of range, before any of it reaches
    the state machine."""
    problems = [f"{p.field} {p.text}" for p in (node_id_problem(join.node_id),) if p]
    if not join.host or len(join.host) > MAX_HOST_CHARS or not join.host.isprintable() or " " in join.host:
        problems.append(f"host {join.host[:64]!r} must be a host name or address")
    if not 1 <= join.worker_port <= 65535:
        problems.append(f"worker_port {join.worker_port} is out of range 1-65535")
    if join.last_generation > MAX_GENERATION:
        problems.append(f"last_generation {join.last_generation} is out of range")
    if join.attached_generation > MAX_GENERATION:
        problems.append(f"attached_generation {join.attached_generation} is out of range")
    if join.restart_count > MAX_RESTART_COUNT:
        problems.append(f"restart_count {join.restart_count} is out of range")
    if not -1 <= join.last_rank < MAX_NODES:
        problems.append(f"last_rank {join.last_rank} is out of range -1..{MAX_NODES - 1}")
    if not 0 <= join.last_world_size <= MAX_NODES:
        problems.append(f"last_world_size {join.last_world_size} is out of range 0..{MAX_NODES}")
    if len(join.check_failure) > MAX_DETAIL_CHARS:
        problems.append(f"check_failure has {len(join.check_failure)} characters, more than {MAX_DETAIL_CHARS}")
    if len(join.restorable_steps) > MAX_RESTORABLE_STEPS:
        problems.append(f"restorable_steps has {len(join.restorable_steps)} steps, more than {MAX_RESTORABLE_STEPS}")
    elif not all(0 <= step <= MAX_STEP for step in join.restorable_steps):
        problems.append(f"restorable_steps holds a step out of range 0..{MAX_STEP}")
    if len(join.shared_steps) > MAX_RESTORABLE_STEPS:
        problems.append(f"shared_steps has {len(join.shared_steps)} steps, more than {MAX_RESTORABLE_STEPS}")
    elif not all(0 <= step <= MAX_STEP for step in join.shared_steps):
        problems.append(f"shared_steps holds a step out of range 0..{MAX_STEP}")
    if join.role and join.role not in {r.value for r in roles.Role}:
        shown = printable(join.role, SHOWN_VALUE_CHARS)
        problems.append(f"role {shown!r} is not one of {', '.join(r.value for r in roles.Role)}")
    if len(join.incarnation) > MAX_INCARNATION_CHARS:
        problems.append(f"incarnation has {len(join.incarnation)} characters, more than {MAX_INCARNATION_CHARS}")
    if not join.HasField("spec"):
        problems.append("a job spec is required")
    problems += [f"spec.{p.field} {p.text}" for p in spec_problems(convert.spec_from_proto(join.spec))]
    if problems:
        raise api.ProtocolError("invalid Join: " + "; ".join(problems))


def check_message(message: pb.AgentMessage) -> None:
    """Refuses (ProtocolError, naming each field) a message that no agent sends: out-of-range numbers,
    non-finite clock readings, oversized text. The trainer's steps and examples are bounded as the agent bounds
    them (trainer/progress.py), so that none reaches the job's state or a metric beyond 2^53; its loss passes as
    it is: a diverged loss is NaN, and that is news, not an attack."""
    kind = message.WhichOneof("kind")
    if kind == "join":
        validate_join(message.join)
        return
    problems: list[str] = []
    if kind == "report":
        problems = _report_problems(message.report)
    elif kind == "leave" and len(message.leave.reason) > MAX_REASON_CHARS:
        problems = [f"reason has {len(message.leave.reason)} characters, more than {MAX_REASON_CHARS}"]
    if problems:
        raise api.ProtocolError(f"invalid {type(getattr(message, kind)).__name__}: " + "; ".join(problems))


def _report_problems(report: pb.WorkerReport) -> list[str]:
    problems = []
    if report.generation > MAX_GENERATION:
        problems.append(f"generation {report.generation} is out of range")
    if report.pid < 0:
        problems.append(f"pid {report.pid} is negative")
    if len(report.detail) > MAX_DETAIL_CHARS:
        problems.append(f"detail has {len(report.detail)} characters, more than {MAX_DETAIL_CHARS}")
    if report.gpus > MAX_GPUS:
        problems.append(f"gpus {report.gpus} is more than {MAX_GPUS}")
    if not 0.0 <= report.gpu_utilization <= 1.0:  # NaN fails too
        problems.append(f"gpu_utilization {report.gpu_utilization} is not in 0..1")
    p = report.progress
    if not 0.0 <= p.age_seconds <= MAX_SECONDS:
        problems.append(f"progress.age_seconds {p.age_seconds} is not in 0..{MAX_SECONDS:g}")
    if not (p.checkpoint_age_seconds == -1.0 or 0.0 <= p.checkpoint_age_seconds <= MAX_SECONDS):
        problems.append(f"progress.checkpoint_age_seconds {p.checkpoint_age_seconds} is neither -1 nor in "
                        f"0..{MAX_SECONDS:g}")
    if not math.isfinite(p.steps_per_second):
        problems.append(f"progress.steps_per_second {p.steps_per_second} is not finite")
    for name in ("save_seconds", "other_seconds"):
        if not 0.0 <= getattr(p, name) <= MAX_SECONDS:
            problems.append(f"progress.{name} {getattr(p, name)} is not in 0..{MAX_SECONDS:g}")
    for name, low in (("step", 0), ("examples", 0), ("checkpoint_step", -1)):
        value = getattr(p, name)
        if not low <= value <= MAX_STEP:
            problems.append(f"progress.{name} {value} is out of range {low}..{MAX_STEP}")
    return problems
