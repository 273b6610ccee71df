"""Whatever a coordinator replies, `status`, `status --json`, `report` and `report --html` show it: no crash, strict
JSON, nothing unprintable on the terminal, no markup of the peer's in the page (convert.status_from_proto is the
border where a reply is made safe to show)."""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from tfelastic.daemon.rendezvous import convert
from tfelastic.daemon.rendezvous.api import NodeState
from tfelastic.daemon.report_page import render_page
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.status import (
    marks_json,
    render_report,
    render_table,
    status_to_json,
    terminal_safe,
    timeline_json,
)
from tfelastic.daemon.timeline import lay_out

from tests.fuzz_strategies import messages

NOW, WALL = 5000.0, 1_800_000_000.0


def shown(status: pb.ClusterStatus) -> tuple[dict[str, object], str, str, str]:
    """What status --json, status, report and report --html make of a reply."""
    snap = convert.status_from_proto(status, NOW)
    doc = status_to_json(snap, NOW, WALL)
    report = {**doc, "generations": timeline_json(snap.goodput), "marks": marks_json(snap.goodput), "at": WALL}
    return (json.loads(json.dumps(doc, allow_nan=False)), terminal_safe(render_table(doc)),
            terminal_safe(render_report(report, report["generations"])), render_page(lay_out(report), report))


def printable_lines(text: str) -> bool:
    return all(line.isprintable() for line in text.split("\n"))


@given(messages(pb.ClusterStatus))
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_any_reply_is_shown_without_a_crash_as_strict_json_and_printable_text(status: pb.ClusterStatus) -> None:
    doc, table, report, page = shown(status)
    assert printable_lines(table) and printable_lines(report)
    assert "<script" not in page and page.startswith("<!DOCTYPE html>")
    assert isinstance(doc["job"], str) and doc["job"].isprintable()


def test_odd_values_of_a_newer_or_broken_coordinator_are_shown_not_fatal() -> None:
    status = pb.ClusterStatus(job="demo\x1b[2J", reason="\x1b]0;owned\x07", state=99, nodes=[  # type: ignore[arg-type]
        pb.NodeStatus(node_id="a\x1b[31m", state="hibernating", gpus=1, gpu_utilization=math.nan,
                      has_progress=True, progress=pb.Progress(step=5, loss=math.inf, has_loss=True,
                                                              age_seconds=-1e300, steps_per_second=math.nan))],
        goodput=pb.Goodput(seconds=[pb.CategorySeconds(category="training", seconds=-5.0),
                                    pb.CategorySeconds(category="startup", seconds=5.0)],
                           generations=[pb.GenerationLine(generation=1, formed_at=1e300, size=1, members=["a"])]))
    snap = convert.status_from_proto(status, NOW)
    assert snap.nodes[0].state is NodeState.UNKNOWN and snap.state is None
    doc, table, report, _ = shown(status)
    node = doc["nodes"][0]  # type: ignore[index]
    assert (node["state"], node["loss"], node["gpu_utilization"], node["steps_per_second"]) == (
        "unknown", None, 0.0, 0.0)
    assert doc["job"] == "demo?[2J" and doc["reason"] == "?]0;owned?"
    assert doc["goodput"]["seconds"] == {"training": 0.0, "startup": 5.0}  # type: ignore[index]
    assert "job demo?[2J: unknown" in table and "\x1b" not in table + report
