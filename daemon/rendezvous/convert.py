"""The only border between the ``tfelastic.v1`` messages and the rendezvous API types, both ways, for every message:
joins, heartbeats, reports with their progress, leaves, every order, the operator requests and the cluster status.

No logic lives here. Times travel as ages (``age_seconds``), because the two ends do not share a clock: a side
that sends turns its own clock readings into ages (``now``), and the side that receives turns them back into
readings of its own clock.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tfelastic.daemon.rendezvous import api, bounds  # bounds imports this module: its names are read at call time
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

JOB_STATES = {
    api.JobState.WAITING: pb.JOB_STATE_WAITING,
    api.JobState.RUNNING: pb.JOB_STATE_RUNNING,
    api.JobState.RESTARTING: pb.JOB_STATE_RESTARTING,
    api.JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    api.JobState.FAILED: pb.JOB_STATE_FAILED,
}
JOB_STATE_NAMES = {v: k for k, v in JOB_STATES.items()}
WORKER_STATUSES = {
    api.WorkerStatus.RUNNING: pb.WORKER_STATUS_RUNNING,
    api.WorkerStatus.SUCCEEDED: pb.WORKER_STATUS_SUCCEEDED,
    api.WorkerStatus.FAILED: pb.WORKER_STATUS_FAILED,
    api.WorkerStatus.STALLED: pb.WORKER_STATUS_STALLED,
    api.WorkerStatus.REPLACED: pb.WORKER_STATUS_REPLACED,
}
_WORKER_STATUS_NAMES = {v: k for k, v in WORKER_STATUSES.items()}
_NODE_STATES = {s.value: s for s in api.NodeState}
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(api.JobSpec))  # the same names in the proto
_HEARTBEAT = pb.Heartbeat()


def spec_to_proto(spec: api.JobSpec) -> pb.JobSpec:
    return pb.JobSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS})


def spec_from_proto(msg: pb.JobSpec) -> api.JobSpec:
    """An agent older than the strategy field sends none: its job is mirrored, like the coordinator's default."""
    spec = api.JobSpec(**{name: getattr(msg, name) for name in _SPEC_FIELDS})
    return spec if spec.strategy else dataclasses.replace(spec, strategy=api.JobSpec.strategy)


# ------------------------------------------------------------------------------------------ agent messages


def agent_message_to_proto(message: api.AgentMessage, now: float) -> pb.AgentMessage:
    if isinstance(message, api.Heartbeat):
        return pb.AgentMessage(heartbeat=_HEARTBEAT)
    if isinstance(message, api.WorkerReport):
        return pb.AgentMessage(report=report_to_proto(message, now))
    if isinstance(message, api.Leave):
        return pb.AgentMessage(leave=pb.Leave(reason=message.reason))
    node = message.node
    return pb.AgentMessage(join=pb.Join(
        node_id=node.node_id, spec=spec_to_proto(message.spec), host=node.host, worker_port=node.worker_port,
        last_generation=node.last_generation, restart_count=message.restart_count, incarnation=node.incarnation,
        last_rank=node.last_rank, attached_generation=message.attached_generation, checked=message.checked,
        check_failure=message.check_failure, restorable_steps=node.restorable_steps,
        last_world_size=node.last_world_size, version=node.version, protocol=node.protocol, role=node.role,
        shared_steps=node.shared_steps))


def agent_message_from_proto(message: pb.AgentMessage, now: float) -> api.AgentMessage:
    """Raises ProtocolError for a message with no kind (the bounds of each field: bounds.check_message)."""
    kind = message.WhichOneof("kind")
    if kind == "join":
        return join_from_proto(message.join)
    if kind == "heartbeat":
        return api.Heartbeat()
    if kind == "report":
        return report_from_proto(message.report, now)
    if kind == "leave":
        return api.Leave(message.leave.reason)
    raise api.ProtocolError(f"unexpected message {kind!r}")


def join_from_proto(join: pb.Join) -> api.Join:
    node = api.NodeInfo(join.node_id, join.host, join.worker_port, join.incarnation, join.last_generation,
                        join.last_rank, tuple(join.restorable_steps), join.last_world_size, join.version,
                        join.protocol, join.role or api.NodeInfo.role, tuple(join.shared_steps))
    return api.Join(node, spec_from_proto(join.spec), join.restart_count, join.attached_generation, join.checked,
                    join.check_failure)


def report_to_proto(report: api.WorkerReport, now: float) -> pb.WorkerReport:
    message = pb.WorkerReport(generation=report.generation, status=WORKER_STATUSES[report.status], pid=report.pid,
                              exit_code=report.exit_code, detail=report.detail, gpus=report.gpus,
                              gpu_utilization=report.gpu_utilization,
                              cause=report.cause.value if report.cause is not None else "")
    if report.progress is not None:
        message.has_progress = True
        message.progress.CopyFrom(progress_to_proto(report.progress, now))
    return message


