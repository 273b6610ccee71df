"""`tfelastic status`: the cluster as the coordinator sees it, as a table or as JSON.

The JSON shape is a stable contract (docs/status-json.md); fields are only ever added.
"""

from __future__ import annotations

import time
from typing import Any

from tfelastic.daemon.netutil import host_port
from tfelastic.daemon.rendezvous.api import ClusterStatus, GoodputView, NodeStatus, RestartReason
from tfelastic.daemon.rendezvous.bounds import printable
from tfelastic.daemon.rendezvous.roles import WORKER, Task

SCHEMA_VERSION = 1


def status_to_json(snap: ClusterStatus, now: float | None = None, wall: float | None = None) -> dict[str, Any]:
    """``now``: a reading of the clock the snapshot's times are on (default: this process's monotonic clock, as
    :func:`~tfelastic.daemon.rendezvous.client.fetch_status` converts them); ``wall``: the wall clock then."""
    now = time.monotonic() if now is None else now
    wall = time.time() if wall is None else wall
    return {
        "schema_version": SCHEMA_VERSION,
        "job": snap.job,
        "state": snap.state.value if snap.state is not None else "unknown",
        "reason": snap.reason,
        "generation": snap.generation,
        "world_size": snap.world_size,
        "min_nodes": snap.min_nodes,
        "max_nodes": snap.max_nodes,
        "max_restarts": snap.max_restarts,
        "restarts_total": snap.restarts_total,
        "restarts_by_reason": dict(snap.restarts_by_reason),
        "nodes": [_node_json(n, now, wall) for n in snap.nodes],
        "warnings": list(snap.warnings),
        "steps_redone": snap.steps_redone,
        "steps_lost": snap.steps_lost,
        "coordinator": None if snap.coordinator is None else {
            "node": snap.coordinator.node, "address": snap.coordinator.address,
            "since": round(snap.coordinator.since, 3), "version": snap.coordinator.version or None,
            "protocol": snap.coordinator.protocol or None},
        "quarantines_by_kind": dict(snap.quarantines_by_kind),
        "goodput": goodput_json(snap.goodput),
        "vacant": list(snap.vacant),
        "last_restart": last_restart_json(snap.goodput),
    }


_RESTART_PREFIXES = tuple(f"{reason.value}: " for reason in RestartReason)


def last_restart_json(view: GoodputView | None) -> dict[str, Any] | None:
    """The most recent generation that ended in a restart, the one under way included, and the ledger's words for
    why: the reason, the node and its detail (a hang's site, an exit's exception). A job's end is no restart
    (its words do not start with a restart's reason). None before the first restart."""
    restarted = [g for g in (view.generations if view is not None else ()) if g.ended.startswith(_RESTART_PREFIXES)]
    if not restarted:
        return None
    return {"generation": restarted[-1].generation, "ended": restarted[-1].ended}


def goodput_json(view: GoodputView | None) -> dict[str, Any] | None:
    """The ledger's totals: goodput (training over wall time), every category's seconds, the badput largest
    first. None from a coordinator that keeps no ledger."""
    if view is None:
        return None
    wall = sum(view.seconds.values())
    badput = sorted(((c, s) for c, s in view.seconds.items() if c != "training" and s > 0), key=lambda x: -x[1])
    return {"ratio": round(view.seconds.get("training", 0.0) / wall, 4) if wall > 0 else None,
            "wall_seconds": round(wall, 3),
            "seconds": {c: round(s, 3) for c, s in view.seconds.items()},
            "steps_redone": view.steps_redone,
            "badput": [{"category": c, "seconds": round(s, 3), "share": round(s / wall, 4)} for c, s in badput]}


def timeline_json(view: GoodputView | None) -> list[dict[str, Any]]:
    """The ledger's generations, oldest first (``tfelastic report``)."""
    if view is None:
        return []
    return [{"generation": g.generation, "formed_at": round(g.formed_at, 3), "size": g.size,
             "members": list(g.members), "restored_step": g.restored_step,
             "startup_seconds": None if g.startup_seconds is None else round(g.startup_seconds, 3),
             "steps_redone": g.steps_redone, "ended": g.ended,
             "badput_seconds": round(sum(s for c, s in g.seconds.items() if c != "training"), 3),
             "seconds": {c: round(s, 3) for c, s in g.seconds.items()},
             "reached_step": g.reached_step} for g in view.generations]


