"""Translation between the rendezvous API types and the ``tfelastic.v1`` messages. No logic lives here."""

from __future__ import annotations

import dataclasses

from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

JOB_STATES = {
    api.JobState.WAITING: pb.JOB_STATE_WAITING,
    api.JobState.RUNNING: pb.JOB_STATE_RUNNING,
    api.JobState.RESTARTING: pb.JOB_STATE_RESTARTING,
    api.JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    api.JobState.FAILED: pb.JOB_STATE_FAILED,
}
JOB_STATE_NAMES = {v: k for k, v in JOB_STATES.items()}


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(api.JobSpec))  # the same names in the proto


def spec_to_proto(spec: api.JobSpec) -> pb.JobSpec:
    return pb.JobSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS})


def spec_from_proto(msg: pb.JobSpec) -> api.JobSpec:
    return api.JobSpec(**{name: getattr(msg, name) for name in _SPEC_FIELDS})


def order_to_proto(order: api.Order, template: pb.Assignment | None = None) -> pb.CoordinatorMessage:
    """``template``: :func:`assignment_template` of the same generation, to reuse its member list."""
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
    raise TypeError(f"{order!r} has no wire form")  # Evict closes the stream instead


def assignment_template(order: api.Assignment) -> pb.Assignment:
    """Everything of an Assignment but the rank. Every member gets the whole member list (TF_CONFIG names every
    worker), so building it once per generation instead of once per member saves O(nodes^2) work."""
    members = [pb.Member(node_id=m.node_id, rank=m.rank, host=m.host, worker_port=m.worker_port)
               for m in order.members]
    return pb.Assignment(generation=order.generation, world_size=order.world_size, members=members,
                         restart_count=order.restart_count)


def assignment_from_proto(msg: pb.Assignment) -> api.Assignment:
    members = tuple(api.Member(m.node_id, m.rank, m.host, m.worker_port) for m in msg.members)
    return api.Assignment(msg.generation, msg.rank, msg.world_size, members, msg.restart_count)


def progress_to_proto(progress: api.WorkerProgress, now: float) -> pb.Progress:
    return pb.Progress(
        step=progress.step, examples=progress.examples, loss=progress.loss or 0.0,
        has_loss=progress.loss is not None, age_seconds=max(0.0, now - progress.reported_at),
        checkpoint_step=progress.checkpoint_step, steps_per_second=progress.steps_per_second,
        checkpoint_age_seconds=-1.0 if progress.checkpoint_at is None else max(0.0, now - progress.checkpoint_at),
    )


def status_to_proto(snap: api.ClusterSnapshot, now: float) -> pb.ClusterStatus:
    nodes = []
    for n in snap.nodes:
        node = pb.NodeStatus(node_id=n.node_id, rank=n.rank, host=n.host, worker_port=n.worker_port,
                             state=n.state.value, worker_pid=n.worker_pid, gpus=n.gpus,
                             gpu_utilization=n.gpu_utilization)
        if n.progress is not None:
            node.progress.CopyFrom(progress_to_proto(n.progress, now))
            node.has_progress = True
        nodes.append(node)
    return pb.ClusterStatus(
        job=snap.job, state=JOB_STATES[snap.state], reason=snap.reason, generation=snap.generation,
        world_size=snap.world_size, min_nodes=snap.min_nodes, max_nodes=snap.max_nodes,
        restarts_total=snap.restarts_total, max_restarts=snap.max_restarts, nodes=nodes,
        restarts_by_reason=[pb.RestartCount(reason=r, count=c)
                            for r, c in sorted(snap.restarts_by_reason.items())],
    )
