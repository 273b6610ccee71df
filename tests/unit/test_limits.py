"""The coordinator's limits as plain code: token buckets and the per-peer table over a fake clock, the session
cap, and the field bounds of WorkerReport and Leave. No sockets, no sleeps."""

from __future__ import annotations

from typing import Any

import pytest
from tfelastic.daemon.rendezvous.api import ProtocolError
from tfelastic.daemon.rendezvous.bounds import check_message
from tfelastic.daemon.rendezvous.limits import (
    MAX_REQUEST_BYTES,
    Limits,
    PeerBuckets,
    SessionGate,
    TokenBucket,
    peer_address,
)
from tfelastic.daemon.rpc import rendezvous_pb2 as pb


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def takes(bucket: TokenBucket, now: float, n: int) -> int:
    """How many of ``n`` takes at ``now`` succeed."""
    return sum(bucket.take(now) for _ in range(n))


def test_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=8, burst=4, now=0.0)  # times below are exact in binary floating point
    assert takes(bucket, 0.0, 8) == 4  # starts full: the burst, then nothing
    assert takes(bucket, 0.5, 8) == 4  # half a second refills 4 tokens
    assert takes(bucket, 0.625, 8) == 1  # 1/8 s: one token
    assert takes(bucket, 100.0, 20) == 4  # a long pause saves up no more than the burst


def test_bucket_sustains_exactly_its_rate() -> None:
    bucket = TokenBucket(rate=4, burst=1, now=0.0)
    assert bucket.take(0.0)
    granted = sum(bucket.take(i * 0.125) for i in range(1, 81))  # 10 s, asking 8/s
    assert granted == 40  # 4/s


def test_bucket_ignores_a_clock_that_goes_backwards() -> None:
    bucket = TokenBucket(rate=1, burst=1, now=10.0)
    assert bucket.take(10.0)
    assert not bucket.take(5.0)  # going back must not mint tokens
    assert not bucket.take(10.5)
    assert bucket.take(11.0)


@pytest.mark.parametrize(("rate", "burst"), [(0, 5), (-1, 5), (1, 0.5)])
def test_bucket_refuses_nonsense(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="rate > 0 and burst >= 1"):
        TokenBucket(rate, burst, 0.0)


def test_peer_buckets_are_separate_and_bounded() -> None:
    clock = FakeClock()
    peers = PeerBuckets(rate=1, burst=2, max_peers=2, clock=clock)
    assert [peers.take("a") for _ in range(3)] == [True, True, False]
    assert peers.take("b")  # another peer has its own bucket
    assert not peers.take("a")  # "a" is now the most recently seen, "b" the least
    assert peers.take("c")  # a third peer: "b" is dropped, so the table stays at max_peers
    assert len(peers) == 2
    assert not peers.take("a")  # "a" stayed in the table with its spent bucket
    clock.now += 1.0
    assert peers.take("a")  # one token per second


@pytest.mark.parametrize(("peer", "address"), [
    ("ipv4:10.0.0.1:5555", "ipv4:10.0.0.1"),
    ("ipv6:[::1]:41000", "ipv6:[::1]"),
    ("unix:/run/tfelastic.sock", "unix:/run/tfelastic.sock"),
])
def test_peer_address_drops_the_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address


def test_session_cap_follows_max_nodes_up_to_the_hard_cap() -> None:
    limits = Limits(session_hard_cap=1000)
    assert limits.max_sessions(None) == 1000  # before the first Join the job's size is unknown
    assert limits.max_sessions(4) == 72
    assert limits.max_sessions(10_000) == 1000


def test_session_gate_refuses_beyond_the_cap_and_frees_slots() -> None:
    max_nodes: int | None = None
    gate = SessionGate(Limits(session_hard_cap=66), lambda: max_nodes)
    assert all(gate.admit() is None for _ in range(66))
    refusal = gate.admit()
    assert refusal is not None and "66 sessions" in refusal and "at most 66" in refusal
    gate.release()
    assert gate.admit() is None
    max_nodes = 1  # the job turned out small: 2 x 1 + 64 = 66, still full
    assert gate.admit() is not None
    assert gate.open == 66


def test_session_rate_scales_with_a_short_heartbeat() -> None:
    limits = Limits()
    assert limits.session_rate(0.5) == limits.session_messages_per_second
    assert limits.session_rate(0.01) == pytest.approx(2000)  # 20x the heartbeat rate


