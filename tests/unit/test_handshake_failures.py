"""How the agent reads a failed connection: which errors are TLS problems, and when it stops retrying them.
The error texts are the ones grpcio reports (tests/integration/test_tls.py checks them against real
handshakes)."""

from __future__ import annotations

import logging

import pytest
from tfelastic.daemon.rendezvous.handshake import (
    RETRY_MAX_SECONDS,
    RETRY_SECONDS,
    TLS_GIVE_UP_SECONDS,
    HandshakeFailures,
    foreign_listener_problem,
    handshake_problem,
)

from tests.fakes import FakeClock

UNTRUSTED = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:41285: Tls "
             "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
             "CERTIFICATE_VERIFY_FAILED: certificate has expired: OK")
NOT_TLS = ("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:45545: Tls handshake "
           "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
           "WRONG_VERSION_NUMBER: Invalid certificate verification context: OK")
HUNG_UP = ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:32979: "
           "Socket closed")
REFUSED = ("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: "
           "Connection refused")


@pytest.mark.parametrize(("error", "tls", "expected"), [
    (UNTRUSTED, True, "this node cannot verify the coordinator's certificate (CERTIFICATE_VERIFY_FAILED: "
                      "certificate has expired): check that --tls-ca"),
    (NOT_TLS, True, "the coordinator does not speak TLS (WRONG_VERSION_NUMBER: Invalid certificate verification "
                    "context)"),
    (HUNG_UP, True, "the coordinator closed the connection during the TLS handshake: it probably refused this "
                    "node's certificate"),
    (HUNG_UP, False, "the coordinator closed the connection during set-up: it probably requires TLS"),
], ids=["untrusted-certificate", "plain-text-coordinator", "certificate-refused", "tls-required"])
def test_tls_failures_are_named(error: str, tls: bool, expected: str) -> None:
    problem = handshake_problem(error, tls)
    assert problem is not None and problem.startswith(expected), problem


@pytest.mark.parametrize("error", [REFUSED, "UNAVAILABLE: Socket closed", "no message from the coordinator for 1.6s"])
def test_other_failures_are_not_tls(error: str) -> None:
    """A coordinator that is down, or that dropped an established session, is not a TLS problem."""
    assert handshake_problem(error, True) is None


def test_gives_up_after_the_bound_of_nothing_but_tls_failures(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(100.0)
    failures = HandshakeFailures(tls_enabled=True, join_timeout=600, clock=clock)
    contact = clock.now
    with caplog.at_level(logging.ERROR, "tfelastic.agent"):
        for _ in range(29):
            clock.now += 1
            assert failures.failed(UNTRUSTED, contact) is None
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3  # at once, then every 10 s: at 1, 11 and 21 s
    assert all(m.startswith("TLS problem with the coordinator: this node cannot verify") for m in logged)
    clock.now = contact + TLS_GIVE_UP_SECONDS
    fatal = failures.failed(UNTRUSTED, contact)
    assert fatal is not None and fatal.startswith("giving up after 30s of failed TLS handshakes with the coordinator: ")


def test_a_short_join_timeout_shortens_the_bound() -> None:
    clock = FakeClock(100.0)
    failures = HandshakeFailures(tls_enabled=True, join_timeout=3, clock=clock)
    contact = clock.now
    clock.now += 2.9
    assert failures.failed(HUNG_UP, contact) is None
    clock.now += 0.1
    assert failures.failed(HUNG_UP, contact) is not None


def test_contact_or_another_kind_of_failure_resets_the_count() -> None:
    clock = FakeClock(100.0)
    failures = HandshakeFailures(tls_enabled=True, join_timeout=600, clock=clock)
    clock.now += 40
    assert failures.failed(REFUSED, 100.0) is None  # the coordinator was down for a while
    assert failures.failed(UNTRUSTED, 100.0) is None  # then a TLS failure: not only TLS failures since contact
    later_contact = clock.now  # the agent got through once (e.g. a certificate rotation finished)
    clock.now += 29
    assert failures.failed(UNTRUSTED, later_contact) is None
    clock.now += 1
    assert failures.failed(UNTRUSTED, later_contact) is not None


@pytest.mark.parametrize("error", [
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:4000: connection attempt timed out "
    "before receiving SETTINGS frame",
    "failed to connect to all addresses; last error: INTERNAL: ipv4:127.0.0.1:4000: Trying to connect an http1.x "
    "server (HTTP status 404); Failed parsing HTTP/2 (Expected SETTINGS frame)",
])
def test_a_program_that_does_not_speak_grpc_at_the_address_ends_the_agent_like_a_bad_certificate(
        error: str, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=False, join_timeout=600, clock=clock)
    assert failures.failed(error, last_contact=1000.0) is None  # said at once, and retried for a while
    assert "not a coordinator: something that is not a tfelastic coordinator listens" in caplog.text
    clock.now += 30.0
    fatal = failures.failed(error, last_contact=1000.0)
    assert fatal is not None and fatal.startswith("giving up after 30s of failed connections to the rendezvous "
                                                  "address: something that is not a tfelastic coordinator")


def test_a_coordinator_that_is_down_is_not_a_foreign_program() -> None:
    assert foreign_listener_problem("failed to connect to all addresses; last error: UNAVAILABLE: "
                                    "ipv4:127.0.0.1:4000: Connection refused") is None


SILENT_PORT = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:4000: connection attempt "
               "timed out before receiving SETTINGS frame")
