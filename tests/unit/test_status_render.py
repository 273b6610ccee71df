"""`tfelastic status` output (:mod:`tfelastic.daemon.status`): the JSON document is a stable contract, so its
keys and values are asserted exactly; the table is asserted line by line."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from tfelastic.daemon.rendezvous import convert
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.status import SCHEMA_VERSION, render_table, status_to_json

TOP_KEYS = ["schema_version", "job", "state", "reason", "generation", "world_size", "min_nodes", "max_nodes",
            "max_restarts", "restarts_total", "restarts_by_reason", "nodes", "warnings", "steps_redone", "steps_lost",
            "coordinator", "quarantines_by_kind", "goodput", "vacant", "last_restart"]
NODE_KEYS = ["node_id", "rank", "address", "state", "worker_pid", "step", "loss", "last_checkpoint_step",
             "progress_age_seconds", "steps_per_second", "last_checkpoint_age_seconds", "gpus", "gpu_utilization",
             "version", "quarantine", "role", "task_type", "task_index", "replacements"]
WALL = 1795000000.0


def to_json(status: pb.ClusterStatus, now: float = 0.0) -> dict[str, Any]:
    """What `tfelastic status` prints for what the coordinator sent: through the border, on the client's clock."""
    return status_to_json(convert.status_from_proto(status, now), now, WALL)


def cluster_status(**overrides: Any) -> pb.ClusterStatus:
    """Two members with progress (one with a loss and a checkpoint, one without either) and one standby."""
    fields: dict[str, Any] = dict(
        job="mnist", state=pb.JOB_STATE_RUNNING, reason="", generation=3, world_size=2, min_nodes=2, max_nodes=2,
        max_restarts=3, restarts_total=2,
        restarts_by_reason=[pb.RestartCount(reason="worker_exit", count=1),
                            pb.RestartCount(reason="scale_up", count=1)],
        nodes=[
            pb.NodeStatus(node_id="node-a", rank=0, host="10.0.0.1", worker_port=2222, state="running",
                          worker_pid=4242, has_progress=True, gpus=8, gpu_utilization=0.875,
                          progress=pb.Progress(step=120, loss=0.25, has_loss=True, examples=7680,
                                               age_seconds=1.23456, checkpoint_step=100, steps_per_second=12.5,
                                               checkpoint_age_seconds=30.25)),
            pb.NodeStatus(node_id="node-b", rank=1, host="10.0.0.2", worker_port=2223, state="running",
                          worker_pid=4343, has_progress=True,
                          progress=pb.Progress(step=119, loss=0.0, has_loss=False, age_seconds=0.5,
                                               checkpoint_step=-1, checkpoint_age_seconds=-1)),
            pb.NodeStatus(node_id="spare", rank=-1, host="10.0.0.3", worker_port=0, state="waiting"),
        ],
        coordinator=pb.CoordinatorInfo(node="gpu-01", address="10.0.0.1:29400", since=1795000000.25),
    )
    fields.update(overrides)
    return pb.ClusterStatus(**fields)


