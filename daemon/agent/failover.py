"""When an agent with etcd behind its job fences itself. Pure.

Without etcd, an agent that hears nothing from the coordinator for ``node_timeout - heartbeat_interval`` stops its
worker at once: the coordinator is about to declare it lost. With etcd the coordinator may only be failing over:
its successor takes the running generation over, and the members keep training if they attach in time. So while
no coordinator answers, the agent keeps its worker as long as etcd says the generation it runs is still the job's,
and fences when:

- etcd records a newer generation: the job has moved on without this node; or records this node's generation
  as no longer running: its coordinator is restarting it (without this node, which it cannot reach);
- etcd has not answered for the fence limit either (this node may be cut off: the majority side re-forms); or
- a new coordinator has been known for the fence limit and this agent has not attached to it: that coordinator
  counts it lost after ``node_timeout`` plus the grace it gives its members (docs/design.md, "etcd: timing").
"""

from __future__ import annotations


def fence_reason(*, running: int, recorded: int | None, silent: float | None, leader_known_for: float | None,
                 fence_after: float, recorded_running: bool = True) -> str | None:
    """Why to fence now, or None to keep the worker.

    ``running``: the generation of this node's worker; ``recorded``: the job's generation in etcd (None: etcd did
    not answer); ``silent``: seconds since the last message from any coordinator; ``leader_known_for``: seconds
    since this agent learnt of the coordinator that leads now (None: none yet); ``recorded_running``: etcd
    records the job's generation as running.
    """
    if recorded is not None and recorded != running:
        return f"fencing: the job is at generation {recorded} in etcd, this node runs {running}"
    if recorded == running and not recorded_running:
        return f"fencing: etcd records generation {running} as stopping, and no coordinator reaches this node"
    if recorded is None and silent is not None and silent > fence_after:
        return f"fencing: neither a coordinator nor etcd answered for {silent:.1f}s"
    if leader_known_for is not None and leader_known_for > fence_after:
        return f"fencing: the new coordinator has not taken this node in after {leader_known_for:.1f}s"
    return None