HTTP_SERVER = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:4000: Failed parsing "
               "HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 79)")
TIMED_OUT = "DEADLINE_EXCEEDED: Deadline Exceeded"


def test_a_timeout_between_foreign_failures_is_no_other_kind() -> None:
    """On a loaded machine a try may time out before the program on the port answers: that says nothing of what
    listens there, and must not hide it."""
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=False, join_timeout=8, clock=clock)
    assert failures.failed(HTTP_SERVER, last_contact=1000.0) is None
    clock.now += 4.0
    assert failures.failed(TIMED_OUT, last_contact=1000.0) is None
    clock.now += 4.0
    fatal = failures.failed(HTTP_SERVER, last_contact=1000.0)
    assert fatal is not None and fatal.startswith("giving up after 8s of failed connections")


@pytest.mark.parametrize("error", [SILENT_PORT, HTTP_SERVER, UNTRUSTED])
def test_join_timeout_between_two_failures_still_names_the_problem(error: str) -> None:
    """join_timeout equal to the bound: the agent's own deadline may come between two tries; it ends as a bad
    configuration too (exit 78), with the same message, not as an unreachable coordinator."""
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=error is UNTRUSTED, join_timeout=8, clock=clock)
    clock.now += 1.0
    assert failures.failed(error, last_contact=1000.0) is None
    assert failures.at_join_timeout(1000.0) is not None
    assert failures.at_join_timeout(1005.0) is None  # heard from a coordinator since: not this outage's


def test_join_timeout_after_another_kind_of_failure_is_an_unreachable_coordinator() -> None:
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=False, join_timeout=8, clock=clock)
    assert failures.failed(HTTP_SERVER, last_contact=1000.0) is None
    assert failures.failed(REFUSED, last_contact=1000.0) is None  # the program left; nothing listens now
    assert failures.at_join_timeout(1000.0) is None


FOREIGN_GRPC = "UNIMPLEMENTED: unknown service tfelastic.v1.Rendezvous"  # etcd's client port, as grpcio says it
WRITE_AFTER_THE_END = "INTERNAL: Internal error from Core"  # the Join written to a call the peer had ended


def test_a_grpc_server_of_another_service_ends_the_agent_and_grpcs_race_does_not_hide_it() -> None:
    """A foreign gRPC server ends the session's call at once; which the agent sees, that UNIMPLEMENTED or gRPC's
    INTERNAL error for the Join written after it, is a race (tests/integration/test_cli_errors.py, with etcd)."""
    assert foreign_listener_problem(FOREIGN_GRPC) is not None
    assert foreign_listener_problem("UNIMPLEMENTED: Method not found!") is not None  # a Python gRPC server
    assert foreign_listener_problem(WRITE_AFTER_THE_END) is None
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=False, join_timeout=8, clock=clock)
    assert failures.failed(FOREIGN_GRPC, last_contact=1000.0) is None
    clock.now += 4.0
    assert failures.failed(WRITE_AFTER_THE_END, last_contact=1000.0) is None
    clock.now += 4.0
    assert (failures.at_join_timeout(1000.0) or "").startswith(
        "giving up after 8s of failed connections to the rendezvous address: a gRPC server that is not a tfelastic "
        "coordinator listens")


def test_the_wait_between_tries_doubles_while_a_foreign_program_answers_and_ends_with_the_bound() -> None:
    """Said once, then retried with backoff: 0.2 s doubling to 5 s, never past the moment the agent gives up."""
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=False, join_timeout=600, clock=clock)
    assert failures.retry_delay(1000.0) == RETRY_SECONDS  # nothing failed yet
    waits = []
    while (fatal := failures.failed(FOREIGN_GRPC, last_contact=1000.0)) is None:
        waits.append(failures.retry_delay(1000.0))
        clock.now += waits[-1]
    assert waits[:6] == [0.2, 0.4, 0.8, 1.6, 3.2, RETRY_MAX_SECONDS]
    assert max(waits) == RETRY_MAX_SECONDS and len(waits) <= 12  # 150 tries at a fixed 0.2 s
    assert clock.now - 1000.0 == pytest.approx(TLS_GIVE_UP_SECONDS)  # the last wait ends where it gives up
    assert fatal.startswith("giving up after 30s of failed connections")


def test_a_coordinator_that_is_down_is_retried_at_the_usual_pace() -> None:
    """A refused connection may be a coordinator on its way up: no backoff, and a foreign failure's backoff ends
    with it and with a message from a coordinator."""
    clock = FakeClock(1000.0)
    failures = HandshakeFailures(tls_enabled=False, join_timeout=600, clock=clock)
    for _ in range(5):
        failures.failed(REFUSED, last_contact=1000.0)
    assert failures.retry_delay(1000.0) == RETRY_SECONDS
    for _ in range(3):
        failures.failed(HTTP_SERVER, last_contact=1000.0)
    assert failures.retry_delay(1000.0) == 0.8
    assert failures.retry_delay(1010.0) == RETRY_SECONDS  # a coordinator answered since
    failures.failed(REFUSED, last_contact=1000.0)
    assert failures.retry_delay(1000.0) == RETRY_SECONDS
