"""Fuzz of the coordinator's input checks (validate_join, check_message) with Hypothesis: whatever comes in,
they raise ProtocolError or nothing, and what they let through is bounded (the bounds written out here, so that
a comparison that NaN slips through, or a forgotten field, shows up)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.bounds import check_message, validate_join
from tfelastic.daemon.rendezvous.limits import MAX_REQUEST_BYTES
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

from tests.fuzz_strategies import JOINS, LEAVES, REPORTS

FUZZ = settings(max_examples=500, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def accepted(check: object, message: object) -> bool:
    try:
        check(message)  # type: ignore[operator]
    except api.ProtocolError as e:
        assert str(e).startswith("invalid "), e  # names the message type, then each problem
        return False
    return True


def finite_in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


@FUZZ
@given(JOINS)
def test_an_accepted_join_is_bounded(join: pb.Join) -> None:
    if not accepted(validate_join, join):
        return
    spec = join.spec
    assert 1 <= len(join.node_id) <= 128 and join.node_id.isascii() and " " not in join.node_id
    assert 1 <= len(join.host) <= 255 and join.host.isprintable() and " " not in join.host
    assert 1 <= join.worker_port <= 65535
    assert join.last_generation <= 2**53 and join.restart_count <= 2**31
    assert -1 <= join.last_rank < 100_000 and len(join.incarnation) <= 64
    assert 1 <= len(spec.job) <= 128 and len(spec.command_digest) == 32 and len(spec.backup_dir) <= 4096
    assert 1 <= spec.min_nodes <= spec.max_nodes <= 100_000 and spec.max_restarts <= 100_000
    for timing in (spec.restart_window_seconds, spec.stall_timeout_seconds, spec.heartbeat_interval_seconds,
                   spec.node_timeout_seconds):
        assert finite_in(timing, 0, 1e9)
    assert pb.AgentMessage(join=join).ByteSize() < MAX_REQUEST_BYTES  # anything valid fits the request limit
    convert.spec_from_proto(spec).differences(convert.spec_from_proto(spec))  # and converts cleanly


@FUZZ
@given(REPORTS)
def test_an_accepted_report_is_bounded(report: pb.WorkerReport) -> None:
    if not accepted(check_message, pb.AgentMessage(report=report)):
        return
    assert report.generation <= 2**53 and report.pid >= 0 and report.gpus <= 4096
    assert len(report.detail) <= 4096
    assert finite_in(report.gpu_utilization, 0.0, 1.0)
    p = report.progress
    assert finite_in(p.age_seconds, 0, 1e9)
    assert p.checkpoint_age_seconds == -1.0 or finite_in(p.checkpoint_age_seconds, 0, 1e9)
    assert math.isfinite(p.steps_per_second)
    assert 0 <= p.step <= 2**53 and 0 <= p.examples <= 2**53 and -1 <= p.checkpoint_step <= 2**53


@FUZZ
@given(LEAVES)
def test_an_accepted_leave_is_bounded(leave: pb.Leave) -> None:
    if accepted(check_message, pb.AgentMessage(leave=leave)):
        assert len(leave.reason) <= 1024
