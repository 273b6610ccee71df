"""Fuzz of the gRPC messages with Hypothesis, over real Session and GetStatus calls to a real coordinator that
runs a job with two members (tests/rpc_harness.py). Every input gets a clear status, or is accepted where the
protocol accepts it; the job's state, generation, members and restarts stay as they were, and afterwards the
coordinator is healthy and still heartbeats its members.

Examples are derandomized, so a run is reproducible; 200 per test keep the module under half a minute.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.bounds import check_message, validate_join
from tfelastic.daemon.rendezvous.limits import MAX_REQUEST_BYTES, Limits
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

from tests.fuzz_strategies import LEAVES, MESSAGES, PAYLOADS, REPORTS
from tests.rpc_harness import SPEC, FormedJob, Outcome, formed_job, join_message

pytestmark = [pytest.mark.integration, pytest.mark.quick]

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Per-peer rate limiting has its own test; here it would only turn the 200 status calls into refusals.
NO_PEER_LIMIT = Limits(peer_calls_per_second=1e9, peer_burst=1e9)
OVERSIZED = "Received message larger than max"


@pytest.fixture
def job() -> Iterator[FormedJob]:
    with formed_job(NO_PEER_LIMIT) as formed:
        yield formed


def expected_first(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """What the coordinator must answer to ``payload`` as the first message of a session: the status, and
    how its details begin."""
    if len(payload) > MAX_REQUEST_BYTES:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, OVERSIZED
    try:
        message = pb.AgentMessage.FromString(payload)
    except DecodeError:
        return grpc.StatusCode.INVALID_ARGUMENT, "malformed AgentMessage: the bytes do not parse"
    if message.WhichOneof("kind") != "join":
        try:
            check_message(message)  # the bounds are checked first, whatever the message's place
        except api.ProtocolError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, str(e)
        return grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be a Join"
    join = message.join
    try:
        validate_join(join)
    except api.ProtocolError as e:
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)  # each problem, naming its field
    if convert.spec_from_proto(join.spec) != SPEC:
        return grpc.StatusCode.FAILED_PRECONDITION, "refused: this agent's job settings differ from job 'fuzz' ("
    if join.node_id in ("a", "b"):  # the members, with another incarnation
        return grpc.StatusCode.ALREADY_EXISTS, f"node id {join.node_id!r} is already in the job"
    return grpc.StatusCode.OK, ""  # a valid Join: a standby, gone again when the session ends


def test_fuzzed_first_messages(job: FormedJob) -> None:
    expected_summary = job.summary()

    @FUZZ
    @given(st.one_of(PAYLOADS, MESSAGES.map(lambda m: m.SerializeToString()).filter(lambda b: len(b) > 100)))
    def first_message(payload: bytes) -> None:
        outcome = job.session([payload])
        code, details = expected_first(payload)
        event(f"{code.name}: {details[:40]}")  # pytest --hypothesis-show-statistics shows what was reached
        assert outcome.code is code, (outcome, payload[:200])
        assert outcome.details.startswith(details), (outcome, details)
        if code is grpc.StatusCode.OK:
            assert outcome.waited_as_standby, outcome  # the job is at max_nodes
            # A coordinator continues the restart count a joining agent reports (after a failover, it starts
            # from zero); nothing else of a valid Join changes the job.
            join = pb.AgentMessage.FromString(payload).join
            expected_summary["restarts_total"] = max(expected_summary["restarts_total"], join.restart_count)
        else:
            assert outcome.kinds == []  # refused before anything reached the state machine
        assert job.summary() == expected_summary

    first_message()
    job.assert_healthy()


FOLLOW_UPS = st.one_of(
    st.just(pb.AgentMessage(heartbeat=pb.Heartbeat())).map(lambda m: m.SerializeToString()),
    REPORTS.map(lambda r: pb.AgentMessage(report=r).SerializeToString()),
    LEAVES.map(lambda leave: pb.AgentMessage(leave=leave).SerializeToString()),
    PAYLOADS,
)
# How a session that joined may end, and how the details begin.
CLEAR_ENDINGS = {
    grpc.StatusCode.OK: ("",),
    grpc.StatusCode.INVALID_ARGUMENT: ("invalid WorkerReport: ", "invalid Leave: ", "invalid Join: ",
                                       "malformed AgentMessage: ", "unexpected message None",
                                       "node id "),  # a Join naming another node than the session's
    grpc.StatusCode.FAILED_PRECONDITION: ("refused: this agent's job settings differ",),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (OVERSIZED,),
}


def test_fuzzed_messages_from_a_standby(job: FormedJob) -> None:
    """A node that joined as a standby, then sends anything: a report from a non-member is ignored, a Leave
    takes it out, anything out of bounds ends its session; the members never notice."""
    before = job.summary()
    numbers = itertools.count()

    @FUZZ
    @given(st.lists(FOLLOW_UPS, min_size=1, max_size=4))
    def follow_ups(payloads: list[bytes]) -> None:
        node_id = f"standby-{next(numbers)}"
        outcome = job.session([join_message(node_id).SerializeToString(), *payloads])
        assert outcome.code in CLEAR_ENDINGS, outcome
        event(f"{outcome.code.name}: {outcome.details[:30]}")
        assert outcome.details.startswith(CLEAR_ENDINGS[outcome.code]), outcome
        assert outcome.kinds[:1] == ["waiting"] or outcome.details.startswith(OVERSIZED), outcome
        after = job.summary()
        # A Join again on the session (its own node id and the job's spec) may carry a restart count.
        rejoins = [m.join.restart_count for m in _parsed(payloads) if m.WhichOneof("kind") == "join"]
        assert before["restarts_total"] <= after["restarts_total"] <= max([before["restarts_total"], *rejoins])
        assert {k: v for k, v in after.items() if k != "restarts_total"} == \
               {k: v for k, v in before.items() if k != "restarts_total"}

    follow_ups()
    job.assert_healthy()


def _parsed(payloads: list[bytes]) -> Iterator[pb.AgentMessage]:
    for payload in payloads:
        try:
            yield pb.AgentMessage.FromString(payload)
        except DecodeError:
            continue


def test_fuzzed_status_requests(job: FormedJob) -> None:
    before = job.summary()

    @FUZZ
    @given(st.binary(max_size=300))
    def status_request(payload: bytes) -> None:
        outcome: Outcome = job.get_status(payload)
        try:
            pb.StatusRequest.FromString(payload)  # no fields: anything well-formed parses (unknown fields)
        except DecodeError:
            assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
            assert outcome.details.startswith("malformed request: the bytes do not parse"), outcome
        else:
            assert outcome.code is grpc.StatusCode.OK, outcome
        assert job.summary() == before

    status_request()
    job.assert_healthy()