def test_largest_legitimate_join_fits_the_request_limit_tenfold() -> None:
    spec = pb.JobSpec(job="j" * 128, command_digest=b"\xff" * 32, min_nodes=100_000, max_nodes=100_000,
                      max_restarts=100_000, restart_window_seconds=1e9, stall_timeout_seconds=1e9,
                      backup_dir="d" * 4096, heartbeat_interval_seconds=1e9, node_timeout_seconds=1e9)
    join = pb.Join(node_id="n" * 128, spec=spec, host="h" * 255, worker_port=65535, last_generation=2**53,
                   restart_count=2**31, incarnation="i" * 64, last_rank=99_999)
    size = pb.AgentMessage(join=join).ByteSize()
    assert 4096 < size < MAX_REQUEST_BYTES / 10


def report(**fields: Any) -> pb.AgentMessage:
    progress = fields.pop("progress", {})
    return pb.AgentMessage(report=pb.WorkerReport(progress=pb.Progress(**progress), **fields))


@pytest.mark.parametrize("message", [
    pb.AgentMessage(heartbeat=pb.Heartbeat()),
    pb.AgentMessage(),  # no kind: the servicer refuses it as unexpected, the bounds have nothing to say
    report(generation=3, status=pb.WORKER_STATUS_FAILED, exit_code=-9, pid=1234, detail="x" * 4096, gpus=8,
           gpu_utilization=1.0, has_progress=True,
           progress={"step": 2**53, "loss": float("nan"), "has_loss": True, "examples": 2**53, "age_seconds": 0.25,
                     "checkpoint_step": -1, "steps_per_second": -3.0, "checkpoint_age_seconds": -1.0}),
    report(progress={"loss": float("inf"), "checkpoint_age_seconds": 1e9, "age_seconds": 1e9}),
    pb.AgentMessage(leave=pb.Leave(reason="r" * 1024)),
], ids=["heartbeat", "empty", "report-at-the-bounds", "report-inf-loss", "leave-at-the-bound"])
def test_what_an_agent_sends_passes(message: pb.AgentMessage) -> None:
    check_message(message)


@pytest.mark.parametrize(("message", "named"), [
    (report(generation=2**53 + 1), "WorkerReport: generation"),
    (report(pid=-1), "WorkerReport: pid -1"),
    (report(detail="x" * 4097), "WorkerReport: detail has 4097 characters"),
    (report(gpus=4097), "WorkerReport: gpus 4097"),
    (report(gpu_utilization=float("nan")), "WorkerReport: gpu_utilization nan"),
    (report(gpu_utilization=1.5), "WorkerReport: gpu_utilization 1.5"),
    (report(progress={"age_seconds": -1.0}), "WorkerReport: progress.age_seconds -1.0"),
    (report(progress={"age_seconds": float("inf")}), "WorkerReport: progress.age_seconds inf"),
    (report(progress={"checkpoint_age_seconds": -0.5}), "WorkerReport: progress.checkpoint_age_seconds -0.5"),
    (report(progress={"steps_per_second": float("nan")}), "WorkerReport: progress.steps_per_second nan"),
    (report(progress={"step": 2**62}), "WorkerReport: progress.step 4611686018427387904 is out of range"),
    (report(progress={"step": -5}), "WorkerReport: progress.step -5 is out of range"),
    (report(progress={"examples": 2**53 + 1}), "WorkerReport: progress.examples 9007199254740993"),
    (report(progress={"checkpoint_step": -2}), "WorkerReport: progress.checkpoint_step -2"),
    (pb.AgentMessage(leave=pb.Leave(reason="r" * 1025)), "Leave: reason has 1025 characters"),
], ids=["generation", "pid", "detail", "gpus", "gpu-nan", "gpu-above-1", "age-negative", "age-inf",
        "checkpoint-age", "steps-per-second-nan", "step-huge", "step-negative", "examples", "checkpoint-step",
        "leave-reason"])
def test_out_of_bounds_fields_are_refused_naming_them(message: pb.AgentMessage, named: str) -> None:
    with pytest.raises(ProtocolError, match=r"^invalid " + named.replace("(", r"\(").replace(".", r"\.")):
        check_message(message)


def test_every_problem_of_a_report_is_named_at_once() -> None:
    with pytest.raises(ProtocolError) as refused:
        check_message(report(pid=-1, gpus=5000))
    assert "pid -1" in str(refused.value) and "gpus 5000" in str(refused.value)