def test_status_to_json_has_exactly_the_documented_keys_and_values() -> None:
    doc = to_json(cluster_status())
    assert list(doc) == TOP_KEYS
    assert [list(n) for n in doc["nodes"]] == [NODE_KEYS] * 3
    assert doc == {
        "schema_version": 1,
        "job": "mnist",
        "state": "running",
        "reason": "",
        "generation": 3,
        "world_size": 2,
        "min_nodes": 2,
        "max_nodes": 2,
        "max_restarts": 3,
        "restarts_total": 2,
        "restarts_by_reason": {"worker_exit": 1, "scale_up": 1},
        "nodes": [
            {"node_id": "node-a", "rank": 0, "address": "10.0.0.1:2222", "state": "running", "worker_pid": 4242,
             "step": 120, "loss": 0.25, "last_checkpoint_step": 100, "progress_age_seconds": 1.235,
             "steps_per_second": 12.5, "last_checkpoint_age_seconds": 30.25, "gpus": 8, "gpu_utilization": 0.875,
             "version": None, "quarantine": None, "role": None, "task_type": "worker", "task_index": 0,
             "replacements": 0},
            {"node_id": "node-b", "rank": 1, "address": "10.0.0.2:2223", "state": "running", "worker_pid": 4343,
             "step": 119, "loss": None, "last_checkpoint_step": None, "progress_age_seconds": 0.5,
             "steps_per_second": 0.0, "last_checkpoint_age_seconds": None, "gpus": 0, "gpu_utilization": None,
             "version": None, "quarantine": None, "role": None, "task_type": "worker", "task_index": 1,
             "replacements": 0},
            {"node_id": "spare", "rank": None, "address": "10.0.0.3:0", "state": "waiting", "worker_pid": None,
             "step": None, "loss": None, "last_checkpoint_step": None, "progress_age_seconds": None,
             "steps_per_second": None, "last_checkpoint_age_seconds": None, "gpus": 0, "gpu_utilization": None,
             "version": None, "quarantine": None, "role": None, "task_type": None, "task_index": None,
             "replacements": 0},
        ],
        "warnings": [],
        "steps_redone": 0,
        "steps_lost": 0,
        "coordinator": {"node": "gpu-01", "address": "10.0.0.1:29400", "since": 1795000000.25, "version": None,
                        "protocol": None},
        "quarantines_by_kind": {},
        "goodput": None,  # the proto has no ledger: an older coordinator's status
        "vacant": [],
        "last_restart": None,
    }
    assert SCHEMA_VERSION == 1
    json.dumps(doc)  # serialisable as it is


def test_rank_zero_and_checkpoint_zero_are_values_not_missing() -> None:
    doc = to_json(cluster_status(nodes=[pb.NodeStatus(
        node_id="n", rank=0, host="h", worker_port=1, state="running", worker_pid=7, has_progress=True,
        progress=pb.Progress(step=0, loss=0.0, has_loss=True, age_seconds=0.0, checkpoint_step=0))]))
    node = doc["nodes"][0]
    assert (node["rank"], node["step"], node["loss"], node["last_checkpoint_step"],
            node["progress_age_seconds"]) == (0, 0, 0.0, 0, 0.0)


def test_progress_is_ignored_without_has_progress() -> None:
    doc = to_json(cluster_status(nodes=[pb.NodeStatus(
        node_id="n", rank=1, host="h", worker_port=1, state="stopping", has_progress=False,
        progress=pb.Progress(step=50, loss=1.0, has_loss=True, age_seconds=3.0, checkpoint_step=40))]))
    node = doc["nodes"][0]
    assert (node["step"], node["loss"], node["last_checkpoint_step"], node["progress_age_seconds"]) == (
        None, None, None, None)


@pytest.mark.parametrize(("state", "name"), [
    (pb.JOB_STATE_UNSPECIFIED, "unknown"),
    (pb.JOB_STATE_WAITING, "waiting"),
    (pb.JOB_STATE_RUNNING, "running"),
    (pb.JOB_STATE_RESTARTING, "restarting"),
    (pb.JOB_STATE_SUCCEEDED, "succeeded"),
    (pb.JOB_STATE_FAILED, "failed"),
])
def test_job_state_names(state: int, name: str) -> None:
    assert to_json(cluster_status(state=state))["state"] == name


def test_an_empty_status_is_a_complete_document() -> None:
    doc = to_json(pb.ClusterStatus())
    assert doc == {"schema_version": 1, "job": "", "state": "unknown", "reason": "", "generation": 0,
                   "world_size": 0, "min_nodes": 0, "max_nodes": 0, "max_restarts": 0, "restarts_total": 0,
                   "restarts_by_reason": {}, "nodes": [], "warnings": [], "steps_redone": 0, "steps_lost": 0,
                   "coordinator": None, "quarantines_by_kind": {}, "goodput": None, "vacant": [],
                   "last_restart": None}


