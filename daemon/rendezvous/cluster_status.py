"""The job as status and /metrics show it: a read-only view of the rendezvous state machine, built on demand."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tfelastic.daemon.rendezvous.api import (
    ClusterStatus,
    GoodputView,
    JobState,
    NodeState,
    NodeStatus,
)

if TYPE_CHECKING:
    from tfelastic.daemon.rendezvous.state import Rendezvous


def cluster_status(rv: Rendezvous) -> ClusterStatus:
    nodes = sorted((_node(rv, node_id) for node_id in rv.nodes), key=lambda n: (n.rank < 0, n.rank, n.node_id))
    spec = rv.spec
    resumes = rv.restarts.resumes
    return ClusterStatus(
        job=spec.job if spec else "",
        state=rv.state,
        reason=rv.reason,
        generation=rv.generation,
        world_size=rv.world_size,
        min_nodes=spec.min_nodes if spec else 0,
        max_nodes=spec.max_nodes if spec else 0,
        max_restarts=spec.max_restarts if spec else 0,
        restarts_total=rv.restarts.total,
        restarts_by_reason=dict(rv.restarts.by_reason),
        warnings=tuple(resumes.warnings),
        steps_redone=resumes.steps_redone,
        steps_lost=resumes.steps_lost,
        nodes=tuple(nodes),
        quarantines_by_kind=dict(rv.quarantine.by_kind),
        goodput=_goodput(rv),
        vacant=rv.tasks.vacancies() if rank_shown(rv) else (),
    )


def rank_shown(rv: Rendezvous) -> bool:
    """A parameter-server job's tasks are shown while its generation runs (or has just succeeded)."""
    return rv.world_size > 0 and rv.spec is not None and rv.spec.parameter_server


def _goodput(rv: Rendezvous) -> GoodputView:
    return rv.goodput.view(rv.wall_offset)


def _node(rv: Rendezvous, node_id: str) -> NodeStatus:
    node, rank = rv.nodes[node_id], rv.rank_of(node_id)
    held = rv.quarantine.held.get(node_id) if node.state is NodeState.QUARANTINED else None
    return NodeStatus(
        node_id, rank, node.info.host, node.info.worker_port, node.state, node.worker_pid if rank >= 0 else 0,
        node.progress, node.gpus, node.gpu_utilization, held.reason if held else "",
        held.until if held else None, held.kind if held else "", node.info.version,
        rv.tasks.described(node_id) if rank >= 0 and rank_shown(rv) else "", rv.tasks.replacements[node_id])


def while_unrecorded(snap: ClusterStatus, problem: str, *, holding: bool,
                     holding_assignments: bool) -> ClusterStatus:
    """The job as status shows it while etcd has not recorded what the coordinator decided (``problem``: why it
    could not, "" when it could; ``holding``: orders wait for it). A generation formed but held is WAITING: not
    one of its workers may start before it is recorded."""
    if not problem or not holding:
        return snap
    waiting = f"waiting for etcd to record the job's state ({problem})"
    if holding_assignments:
        formed = f"generation {snap.generation} formed"
        return dataclasses.replace(snap, state=JobState.WAITING, reason=f"{formed}; {waiting}")
    return dataclasses.replace(snap, reason=f"{snap.reason}; {waiting}" if snap.reason else waiting)