def marks_json(view: GoodputView | None) -> list[dict[str, Any]]:
    """The nodes' events on the timeline that no generation's line records, oldest first: quarantines,
    readmissions, drains."""
    if view is None:
        return []
    return [{"at": round(m.at, 3), "kind": m.kind, "node": m.node, "detail": m.detail} for m in view.marks]


def _node_json(node: NodeStatus, now: float, wall: float) -> dict[str, Any]:
    progress = node.progress
    checkpoint_at = progress.checkpoint_at if progress else None
    return {
        "node_id": node.node_id,
        "rank": node.rank if node.rank >= 0 else None,
        "address": host_port(node.host, node.worker_port),
        "state": node.state.value,
        "worker_pid": node.worker_pid or None,
        "step": progress.step if progress else None,
        "loss": progress.loss if progress else None,
        "last_checkpoint_step": progress.checkpoint_step if progress and progress.checkpoint_step >= 0 else None,
        "progress_age_seconds": round(max(0.0, now - progress.reported_at), 3) if progress else None,
        "steps_per_second": round(progress.steps_per_second, 3) if progress else None,
        "last_checkpoint_age_seconds": round(max(0.0, now - checkpoint_at), 3) if checkpoint_at is not None else None,
        "gpus": node.gpus,
        "gpu_utilization": round(node.gpu_utilization, 3) if node.gpus else None,
        "version": node.version or None,
        "quarantine": None if node.quarantined_until is None else {
            "kind": node.quarantine_kind, "reason": node.quarantine_reason,
            "seconds_left": round(max(0.0, node.quarantined_until - now), 3),
            "until": round(wall + max(0.0, node.quarantined_until - now), 3)},
        "role": node.role or None,
        **_task_json(node),
        "replacements": node.replacements,
    }


def _task_json(node: NodeStatus) -> dict[str, Any]:
    """Its task as TF_CONFIG names it: a parameter-server job's role split in two, a mirrored member a worker
    whose index is its rank; None for both outside the generation."""
    task = Task.parse(node.role) if node.role else (Task(WORKER, node.rank) if node.rank >= 0 else None)
    return {"task_type": task.type if task else None, "task_index": task.index if task else None}


def terminal_safe(text: str) -> str:
    """Text for a terminal: its lines kept, every character that is not printable (an escape sequence from a peer's
    reply or a job state in etcd) shown as '?'."""
    return "\n".join(printable(line, len(line)) for line in text.split("\n"))


def render_table(doc: dict[str, Any]) -> str:
    restarts = ", ".join(f"{k}={v}" for k, v in sorted(doc["restarts_by_reason"].items())) or "none"
    lines = [
        f"job {doc['job']}: {doc['state']}" + (f" ({doc['reason']})" if doc["reason"] else ""),
        f"generation {doc['generation']}, world size {doc['world_size']} "
        f"(min {doc['min_nodes']}, max {doc['max_nodes']})",
        f"restarts: {doc['restarts_total']} ({restarts}); budget {doc['max_restarts']} failures per window",
        *([f"coordinator: {c['node']} at {c['address']}" + (f" (tfelastic {c['version']})" if c.get("version")
                                                               else "")] if (c := doc.get("coordinator")) else []),
        *_versions_line(doc),
        *([goodput_line(g)] if (g := doc.get("goodput")) and g["ratio"] is not None else []),
        *([f"last restart: generation {r['generation']} ended: {r['ended']}"]
          if (r := doc.get("last_restart")) else []),
        *(f"WARNING: {warning}" for warning in doc.get("warnings", ())),
        *(_quarantine_line(n) for n in doc["nodes"] if n.get("quarantine")),
        *(f"vacant: {task}" for task in doc.get("vacant", ())),
        "",
    ]
    roles = any(n.get("role") for n in doc["nodes"])  # a parameter-server job: a ROLE column
    header = ("NODE", "RANK", *(("ROLE",) if roles else ()), "ADDRESS", "STATE", "PID", "STEP", "STEPS/S",
              "LAST PROGRESS", "LAST CHECKPOINT", "GPUS")
    rows = [header] + [(
        n["node_id"], _dash(n["rank"]), *((_role(n),) if roles else ()), n["address"], n["state"],
        _dash(n["worker_pid"]), _dash(n["step"]),
        "-" if n["steps_per_second"] is None else f"{n['steps_per_second']:.1f}",
        _ago(n["progress_age_seconds"]), _ago(n["last_checkpoint_age_seconds"]),
        "-" if n["gpu_utilization"] is None else f"{n['gpus']} at {100 * n['gpu_utilization']:.0f}%",
    ) for n in doc["nodes"]]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines += ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    return "\n".join(lines)


