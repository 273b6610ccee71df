"""The agent's side of the coordinator's lease: when it last heard from the coordinator, when to send the next
heartbeat, when to fence itself, and when to give up. Pure: an injected clock, no sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tfelastic.daemon.rendezvous.handshake import HandshakeFailures

log = logging.getLogger("tfelastic.agent")


class CoordinatorContact:
    """Sessions are numbered, so that what was meant for one (a Join after a stop) never reaches the next."""

    def __init__(self, clock: Callable[[], float], coordinator: str, *, heartbeat_interval: float,
                 node_timeout: float, join_timeout: float, tls: bool) -> None:
        self._clock = clock
        self.coordinator = coordinator  # the rendezvous endpoint, for messages
        self.heartbeat_interval = heartbeat_interval
        # Fence one heartbeat before the coordinator's lease on us runs out, so that this node's worker is gone
        # before the others re-form without it.
        self.fence_after = node_timeout - heartbeat_interval
        self.join_timeout = join_timeout
        self.session = 0  # the current (or last) session's number
        self.open = False
        self._heard_at = 0.0  # the last message on the current session
        self.last_contact = clock()  # the last message on any session: join_timeout counts from here
        self.outage = False
        self._next_heartbeat = 0.0
        self._handshakes = HandshakeFailures(tls, join_timeout, clock)

    def opened(self) -> None:
        self.session += 1
        self.open = True
        self._heard_at = self._next_heartbeat = self._clock()

    def closed(self) -> None:
        self.open = False

    def heard(self) -> None:
        self._heard_at = self.last_contact = self._clock()
        if self.outage:
            self.outage = False
            log.info("reconnected to the coordinator at %s", self.coordinator)

    def silence(self) -> float | None:
        """Seconds without a message once they exceed the fence limit, else None."""
        silent = self._clock() - self._heard_at
        return silent if silent > self.fence_after else None

    def silent(self) -> float:
        """Seconds since the last message from any coordinator."""
        return self._clock() - self.last_contact

    def heartbeat_due(self) -> bool:
        now = self._clock()
        if now < self._next_heartbeat:
            return False
        self._next_heartbeat = now + self.heartbeat_interval
        return True

    def lost(self, problem: str) -> str | None:
        """Records a lost session; returns a message to exit 78 with when TLS handshakes keep failing."""
        if not self.outage:  # once per outage, not once per retry
            log.warning("lost the coordinator at %s: %s; retrying", self.coordinator, problem)
        self.outage = True
        return self._handshakes.failed(problem, self.last_contact)

    def retry_delay(self) -> float:
        """Seconds to wait before the next attempt to reach the coordinator."""
        return self._handshakes.retry_delay(self.last_contact)

    def gave_up(self) -> bool:
        return self._clock() - self.last_contact > self.join_timeout

    def handshake_verdict(self) -> str | None:
        """Once join_timeout ran out: the message to exit 78 with when only TLS or foreign-listener failures came."""
        return self._handshakes.at_join_timeout(self.last_contact)
