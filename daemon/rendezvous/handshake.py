"""Connection failures that retrying does not fix (a TLS handshake that fails, an address where something other
than a tfelastic coordinator listens), in words an operator can act on, and when an agent stops retrying them.
Pure: text and an injected clock in, decisions out."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

log = logging.getLogger("tfelastic.agent")

_SSL_REASON = re.compile(r"OPENSSL_internal:([A-Z_]+)(?:: ([^:]+))?")
TLS_GIVE_UP_SECONDS = 30.0
_TLS_HINT_EVERY = 10.0
RETRY_SECONDS = 0.2  # between attempts to reach the coordinator
RETRY_MAX_SECONDS = 5.0  # the longest wait between attempts while only such failures come


def handshake_problem(error: str, tls_enabled: bool) -> str | None:
    """What a failed connection says about TLS, in words an operator can act on; None if it is not about TLS.

    gRPC reports every handshake failure as UNAVAILABLE. When this side refused the coordinator's certificate,
    its details carry OpenSSL's reason. When the coordinator refused this side (a client certificate it does
    not accept, none, or plain text where it wants TLS), the client only sees the connection closed while it
    was being set up ("Socket closed"), so that diagnosis is a likely one, not a certain one.
    """
    if "handshake failed" in error.lower():
        found = _SSL_REASON.search(error)
        reason = ": ".join(g for g in found.groups() if g) if found else "no reason given"
        if found and found.group(1) == "WRONG_VERSION_NUMBER":
            return (f"the coordinator does not speak TLS ({reason}): it runs without --tls-cert, or something "
                    "else listens on its port")
        return (f"this node cannot verify the coordinator's certificate ({reason}): check that --tls-ca holds the "
                "CA that signed it, that it names the rendezvous host, and that it has not expired")
    if "failed to connect" in error and "socket closed" in error.lower():
        if tls_enabled:
            return ("the coordinator closed the connection during the TLS handshake: it probably refused this "
                    "node's certificate (expired, not signed by the coordinator's --tls-ca, or missing: with mutual "
                    "TLS pass --tls-cert and --tls-key)")
        return ("the coordinator closed the connection during set-up: it probably requires TLS; pass --tls-ca "
                "(and --tls-cert/--tls-key for mutual TLS)")
    return None


# What gRPC says when the peer at the address does not speak HTTP/2: an HTTP/1 server answers with its own
# framing ("Failed parsing HTTP/2 ... Expected SETTINGS frame"), a silent one lets the client time out waiting
# for the server's SETTINGS frame.
_NOT_HTTP2 = re.compile(r"SETTINGS frame|Failed parsing HTTP/2", re.IGNORECASE)


# What a gRPC server that does not serve our protocol answers the session's call with: a Go server (etcd) names the
# service it does not know, a Python one says the method is not found. Every tfelastic coordinator serves it.
_NOT_OURS = re.compile(r"unknown service tfelastic\.|UNIMPLEMENTED.*Method not found", re.IGNORECASE | re.DOTALL)


def foreign_listener_problem(error: str) -> str | None:
    """What a failed connection says about the program at the coordinator's address, if it is not a tfelastic
    coordinator (not a gRPC server, or a gRPC server of another service); None otherwise."""
    if _NOT_OURS.search(error):
        return ("a gRPC server that is not a tfelastic coordinator listens at the rendezvous address (it does not "
                "serve tfelastic.v1.Rendezvous: etcd's client port, another program); stop it, or give --rendezvous "
                "the coordinator's address")
    if not _NOT_HTTP2.search(error):
        return None
    return ("something that is not a tfelastic coordinator listens at the rendezvous address (it does not speak "
            "gRPC): another program, or an agent's /metrics given the rendezvous port; stop it, or give "
            "--rendezvous a port that is free")


class HandshakeFailures:
    """Decides when an agent stops retrying a coordinator that it cannot complete a TLS handshake with, or whose
    address something else holds.

    A certificate that cannot be verified, or a foreign program on the port, does not fix itself, so waiting out
    join_timeout (10 minutes by default) only hides the problem. After min(TLS_GIVE_UP_SECONDS, join_timeout)
    with no message from the coordinator and nothing but such failures, the agent gives up as on a wrong token
    (exit 78). Until then it logs the diagnosis at once and every 10 s, and keeps retrying: a certificate may be
    mid-rotation, a program may be on its way out.
    Any other kind of failure (the coordinator is down) leaves the decision to join_timeout.

    Between attempts the agent waits RETRY_SECONDS, doubled after each such failure in a row up to
    RETRY_MAX_SECONDS (a coordinator that is down may be back any moment; a foreign program or a certificate is not
    fixed by the next try), but never past the moment it would give up.
    """

    def __init__(self, tls_enabled: bool, join_timeout: float, clock: Callable[[], float]) -> None:
        self._tls = tls_enabled
        self._give_up_after = min(TLS_GIVE_UP_SECONDS, join_timeout)
        self._clock = clock
        self._other_failure_after: float | None = None  # the last contact before a failure not about TLS
        self._logged_at: float | None = None
        self._last: tuple[str, str, float] | None = None  # the last such failure: what, problem, its last contact
        self._in_a_row = 0  # such failures since the last contact, with nothing of another kind (timeouts aside)

    def failed(self, error: str, last_contact: float) -> str | None:
        """Records one lost session; returns the message to exit with, or None to retry."""
        what, problem = "TLS problem with the coordinator", handshake_problem(error, self._tls)
        if problem is None:
            what, problem = "not a coordinator", foreign_listener_problem(error)
        if problem is None:
            if not _timed_out(error):
                self._other_failure_after = last_contact
                self._in_a_row = 0
            return None
        self._in_a_row = self._in_a_row + 1 if self._last is not None and self._last[2] == last_contact else 1
        self._last = (what, problem, last_contact)
        now = self._clock()
        if self._logged_at is None or self._logged_at < last_contact or now - self._logged_at >= _TLS_HINT_EVERY:
            log.error("%s: %s", what, problem)
            self._logged_at = now
        if self._other_failure_after != last_contact and now - last_contact >= self._give_up_after:
            return self._giving_up(what, problem)
        return None

    def retry_delay(self, last_contact: float) -> float:
        """How long to wait before the next attempt, the last contact being ``last_contact``."""
        if not self._in_a_row or self._last is None or self._last[2] != last_contact:
            return RETRY_SECONDS
        backoff = min(RETRY_MAX_SECONDS, RETRY_SECONDS * (1 << min(self._in_a_row - 1, 32)))
        if self._other_failure_after == last_contact:  # join_timeout decides this outage, not this bound
            return backoff
        return max(RETRY_SECONDS, min(backoff, last_contact + self._give_up_after - self._clock()))

    def at_join_timeout(self, last_contact: float) -> str | None:
        """join_timeout ran out between two failures: the message to exit 78 with if nothing but these failures
        (timeouts aside) came since ``last_contact``, as :meth:`failed` would have said at the next one."""
        if self._last is None or self._last[2] != last_contact or self._other_failure_after == last_contact:
            return None
        return self._giving_up(*self._last[:2])

    def _giving_up(self, what: str, problem: str) -> str:
        failures = "failed TLS handshakes with the coordinator" if what.startswith("TLS") else \
            "failed connections to the rendezvous address"
        return f"giving up after {self._give_up_after:g}s of {failures}: {problem}"


def _timed_out(error: str) -> bool:
    """Failures that say nothing of what listens there: a timeout (a loaded machine, a slow peer), and gRPC's own
    INTERNAL error when the Join was written to a call the peer had already ended (a foreign gRPC server ends it at
    once with UNIMPLEMENTED, and which of the two the agent sees is a race)."""
    return "DEADLINE_EXCEEDED" in error or "Deadline Exceeded" in error or "timed out" in error \
        or error == "INTERNAL: Internal error from Core"