def test_render_table() -> None:
    table = render_table(to_json(cluster_status()))
    assert table.splitlines() == [
        "job mnist: running",
        "generation 3, world size 2 (min 2, max 2)",
        "restarts: 2 (scale_up=1, worker_exit=1); budget 3 failures per window",
        "coordinator: gpu-01 at 10.0.0.1:29400",
        "",
        "NODE    RANK  ADDRESS        STATE    PID   STEP  STEPS/S  LAST PROGRESS  LAST CHECKPOINT  GPUS",
        "node-a  0     10.0.0.1:2222  running  4242  120   12.5     1.2s ago       30.2s ago        8 at 88%",
        "node-b  1     10.0.0.2:2223  running  4343  119   0.0      0.5s ago       -                -",
        "spare   -     10.0.0.3:0     waiting  -     -     -        -              -                -",
    ]


def _quarantined(seconds_left: float) -> pb.ClusterStatus:
    return cluster_status(nodes=[pb.NodeStatus(
        node_id="bad", rank=-1, host="10.0.0.9", worker_port=2222, state="quarantined", quarantine_kind="node_check",
        quarantine_reason="node check failed: backup dir /b is not writable", quarantine_seconds_left=seconds_left)],
        quarantines=[pb.QuarantineCount(kind="node_check", count=2)])


def test_a_quarantined_node_says_why_and_until_when() -> None:
    doc = to_json(_quarantined(599.5), now=100.0)
    assert doc["nodes"][0]["state"] == "quarantined"
    assert doc["nodes"][0]["quarantine"] == {"kind": "node_check",
                                             "reason": "node check failed: backup dir /b is not writable",
                                             "seconds_left": 599.5, "until": WALL + 599.5}
    assert doc["quarantines_by_kind"] == {"node_check": 2}
    lines = render_table(doc).splitlines()
    assert lines[4].startswith("QUARANTINED: bad until ")
    assert lines[4].endswith(" (600s): node check failed: backup dir /b is not writable "
                             "(lift: tfelastic readmit bad)")
    assert lines[-1].split()[:4] == ["bad", "-", "10.0.0.9:2222", "quarantined"]


def test_a_quarantined_node_past_its_cooldown_waits_for_its_check() -> None:
    lines = render_table(to_json(_quarantined(0.0))).splitlines()
    assert lines[4] == ("QUARANTINED: bad waiting for its node check: node check failed: backup dir /b is not "
                        "writable (lift: tfelastic readmit bad)")


def test_render_table_has_a_header_and_one_row_per_node() -> None:
    nodes = [pb.NodeStatus(node_id=f"worker-{i}", rank=i, host=f"10.0.1.{i}", worker_port=2000 + i,
                           state="running", worker_pid=100 + i) for i in range(5)]
    lines = render_table(to_json(cluster_status(nodes=nodes))).splitlines()
    header = lines.index("NODE      RANK  ADDRESS        STATE    PID  STEP  STEPS/S  LAST PROGRESS  LAST CHECKPOINT"
                         "  GPUS")
    rows = lines[header + 1:]
    assert len(rows) == 5
    for i, row in enumerate(rows):
        assert row.split() == [f"worker-{i}", str(i), f"10.0.1.{i}:{2000 + i}", "running", str(100 + i), "-", "-",
                               "-", "-", "-"]


def test_render_table_with_a_reason_and_no_restarts_or_nodes() -> None:
    doc = to_json(cluster_status(state=pb.JOB_STATE_FAILED, reason="restart budget exhausted",
                                        restarts_total=0, restarts_by_reason=[], nodes=[]))
    assert render_table(doc).splitlines() == [
        "job mnist: failed (restart budget exhausted)",
        "generation 3, world size 2 (min 2, max 2)",
        "restarts: 0 (none); budget 3 failures per window",
        "coordinator: gpu-01 at 10.0.0.1:29400",
        "",
        "NODE  RANK  ADDRESS  STATE  PID  STEP  STEPS/S  LAST PROGRESS  LAST CHECKPOINT  GPUS",
    ]


def test_warnings_and_steps_lost_are_shown() -> None:
    warning = "generation 4 resumed at step 0, below the checkpoint of step 100 the job had saved: 100 steps lost"
    doc = to_json(cluster_status(warnings=[warning], steps_redone=130, steps_lost=100))
    assert (doc["warnings"], doc["steps_redone"], doc["steps_lost"]) == ([warning], 130, 100)
    assert render_table(doc).splitlines()[4] == f"WARNING: {warning}"