def report_from_proto(report: pb.WorkerReport, now: float) -> api.WorkerReport:
    return api.WorkerReport(
        generation=report.generation, status=_WORKER_STATUS_NAMES.get(report.status, api.WorkerStatus.RUNNING),
        pid=report.pid, exit_code=report.exit_code, detail=report.detail,
        progress=progress_from_proto(report.progress, now) if report.has_progress else None,
        gpus=report.gpus, gpu_utilization=report.gpu_utilization, cause=cause_from_proto(report.cause))


def cause_from_proto(value: str) -> api.FailureCause | None:
    """None for none; a cause this version does not know (a newer agent's) is OTHER, never an error."""
    if not value:
        return None
    return _CAUSES.get(value, api.FailureCause.OTHER)


_CAUSES = {cause.value: cause for cause in api.FailureCause}


def progress_to_proto(progress: api.WorkerProgress, now: float) -> pb.Progress:
    return pb.Progress(
        step=progress.step, examples=progress.examples, loss=progress.loss or 0.0,
        has_loss=progress.loss is not None, age_seconds=max(0.0, now - progress.reported_at),
        checkpoint_step=progress.checkpoint_step, steps_per_second=progress.steps_per_second,
        checkpoint_age_seconds=-1.0 if progress.checkpoint_at is None else max(0.0, now - progress.checkpoint_at),
        save_seconds=progress.save_seconds, other_seconds=progress.other_seconds,
        training_done=progress.training_done,
    )


def progress_from_proto(progress: pb.Progress, now: float) -> api.WorkerProgress:
    checkpoint_age = progress.checkpoint_age_seconds
    return api.WorkerProgress(
        step=progress.step, examples=progress.examples, loss=progress.loss if progress.has_loss else None,
        checkpoint_step=progress.checkpoint_step, reported_at=now - progress.age_seconds,
        steps_per_second=progress.steps_per_second,
        checkpoint_at=now - checkpoint_age if checkpoint_age >= 0 else None, save_seconds=progress.save_seconds,
        other_seconds=progress.other_seconds, training_done=progress.training_done)


# ---------------------------------------------------------------------------------------------- orders


def order_to_proto(order: api.Order | api.Heartbeat, template: pb.Assignment | None = None) -> pb.CoordinatorMessage:
    """``template``: :func:`assignment_template` of the same generation, to reuse its member list."""
    if isinstance(order, api.Heartbeat):
        return pb.CoordinatorMessage(heartbeat=_HEARTBEAT)
    if isinstance(order, api.Assignment):
        message = pb.CoordinatorMessage()
        message.assignment.CopyFrom(template if template is not None else assignment_template(order))
        message.assignment.rank = order.rank
        return message
    if isinstance(order, api.StopWorkers):
        return pb.CoordinatorMessage(stop=pb.StopWorkers(generation=order.generation,
                                                         reason=order.reason.value))
    if isinstance(order, api.Finished):
        return pb.CoordinatorMessage(finished=pb.JobFinished(state=JOB_STATES[order.state],
                                                             reason=order.reason))
    if isinstance(order, api.Waiting):
        return pb.CoordinatorMessage(waiting=pb.Waiting(
            joined=order.joined, min_nodes=order.min_nodes, max_nodes=order.max_nodes, detail=order.detail))
    if isinstance(order, api.DrainNode):
        return pb.CoordinatorMessage(drain=pb.DrainNode(reason=order.reason))
    if isinstance(order, api.CheckNode):
        return pb.CoordinatorMessage(check=pb.CheckNode(reason=order.reason))
    raise TypeError(f"{order!r} has no wire form")  # Evict closes the stream instead


def coordinator_message_from_proto(message: pb.CoordinatorMessage) -> api.CoordinatorMessage:
    """What an agent reads off its session. Raises ProtocolError for a message with no kind it knows, or a stop
    for a reason it does not know (a newer coordinator)."""
    kind = message.WhichOneof("kind")
    if kind == "heartbeat":
        return api.Heartbeat()
    if kind == "assignment":
        return assignment_from_proto(message.assignment)
    if kind == "stop":
        try:
            reason = api.RestartReason(message.stop.reason)
        except ValueError:
            raise api.ProtocolError(f"a stop order for an unknown reason {message.stop.reason[:64]!r}") from None
        return api.StopWorkers(message.stop.generation, reason)
    if kind == "finished":
        return api.Finished(JOB_STATE_NAMES.get(message.finished.state, api.JobState.FAILED), message.finished.reason)
    if kind == "waiting":
        w = message.waiting
        return api.Waiting(w.joined, w.min_nodes, w.max_nodes, w.detail)
    if kind == "drain":
        return api.DrainNode(message.drain.reason)
    if kind == "check":
        return api.CheckNode(message.check.reason)
    raise api.ProtocolError(f"unexpected message {kind!r} from the coordinator")


