"""The coordinator an agent hosts when its node owns the rendezvous address.

Several agents on one host race for the endpoint's exclusive bind, and exactly one wins; when it dies, the others
find the endpoint free on their next retry and one of them takes over (it continues the generation numbering from
what the agents report in their Joins).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import psutil
from prometheus_client import CollectorRegistry
from tfelastic.daemon.aio import first_of
from tfelastic.daemon.coordinator_setup import CoordinatorSetup, start_coordinator
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import is_local_address
from tfelastic.daemon.rendezvous.bind import BindError
from tfelastic.daemon.rendezvous.host import CoordinatorHost

log = logging.getLogger("tfelastic.agent")


@dataclass(frozen=True)
class Listener:
    """The process that listens on a TCP port of this host."""

    pid: int
    argv: tuple[str, ...]

    def is_tfelastic(self) -> bool:
        """An agent or coordinator: ``python -m tfelastic.daemon ...`` or the ``tfelastic`` command. By its
        arguments, not by any mention of the name: a checkout or virtual environment may be named after it."""
        module = any(a == "-m" and b == "tfelastic.daemon" for a, b in zip(self.argv, self.argv[1:], strict=False))
        return module or any(os.path.basename(arg) == "tfelastic" for arg in self.argv[:2])

    def __str__(self) -> str:
        return f"pid {self.pid} ({' '.join(self.argv)[:200] or '?'})"


def listener_of(port: int) -> Listener | None:
    """The process that listens on TCP ``port`` here, if it can be read."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for c in connections:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                argv = tuple(psutil.Process(c.pid).cmdline())
            except psutil.Error:
                argv = ()
            return Listener(c.pid, argv)
    return None


class EmbeddedCoordinator:
    def __init__(self, setup: CoordinatorSetup, endpoint: Endpoint, registry: CollectorRegistry) -> None:
        self._setup, self._endpoint, self._registry = setup, endpoint, registry
        self.host: CoordinatorHost | None = None
        self._named_holder = ""  # the foreign program on the port, once named

    async def try_hosting(self) -> None:
        if self.host is not None or not is_local_address(self._endpoint.host):
            return
        try:
            self.host = await start_coordinator(self._setup, str(self._endpoint), self._registry)
        except BindError:
            self._name_a_foreign_holder()  # normally another agent on this host hosts it
            return
        log.info("hosting the coordinator on %s", self._endpoint)

    def _name_a_foreign_holder(self) -> None:
        """Says once which program holds the rendezvous port, when it is not one of ours: the agents would
        otherwise only see that nothing answers there in gRPC."""
        holder = listener_of(self._endpoint.port)
        if holder is None or holder.is_tfelastic() or str(holder) == self._named_holder:
            return
        self._named_holder = str(holder)
        log.error("the rendezvous port %d of this host is held by %s, which is not a tfelastic agent or "
                  "coordinator: stop it, or give --rendezvous a port that is free", self._endpoint.port, holder)

    async def host_after_drain(self, signalled: asyncio.Event) -> None:
        """A drained node that hosts the coordinator keeps hosting it: the other nodes still need it. It stops
        when the job ends, or on a signal to stop (agent.LEAVE_SIGNALS)."""
        if self.host is None or signalled.is_set():
            return
        log.info("drained, but this node hosts the coordinator: hosting it until the job ends (SIGTERM stops it)")
        await first_of(self.host.finished.wait(), signalled.wait())

    async def close(self) -> None:
        if self.host is not None:
            await self.host.close()
            self.host = None
