"""A node's sessions through the real servicer: the same agent process on a new stream replaces its old one (the
core counts the node lost and found again), another process with a member's id is refused as a duplicate."""

from __future__ import annotations

import grpc
import pytest

from tests.cluster import wait_for
from tests.rpc_harness import formed_job, join_message

pytestmark = [pytest.mark.integration, pytest.mark.quick]


def test_the_same_agent_on_a_new_stream_replaces_its_old_session() -> None:
    with formed_job() as job:
        old = next(agent for agent in job.agents if agent.node_id == "a")
        outcome = job.session([join_message("a", last_generation=1, last_rank=0).SerializeToString()], timeout=10)
        assert outcome.code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), outcome
        wait_for(lambda: old.ended != "", 30, "the replaced session to be closed")
        assert old.ended == "UNAVAILABLE: replaced by a newer session of node a"
        assert job.summary()["restarts_by_reason"].get("node_lost", 0) >= 1  # lost and found again


def test_another_process_with_a_members_id_is_refused_and_the_member_keeps_its_session() -> None:
    with formed_job() as job:
        before = job.summary()
        outcome = job.session([join_message("a", incarnation="another-process").SerializeToString()])
        assert outcome.code is grpc.StatusCode.ALREADY_EXISTS, outcome
        assert "node id 'a' is already in the job" in outcome.details
        assert job.summary() == before
        job.assert_healthy()
