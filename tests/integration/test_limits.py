"""Bounded resources on a real coordinator with a running job (tests/rpc_harness.py): oversized and malformed
requests, a flooding session, too many sessions, a session that never speaks, a peer that polls too fast.
Each is refused with a clear status, and the job and its members carry on untouched."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tfelastic.daemon.rendezvous.client import call_metadata, open_channel
from tfelastic.daemon.rendezvous.limits import MAX_REQUEST_BYTES, Limits
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

from tests.cluster import wait_for
from tests.rpc_harness import SPEC, TOKEN, FormedJob, formed_job, join_message

pytestmark = [pytest.mark.integration, pytest.mark.quick]

HEARTBEAT = pb.AgentMessage(heartbeat=pb.Heartbeat()).SerializeToString()


def test_oversized_requests_are_refused_and_change_nothing() -> None:
    with formed_job() as job:
        before = job.summary()
        # A Join whose backup_dir alone is past the limit, as the first message and after a valid Join.
        huge = join_message("big", dataclasses.replace(SPEC, backup_dir="x" * MAX_REQUEST_BYTES))
        first = job.session([huge.SerializeToString()])
        later = job.session([join_message("standby").SerializeToString(), huge.SerializeToString()])
        status = job.get_status(b"\x00" * (MAX_REQUEST_BYTES + 1))
        for outcome in (first, later, status):
            assert outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
            assert "Received message larger than max" in outcome.details, outcome
        assert job.summary() == before
        wait_for(lambda: sorted(job.nodes()) == ["a", "b"], 10, "the cut standby to be gone")
        job.assert_healthy()


def test_unparsable_bytes_get_invalid_argument_and_change_nothing() -> None:
    with formed_job() as job:
        before = job.summary()
        garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, a length far past the end
        for outcome in (job.session([garbage]), job.get_status(garbage),
                        job.session([join_message("standby").SerializeToString(), garbage])):
            assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
            assert outcome.details.startswith("malformed "), outcome
            assert "do not parse" in outcome.details
        assert job.summary() == before
        job.assert_healthy()


def test_a_flooding_standby_is_cut_and_the_job_does_not_notice() -> None:
    with formed_job() as job:
        before = job.summary()
        outcome = job.session([join_message("standby").SerializeToString(), *[HEARTBEAT] * 5000])
        assert outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
        # The harness's heartbeat_interval is 0.2 s: 20 / 0.2 = 100 messages/s.
        assert outcome.details.startswith("more than 100 messages/s (burst 200) on one session"), outcome
        assert outcome.kinds[0] == "waiting"  # it had joined, as a standby
        assert job.summary() == before  # a standby's loss restarts nothing
        wait_for(lambda: sorted(job.nodes()) == ["a", "b"], 10, "the cut standby to be gone")
        job.assert_healthy()


def test_a_flooding_member_is_cut_and_counted_as_lost(caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator treats a session it cut like a lost connection: a member's loss restarts the job."""
    with formed_job() as job:
        assert job.summary()["restarts_total"] == 0
        flooder, other = job.agents[1], job.agents[0]
        flooder.flooding = True
        wait_for(lambda: flooder.ended, 60, "the flooding member to be cut")
        # What the member itself sees may be gRPC's INTERNAL: its next write races the end of the call.
        assert "refused b (LimitExceededError): more than 100 messages/s (burst 200) on one session" in caplog.text
        wait_for(lambda: "stop" in other.kinds, 10, "the other member to be told to stop")
        after = job.summary()
        assert after["restarts_by_reason"] == {"node_lost": 1}
        assert other.ended == ""  # the other member's session goes on