def _role(node: dict[str, Any]) -> str:
    """Its task, and how often its worker was replaced alone."""
    role = node.get("role") or "-"
    return f"{role} (replaced {node['replacements']}x)" if node.get("replacements") else role


def _versions_line(doc: dict[str, Any]) -> list[str]:
    """A line only while the nodes run different versions (an upgrade under way)."""
    by_version: dict[str, list[str]] = {}
    for node in doc["nodes"]:
        by_version.setdefault(node.get("version") or "older", []).append(node["node_id"])
    if len(by_version) < 2:
        return []
    return ["versions: " + "; ".join(f"{v} on {', '.join(nodes)}" for v, nodes in sorted(by_version.items()))]


def goodput_line(goodput: dict[str, Any]) -> str:
    """``goodput 91.2% of 2h03m; badput: startup 4.1%, redone 2.3%, detection 1.0%`` (the three largest)."""
    top = ", ".join(f"{b['category']} {100 * b['share']:.1f}%" for b in goodput["badput"][:3]) or "none"
    return f"goodput {100 * goodput['ratio']:.1f}% of {duration(goodput['wall_seconds'])}; badput: {top}"


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def render_report(doc: dict[str, Any], timeline: list[dict[str, Any]]) -> str:
    """The job's timeline, a line per generation, then the totals (``tfelastic report``)."""
    lines = [f"job {doc['job']}: {doc['state']}" + (f" ({doc['reason']})" if doc["reason"] else ""), ""]
    rows = render_report_rows(timeline)
    header = rows[0]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines += ["  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]])
              for row in rows]
    goodput = doc.get("goodput")
    if goodput is None:
        return "\n".join([*lines, "", "no goodput ledger: the coordinator is of an older version"])
    lines += ["", goodput_line(goodput) if goodput["ratio"] is not None else "goodput: no generation formed yet"]
    wall = goodput["wall_seconds"] or 1.0
    lines += [f"  {c:<10} {duration(s):>8}  {100 * s / wall:5.1f}%" for c, s in goodput["seconds"].items()]
    return "\n".join(lines)


def render_report_rows(timeline: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The per-generation table of ``report``: its header, then a row per generation."""
    header = ("GEN", "FORMED", "MEMBERS", "RESTORED", "REDONE", "STARTUP", "BADPUT", "ENDED")
    return [header] + [(
        str(g["generation"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(g["formed_at"])),
        _members(g), _dash(g["restored_step"]), str(g["steps_redone"]),
        "-" if g["startup_seconds"] is None else f"{g['startup_seconds']:.1f}s", duration(g["badput_seconds"]),
        g["ended"] or "(running)") for g in timeline]


def _members(line: dict[str, Any]) -> str:
    listed = ",".join(line["members"])
    return listed if line["size"] <= len(line["members"]) else f"{line['size']} ({listed},...)"


def _quarantine_line(node: dict[str, Any]) -> str:
    q = node["quarantine"]
    when = "waiting for its node check" if q["seconds_left"] <= 0 else \
        f"until {time.strftime('%H:%M:%S', time.localtime(q['until']))} ({q['seconds_left']:.0f}s)"
    return f"QUARANTINED: {node['node_id']} {when}: {q['reason']} (lift: tfelastic readmit {node['node_id']})"


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
