"""The first contact with etcd, before anything starts: what a failed connection says about the TLS settings, in
words and option names an operator can act on, and when retrying stops.

gRPC reports every failed connection as UNAVAILABLE; its details tell the cases apart (unreadable PEM, etcd's
certificate refused, plain-text etcd, this side's certificate refused, etcd wanting TLS: :func:`tls_problem`, each
seen against a real etcd in tests/integration/test_etcd_tls.py). A TLS failure gives up once it has lasted
:data:`TLS_GIVE_UP_SECONDS` (a member may be restarting with new certificates), anything else after ``patience``.
:class:`FirstContact` decides over an injected clock; :func:`first_contact` runs it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdClient, EtcdCredentials, EtcdError, EtcdUnavailable
from tfelastic.daemon.etcd.url import EtcdTarget

log = logging.getLogger("tfelastic.etcd")

TLS_GIVE_UP_SECONDS = 3.0
RETRY_SECONDS = 0.5
LOG_EVERY_SECONDS = 10.0  # a retry is logged at first, then this often
_SSL_REASON = re.compile(r"OPENSSL_internal:([A-Z_]+)(?:: ([^:]+))?")
T = TypeVar("T")


class EtcdTlsError(EtcdError):
    """TLS with etcd fails for a reason a setting must fix: retrying will not help (exit 78)."""


def tls_problem(error: str, target: EtcdTarget, credentials: EtcdCredentials) -> str | None:
    """What a failed connection to etcd says about TLS, naming the option to fix; None if nothing."""
    text = error.lower()
    if "security handshaker" in text:
        return ("gRPC cannot set up TLS from --etcd-ca/--etcd-cert/--etcd-key: check that each is a PEM file of "
                "the right kind (a CA certificate, this node's certificate, its private key)")
    if "handshake failed" in text:
        found = _SSL_REASON.search(error)
        reason = ": ".join(g for g in found.groups() if g) if found else "no reason given"
        if found and found.group(1) == "WRONG_VERSION_NUMBER":
            return f"etcd does not speak TLS there ({reason}): write etcd:// instead of etcds://"
        trusted = f"--etcd-ca {credentials.ca}" if credentials.ca else "the system's CAs (no --etcd-ca given)"
        return (f"this node cannot verify etcd's certificate ({reason}) with {trusted}: check that --etcd-ca holds "
                "the CA that signed etcd's certificate, that the certificate names the host as the URL writes it, "
                "and that it has not expired")
    if target.tls and "handshake read failed" in text:
        return ("etcd closed the connection as soon as the TLS handshake began: it serves plain text there; write "
                "etcd:// instead of etcds:// (or give etcd --cert-file/--key-file)")
    if target.tls and "unwrap failed" in text:
        if credentials.cert:
            return (f"etcd refused this node's client certificate --etcd-cert {credentials.cert}: it is expired, "
                    "or not signed by the CA etcd trusts (its --trusted-ca-file)")
        return ("etcd requires a client certificate (it runs with --client-cert-auth): pass --etcd-cert and "
                "--etcd-key, signed by the CA etcd trusts")
    if not target.tls and "socket closed" in text and "failed to connect" in text:
        return "etcd closed the plain-text connection at once: it requires TLS; write etcds:// and pass --etcd-ca"
    return None


class FirstContact:
    """Whether to go on retrying etcd after a failed first request. Pure: an injected clock."""

    def __init__(self, target: EtcdTarget, credentials: EtcdCredentials, patience: float,
                 clock: Callable[[], float]) -> None:
        self._target, self._credentials, self._patience, self._clock = target, credentials, patience, clock
        self._started = clock()
        self._tls_since: float | None = None  # the first of the TLS failures in a row
        self._logged_at: float | None = None

    def failed(self, error: EtcdError) -> str | None:
        """Records a failure; raises EtcdAuthError, EtcdTlsError or EtcdUnavailable to give up, else returns
        what to log about the retry (None: it was said less than LOG_EVERY_SECONDS ago)."""
        if isinstance(error, EtcdAuthError):
            raise error
        now = self._clock()
        problem = tls_problem(str(error), self._target, self._credentials)
        if problem is None:
            self._tls_since = None
        else:
            self._tls_since = now if self._tls_since is None else self._tls_since
            if now - self._tls_since >= min(TLS_GIVE_UP_SECONDS, self._patience):
                raise EtcdTlsError(f"TLS with etcd at {self._target} fails: {problem}")
        if now - self._started > self._patience:
            raise EtcdUnavailable(f"etcd at {self._target} stayed unreachable for join_timeout={self._patience:g}s: "
                                  f"{error}")
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_SECONDS:
            return None
        self._logged_at = now
        if problem is not None:
            return f"TLS with etcd at {self._target} fails: {problem}; retrying for {TLS_GIVE_UP_SECONDS:g}s"
        return f"etcd at {self._target} does not answer yet ({error}); retrying"


async def first_contact(client: EtcdClient, request: Callable[[], Awaitable[T]], patience: float) -> T:
    """``request``'s answer, retried until etcd gives one; raises what :meth:`FirstContact.failed` raises."""
    contact = FirstContact(client.target, client.credentials, patience, time.monotonic)
    while True:
        try:
            return await request()
        except EtcdError as e:
            retry = contact.failed(e)
            if retry is not None:
                log.warning("%s", retry)
        await asyncio.sleep(RETRY_SECONDS)
