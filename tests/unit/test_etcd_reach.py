"""The first contact with etcd (daemon/etcd/reach.py): what each failed connection says about the TLS settings,
from the details gRPC gave against a real etcd 3.4, and when a process stops retrying."""

from __future__ import annotations

import pytest
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdCredentials, EtcdUnavailable
from tfelastic.daemon.etcd.reach import TLS_GIVE_UP_SECONDS, EtcdTlsError, FirstContact, tls_problem
from tfelastic.daemon.etcd.url import EtcdTarget

from tests.fakes import FakeClock

TLS = EtcdTarget((Endpoint("127.0.0.1", 2379),), tls=True)
PLAIN = EtcdTarget((Endpoint("127.0.0.1", 2379),), tls=False)
LAST = "no etcd member answered Range (127.0.0.1:2379: UNAVAILABLE: failed to connect to all addresses; last error: "
NOT_PEM = LAST + "UNKNOWN: ipv4:127.0.0.1:2379: Failed to create security handshaker.)"
WRONG_CA = LAST + ("UNKNOWN: ipv4:127.0.0.1:2379: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
                   "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local "
                   "issuer certificate: OK)")
TLS_TO_PLAIN = LAST + "UNAVAILABLE: ipv4:127.0.0.1:2379: Handshake read failed (Socket closed))"
CLIENT_REFUSED = LAST + "UNAVAILABLE: ipv4:127.0.0.1:2379: Unwrap failed (TSI_DATA_CORRUPTED))"
PLAIN_TO_TLS = LAST + "UNAVAILABLE: ipv4:127.0.0.1:2379: Socket closed)"
REFUSED = LAST + "UNKNOWN: ipv4:127.0.0.1:2379: Failed to connect to remote host: Connection refused)"
CA = EtcdCredentials(ca="/etc/tfelastic/etcd-ca.pem")
MUTUAL = EtcdCredentials(ca="/etc/tfelastic/etcd-ca.pem", cert="/etc/tfelastic/etcd.pem", key="/etc/tfelastic/k")


@pytest.mark.parametrize(("error", "target", "credentials", "says"), [
    (NOT_PEM, TLS, CA, "gRPC cannot set up TLS from --etcd-ca/--etcd-cert/--etcd-key"),
    (WRONG_CA, TLS, CA, "cannot verify etcd's certificate (CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
                        "certificate) with --etcd-ca /etc/tfelastic/etcd-ca.pem"),
    (WRONG_CA, TLS, EtcdCredentials(), "with the system's CAs (no --etcd-ca given)"),
    (TLS_TO_PLAIN, TLS, CA, "it serves plain text there; write etcd:// instead of etcds://"),
    (CLIENT_REFUSED, TLS, CA, "etcd requires a client certificate (it runs with --client-cert-auth)"),
    (CLIENT_REFUSED, TLS, MUTUAL, "etcd refused this node's client certificate --etcd-cert /etc/tfelastic/etcd.pem"),
    (PLAIN_TO_TLS, PLAIN, EtcdCredentials(), "it requires TLS; write etcds:// and pass --etcd-ca"),
])
def test_each_tls_failure_is_told_apart(error: str, target: EtcdTarget, credentials: EtcdCredentials,
                                        says: str) -> None:
    problem = tls_problem(error, target, credentials)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize(("error", "target"), [(REFUSED, TLS), (REFUSED, PLAIN), ("etcdserver: no leader", TLS),
                                               (PLAIN_TO_TLS, TLS)])
def test_what_is_not_about_tls_is_not_blamed_on_it(error: str, target: EtcdTarget) -> None:
    assert tls_problem(error, target, CA) is None


def test_a_tls_failure_gives_up_once_it_has_lasted_a_few_seconds() -> None:
    clock = FakeClock()
    contact = FirstContact(TLS, CA, 600.0, clock)
    assert contact.failed(EtcdUnavailable(TLS_TO_PLAIN)) is not None  # logged at once, with the diagnosis
    clock.now += TLS_GIVE_UP_SECONDS - 0.5
    assert contact.failed(EtcdUnavailable(TLS_TO_PLAIN)) is None
    clock.now += 0.5
    with pytest.raises(EtcdTlsError, match=r"TLS with etcd at etcds://127\.0\.0\.1:2379 fails: etcd closed"):
        contact.failed(EtcdUnavailable(TLS_TO_PLAIN))


def test_another_failure_between_two_tls_failures_starts_their_count_again() -> None:
    """A member that restarts (refused) and comes back with a certificate problem is counted from then on."""
    clock = FakeClock()
    contact = FirstContact(TLS, CA, 600.0, clock)
    contact.failed(EtcdUnavailable(WRONG_CA))
    clock.now += TLS_GIVE_UP_SECONDS - 0.5
    contact.failed(EtcdUnavailable(REFUSED))
    clock.now += 0.5
    contact.failed(EtcdUnavailable(WRONG_CA))  # not raised: 0 s of TLS failures in a row
    clock.now += TLS_GIVE_UP_SECONDS
    with pytest.raises(EtcdTlsError):
        contact.failed(EtcdUnavailable(WRONG_CA))


def test_an_etcd_that_does_not_answer_is_retried_for_the_join_timeout_and_logged_every_ten_seconds() -> None:
    clock = FakeClock()
    contact = FirstContact(TLS, CA, 30.0, clock)
    logged = []
    for _ in range(60):  # every 0.5 s
        logged.append(contact.failed(EtcdUnavailable(REFUSED)) is not None)
        clock.now += 0.5
    assert logged.count(True) == 3 and logged[0] and logged[20] and logged[40]
    clock.now = 30.5
    with pytest.raises(EtcdUnavailable, match="stayed unreachable for join_timeout=30s"):
        contact.failed(EtcdUnavailable(REFUSED))


def test_refused_credentials_give_up_at_once() -> None:
    with pytest.raises(EtcdAuthError):
        FirstContact(TLS, CA, 600.0, FakeClock()).failed(EtcdAuthError("authentication failed"))