LEDGER = pb.Goodput(
    seconds=[pb.CategorySeconds(category=c, seconds=s) for c, s in (
        ("training", 900.0), ("redone", 30.0), ("startup", 40.0), ("checkpoint", 10.0), ("detection", 15.0),
        ("stopping", 1.0), ("waiting", 3.0), ("other", 1.0))],
    generations=[
        pb.GenerationLine(generation=1, formed_at=WALL, size=2, members=["node-a", "node-b"], restored_step=0,
                          has_restored_step=True, startup_seconds=20.0, has_startup_seconds=True,
                          ended="stalled: node-b: no progress for 15.0s",
                          seconds=[pb.CategorySeconds(category="startup", seconds=20.0),
                                   pb.CategorySeconds(category="training", seconds=500.0),
                                   pb.CategorySeconds(category="detection", seconds=15.0)]),
        pb.GenerationLine(generation=2, formed_at=WALL + 600, size=2, members=["node-a", "node-b"],
                          restored_step=450, has_restored_step=True, startup_seconds=20.0, has_startup_seconds=True,
                          steps_redone=30, seconds=[pb.CategorySeconds(category="training", seconds=400.0)]),
    ], steps_redone=30)


def test_the_goodput_ledger_in_json_and_the_table() -> None:
    doc = to_json(cluster_status(goodput=LEDGER))
    assert doc["goodput"] == {
        "ratio": 0.9, "wall_seconds": 1000.0,
        "seconds": {"training": 900.0, "redone": 30.0, "startup": 40.0, "checkpoint": 10.0, "detection": 15.0,
                    "stopping": 1.0, "waiting": 3.0, "other": 1.0},
        "steps_redone": 30,
        "badput": [{"category": "startup", "seconds": 40.0, "share": 0.04},
                   {"category": "redone", "seconds": 30.0, "share": 0.03},
                   {"category": "detection", "seconds": 15.0, "share": 0.015},
                   {"category": "checkpoint", "seconds": 10.0, "share": 0.01},
                   {"category": "waiting", "seconds": 3.0, "share": 0.003},
                   {"category": "stopping", "seconds": 1.0, "share": 0.001},
                   {"category": "other", "seconds": 1.0, "share": 0.001}]}
    assert render_table(doc).splitlines()[4] == "goodput 90.0% of 16m40s; badput: startup 4.0%, redone 3.0%, " \
                                                "detection 1.5%"


def test_the_last_restart_is_the_last_generation_another_followed_and_the_table_says_why() -> None:
    doc = to_json(cluster_status(goodput=LEDGER))
    assert doc["last_restart"] == {"generation": 1, "ended": "stalled: node-b: no progress for 15.0s"}
    assert render_table(doc).splitlines()[5] == \
        "last restart: generation 1 ended: stalled: node-b: no progress for 15.0s"
    restarting = pb.Goodput(generations=[LEDGER.generations[0]])  # generation 1 stopping: no generation 2 yet
    assert to_json(cluster_status(goodput=restarting))["last_restart"] == doc["last_restart"]
    ended = pb.Goodput(generations=[pb.GenerationLine(generation=1, formed_at=WALL, size=2,
                                                      ended="succeeded: every trainer of generation 1 exited 0")])
    assert to_json(cluster_status(goodput=ended))["last_restart"] is None  # the job's end is no restart