def test_sessions_beyond_the_cap_are_refused() -> None:
    # max_nodes 2: 2 x 2 + 64 = 68, capped here at 4 (the two members hold two of them).
    with formed_job(Limits(session_hard_cap=4)) as job:
        before = job.summary()

        async def scenario() -> list[str]:
            outcomes = []
            async with open_channel(job.endpoint) as channel:
                stub = pb_grpc.RendezvousStub(channel)  # type: ignore[no-untyped-call]
                calls = []
                for i in range(3):
                    call = stub.Session(metadata=call_metadata(TOKEN))
                    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                        await call.write(join_message(f"standby-{i}"))
                    calls.append(call)
                for call in calls:
                    try:
                        message = await call.read()
                        outcomes.append(message.WhichOneof("kind"))
                    except grpc.aio.AioRpcError as e:
                        outcomes.append(f"{e.code().name}: {e.details()}")
                for call in calls:
                    call.cancel()
            return outcomes

        outcomes = job.loop.run(scenario())
        assert outcomes[:2] == ["waiting", "waiting"]
        refusal = "RESOURCE_EXHAUSTED: the coordinator already serves 4 sessions, its limit"
        assert outcomes[2].startswith(refusal), outcomes
        assert job.summary() == before
        # The slots are given back: once the two standbys hung up, a new session gets in.
        wait_for(lambda: sorted(job.nodes()) == ["a", "b"], 10, "the standbys to be gone")
        later = job.session([join_message("later").SerializeToString()])
        assert later.waited_as_standby, later
        job.assert_healthy()


def test_a_session_that_never_speaks_is_closed() -> None:
    with formed_job(Limits(first_message_seconds=0.3)) as job:
        before = job.summary()

        async def silent() -> tuple[grpc.StatusCode, str]:
            async with open_channel(job.endpoint) as channel:
                call = pb_grpc.RendezvousStub(channel).Session(metadata=call_metadata(TOKEN))  # type: ignore[no-untyped-call]
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.read()  # sends nothing; waits for the coordinator to give up on it
                return await call.code(), await call.details()

        code, details = job.loop.run(silent())
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert details.startswith("no message within 0.3s of opening the session"), details
        assert job.summary() == before
        job.assert_healthy()


def test_a_peer_that_polls_too_fast_is_slowed_down() -> None:
    # Practically no refill: the first 3 calls use the burst, the 4th is refused, whatever the machine's speed.
    with formed_job(Limits(peer_calls_per_second=0.001, peer_burst=3)) as job:
        request = pb.StatusRequest().SerializeToString()
        outcomes = [job.get_status(request) for _ in range(4)]
        assert [o.code for o in outcomes[:3]] == [grpc.StatusCode.OK] * 3
        assert outcomes[3].code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert outcomes[3].details == "too many calls from ipv4:127.0.0.1: at most 0.001/s (burst 3)"
        # Sessions are not unary calls: the members carry on.
        for agent in job.agents:
            assert agent.ended == ""


def _watch(job: FormedJob, token: str | None) -> Any:
    """A health Watch stream; returns it after its first answer, or the error it ended with."""
    stub = health_pb2_grpc.HealthStub(job.channel)
    stream = stub.Watch(health_pb2.HealthCheckRequest(), metadata=call_metadata(token), timeout=60)
    try:
        first = next(stream)
    except grpc.RpcError as e:
        return e.code()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    return stream


def test_health_watch_needs_the_token_and_streams_are_bounded_in_number_and_time() -> None:
    """A Watch stream never ends by itself: without the token it is refused, with it at most max_streams are open,
    and each ends after its lifetime. Check stays open to anyone (load balancers, probes)."""
    limits = Limits(peer_calls_per_second=1e9, peer_burst=1e9, max_streams=4, stream_lifetime_seconds=2.0)
    with formed_job(limits) as job:
        before = job.summary()
        assert {_watch(job, None) for _ in range(50)} == {grpc.StatusCode.UNAUTHENTICATED}
        check = health_pb2_grpc.HealthStub(job.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        open_streams = [_watch(job, TOKEN) for _ in range(4)]
        assert not any(isinstance(s, grpc.StatusCode) for s in open_streams)
        assert _watch(job, TOKEN) is grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in open_streams:  # each ends by itself, cleanly, after its lifetime
            assert list(stream) == []
        assert not isinstance(_watch(job, TOKEN), grpc.StatusCode)  # room again
        job.assert_healthy()
        assert job.summary() == before