def assignment_template(order: api.Assignment) -> pb.Assignment:
    """Everything of an Assignment but the rank. Every member gets the whole member list (TF_CONFIG names every
    worker), so building it once per generation instead of once per member saves O(nodes^2) work."""
    members = [pb.Member(node_id=m.node_id, rank=m.rank, host=m.host, worker_port=m.worker_port,
                         task_type="" if m.task_index < 0 else m.task_type, task_index=max(m.task_index, 0))
               for m in order.members]
    return pb.Assignment(generation=order.generation, world_size=order.world_size, members=members,
                         restart_count=order.restart_count, restore_step=order.restore_step or 0,
                         has_restore_step=order.restore_step is not None)


def assignment_from_proto(msg: pb.Assignment) -> api.Assignment:
    members = tuple(api.Member(m.node_id, m.rank, m.host, m.worker_port, m.task_type, m.task_index)
                    if m.task_type else api.Member(m.node_id, m.rank, m.host, m.worker_port) for m in msg.members)
    return api.Assignment(msg.generation, msg.rank, msg.world_size, members, msg.restart_count,
                          msg.restore_step if msg.has_restore_step else None)


# ------------------------------------------------------------------------------------ operators and status


def drain_from_proto(request: pb.DrainRequest) -> api.DrainRequest:
    return api.DrainRequest(request.node_id, request.reason, request.force)


def status_to_proto(snap: api.ClusterStatus, now: float) -> pb.ClusterStatus:
    nodes = []
    for n in snap.nodes:
        node = pb.NodeStatus(node_id=n.node_id, rank=n.rank, host=n.host, worker_port=n.worker_port,
                             state=n.state.value, worker_pid=n.worker_pid, gpus=n.gpus,
                             gpu_utilization=n.gpu_utilization, quarantine_reason=n.quarantine_reason,
                             quarantine_seconds_left=0.0 if n.quarantined_until is None else
                             max(0.0, n.quarantined_until - now), quarantine_kind=n.quarantine_kind,
                             version=n.version, role=n.role, replacements=n.replacements)
        if n.progress is not None:
            node.progress.CopyFrom(progress_to_proto(n.progress, now))
            node.has_progress = True
        nodes.append(node)
    return pb.ClusterStatus(
        job=snap.job, state=JOB_STATES[snap.state] if snap.state else pb.JOB_STATE_UNSPECIFIED, reason=snap.reason,
        generation=snap.generation, world_size=snap.world_size, min_nodes=snap.min_nodes, max_nodes=snap.max_nodes,
        restarts_total=snap.restarts_total, max_restarts=snap.max_restarts, nodes=nodes,
        warnings=snap.warnings, steps_redone=snap.steps_redone, steps_lost=snap.steps_lost,
        coordinator=None if snap.coordinator is None else pb.CoordinatorInfo(
            node=snap.coordinator.node, address=snap.coordinator.address, since=snap.coordinator.since,
            version=snap.coordinator.version, protocol=snap.coordinator.protocol),
        restarts_by_reason=[pb.RestartCount(reason=r, count=c)
                            for r, c in sorted(snap.restarts_by_reason.items())],
        quarantines=[pb.QuarantineCount(kind=k, count=c) for k, c in sorted(snap.quarantines_by_kind.items())],
        goodput=None if snap.goodput is None else goodput_to_proto(snap.goodput), vacant=snap.vacant,
    )


def _seconds_to_proto(seconds: dict[str, float]) -> list[pb.CategorySeconds]:
    return [pb.CategorySeconds(category=c, seconds=s) for c, s in seconds.items()]


def goodput_to_proto(view: api.GoodputView) -> pb.Goodput:
    return pb.Goodput(seconds=_seconds_to_proto(view.seconds), generations=[pb.GenerationLine(
        generation=g.generation, formed_at=g.formed_at, size=g.size, members=g.members,
        restored_step=g.restored_step or 0, has_restored_step=g.restored_step is not None,
        startup_seconds=g.startup_seconds or 0.0, has_startup_seconds=g.startup_seconds is not None,
        steps_redone=g.steps_redone, ended=g.ended, seconds=_seconds_to_proto(g.seconds),
        reached_step=g.reached_step or 0, has_reached_step=g.reached_step is not None) for g in view.generations],
        steps_redone=view.steps_redone,
        marks=[pb.TimelineMark(at=m.at, kind=m.kind, node=m.node, detail=m.detail) for m in view.marks])