def test_the_report_has_a_line_per_generation_then_the_totals() -> None:
    from tfelastic.daemon.rendezvous.convert import goodput_from_proto
    from tfelastic.daemon.status import render_report, timeline_json

    doc = to_json(cluster_status(goodput=LEDGER))
    timeline = timeline_json(goodput_from_proto(LEDGER))
    assert [(g["generation"], g["restored_step"], g["steps_redone"], g["badput_seconds"]) for g in timeline] == [
        (1, 0, 0, 35.0), (2, 450, 30, 0.0)]
    lines = render_report(doc, timeline).splitlines()
    formed = [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(WALL + t)).split() for t in (0, 600)]
    assert [line.split() for line in lines[2:5]] == [
        ["GEN", "FORMED", "MEMBERS", "RESTORED", "REDONE", "STARTUP", "BADPUT", "ENDED"],
        ["1", *formed[0], "node-a,node-b", "0", "0", "20.0s", "35s", "stalled:", "node-b:", "no", "progress", "for",
         "15.0s"],
        ["2", *formed[1], "node-a,node-b", "450", "30", "20.0s", "0s", "(running)"]]
    assert lines[6] == "goodput 90.0% of 16m40s; badput: startup 4.0%, redone 3.0%, detection 1.5%"
    assert lines[7].split() == ["training", "15m00s", "90.0%"]


def test_nodes_of_different_versions_get_a_line_an_upgrade_is_under_way() -> None:
    nodes = [pb.NodeStatus(node_id=n, rank=r, host="h", worker_port=1, state="running", version=v)
             for n, r, v in (("a", 0, "0.2.0"), ("b", 1, "0.2.0"), ("c", 2, "0.3.0"))]
    doc = to_json(cluster_status(nodes=nodes, coordinator=pb.CoordinatorInfo(
        node="a", address="h:1", since=WALL, version="0.2.0", protocol=1)))
    assert [n["version"] for n in doc["nodes"]] == ["0.2.0", "0.2.0", "0.3.0"]
    assert doc["coordinator"]["version"] == "0.2.0" and doc["coordinator"]["protocol"] == 1
    lines = render_table(doc).splitlines()
    assert "coordinator: a at h:1 (tfelastic 0.2.0)" in lines
    assert "versions: 0.2.0 on a, b; 0.3.0 on c" in lines


def test_a_parameter_server_job_shows_each_nodes_task_and_the_vacant_ones() -> None:
    status = cluster_status(nodes=[
        pb.NodeStatus(node_id="head", rank=0, host="10.0.0.1", worker_port=2222, state="running", role="chief"),
        pb.NodeStatus(node_id="cpu1", rank=1, host="10.0.0.2", worker_port=2222, state="running", role="ps 0"),
        pb.NodeStatus(node_id="gpu1", rank=2, host="10.0.0.3", worker_port=2222, state="running", role="worker 0",
                      replacements=3)])
    status.vacant.append("worker 1: node gpu2 lost (silent for 2.1s)")
    doc = to_json(status)
    assert [(n["role"], n["replacements"]) for n in doc["nodes"]] == [("chief", 0), ("ps 0", 0), ("worker 0", 3)]
    assert [(n["task_type"], n["task_index"]) for n in doc["nodes"]] == [("chief", 0), ("ps", 0), ("worker", 0)]
    assert doc["vacant"] == ["worker 1: node gpu2 lost (silent for 2.1s)"]
    table = render_table(doc)
    assert "vacant: worker 1: node gpu2 lost (silent for 2.1s)" in table
    header, *rows = table.splitlines()[table.splitlines().index("") + 1:]
    assert header.split()[:3] == ["NODE", "RANK", "ROLE"]
    assert rows[2].split()[:5] == ["gpu1", "2", "worker", "0", "(replaced"]


def test_a_mirrored_jobs_table_has_no_role_column() -> None:
    assert "ROLE" not in render_table(to_json(cluster_status()))


def test_the_reports_marks_and_reached_steps_cross_the_wire() -> None:
    from tfelastic.daemon.rendezvous.convert import goodput_from_proto
    from tfelastic.daemon.status import marks_json, timeline_json

    ledger = pb.Goodput()
    ledger.CopyFrom(LEDGER)
    ledger.generations[1].reached_step, ledger.generations[1].has_reached_step = 612, True
    ledger.marks.append(pb.TimelineMark(at=WALL + 30, kind="quarantined", node="node-b", detail="no GPU"))
    view = goodput_from_proto(ledger)
    assert [g["reached_step"] for g in timeline_json(view)] == [None, 612]  # the first line: an older coordinator's
    assert marks_json(view) == [{"at": WALL + 30, "kind": "quarantined", "node": "node-b", "detail": "no GPU"}]