def goodput_from_proto(message: pb.Goodput) -> api.GoodputView:
    return api.GoodputView({c.category: c.seconds for c in message.seconds}, tuple(api.GenerationSummary(
        g.generation, g.formed_at, g.size, tuple(g.members), g.restored_step if g.has_restored_step else None,
        g.startup_seconds if g.has_startup_seconds else None, g.steps_redone, g.ended,
        {c.category: c.seconds for c in g.seconds}, g.reached_step if g.has_reached_step else None)
        for g in message.generations), message.steps_redone,
        tuple(api.TimelineMark(m.at, m.kind, m.node, m.detail) for m in message.marks))


def status_from_proto(status: pb.ClusterStatus, now: float) -> api.ClusterStatus:
    """A coordinator's reply as status and report show it: its text made printable and bounded, its numbers
    finite and bounded, a node state this version does not know shown as unknown (a newer coordinator), a job
    state it does not know as None. Never raises for what a peer sent."""
    status = _shown_reply(status)
    nodes = tuple(api.NodeStatus(
        n.node_id, n.rank, n.host, n.worker_port, _NODE_STATES.get(n.state, api.NodeState.UNKNOWN), n.worker_pid,
        progress_from_proto(n.progress, now) if n.has_progress else None, n.gpus, n.gpu_utilization,
        n.quarantine_reason, now + n.quarantine_seconds_left if n.state == api.NodeState.QUARANTINED.value else None,
        n.quarantine_kind, n.version, n.role, n.replacements,
    ) for n in status.nodes)
    return api.ClusterStatus(
        job=status.job, state=JOB_STATE_NAMES.get(status.state), reason=status.reason, generation=status.generation,
        world_size=status.world_size, min_nodes=status.min_nodes, max_nodes=status.max_nodes,
        max_restarts=status.max_restarts, restarts_total=status.restarts_total,
        restarts_by_reason={r.reason: r.count for r in status.restarts_by_reason}, nodes=nodes,
        warnings=tuple(status.warnings), steps_redone=status.steps_redone, steps_lost=status.steps_lost,
        coordinator=api.CoordinatorInfo(status.coordinator.node, status.coordinator.address, status.coordinator.since,
                                        status.coordinator.version, status.coordinator.protocol)
        if status.HasField("coordinator") else None,
        quarantines_by_kind={q.kind: q.count for q in status.quarantines},
        goodput=goodput_from_proto(status.goodput) if status.HasField("goodput") else None,
        vacant=tuple(status.vacant))


_SIGNED = frozenset({"loss", "checkpoint_age_seconds"})  # every other number of a status is never below 0


def _shown_reply(status: pb.ClusterStatus) -> pb.ClusterStatus:
    """A copy of ``status`` with every text printable and at most bounds.SHOWN_STATUS_TEXT_CHARS long, every number
    finite, at most bounds.SHOWN_NUMBER and not below 0 (a loss and a checkpoint's age, -1 for none, may be; a loss that
    is not a number: no loss)."""
    shown = pb.ClusterStatus()
    shown.CopyFrom(status)
    _make_shown(shown)
    return shown


def _make_shown(message: Message) -> None:
    for field, value in message.ListFields():
        repeated = _is_repeated(field)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value if repeated else (value,):
                _make_shown(item)
        elif field.type == FieldDescriptor.TYPE_STRING:
            _replace(message, field.name, value, repeated, _shown_text)
        elif field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            if field.name == "loss" and not math.isfinite(value):
                message.ClearField("loss")
                message.has_loss = False  # type: ignore[attr-defined]
                continue
            low = -bounds.SHOWN_NUMBER if field.name in _SIGNED else 0.0
            _replace(message, field.name, value, repeated, functools.partial(_shown_number, low=low))


def _is_repeated(field: FieldDescriptor) -> bool:
    """protobuf >= 6 says so itself (7 dropped ``label``); 4.x, the floor, has only the label."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)  # type: ignore[attr-defined]


def _replace(message: Message, name: str, value: Any, repeated: bool, shown: Callable[[Any], Any]) -> None:
    if repeated:
        value[:] = [shown(v) for v in value]
    else:
        setattr(message, name, shown(value))


def _shown_text(text: str) -> str:
    return bounds.printable(text, bounds.SHOWN_STATUS_TEXT_CHARS)


def _shown_number(value: float, low: float) -> float:
    return min(max(value, low), bounds.SHOWN_NUMBER) if math.isfinite(value) else 0.0
