"""A coordinator served by this process. :func:`create_server` starts one on an address; :class:`CoordinatorHost`
is the one facade for the rest of its life: what it serves, the job's verdict, and winding it down. Processes
start theirs through :func:`tfelastic.daemon.coordinator_setup.start_coordinator`, which also exports its metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tfelastic.daemon.auth import TokenInterceptor, server_credentials
from tfelastic.daemon.endpoint import TlsConfig
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.bind import listen
from tfelastic.daemon.rendezvous.durable import JobStore, Takeover
from tfelastic.daemon.rendezvous.limits import GuardInterceptor, Limits, server_options
from tfelastic.daemon.rendezvous.server import SERVICE_NAME, RendezvousServicer
from tfelastic.daemon.rendezvous.state import Clock, Rendezvous
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

# After the verdict, how long the agents get to read it and hang up before the coordinator goes away.
AGENTS_GONE_SECONDS = 10.0


class CoordinatorHost:
    def __init__(self, server: grpc.aio.Server, port: int, servicer: RendezvousServicer, health_servicer: Any) -> None:
        self.port = port
        self._server, self._servicer, self._health = server, servicer, health_servicer
        self._closers: list[Callable[[], None]] = []

    @property
    def verdict(self) -> api.JobState | None:
        """SUCCEEDED or FAILED once the job has ended, else None."""
        state = self._servicer.rendezvous.state
        return state if state.is_terminal else None

    async def wait_finished(self) -> api.JobState:
        await self._servicer.finished.wait()
        return self._servicer.rendezvous.state

    @property
    def finished(self) -> asyncio.Event:
        return self._servicer.finished

    def status(self) -> api.ClusterStatus:
        """The job now. Call it on the coordinator's event loop; other threads read :attr:`published`."""
        return self._servicer.status()

    @property
    def deposed(self) -> asyncio.Event | None:
        """Set when another coordinator took the job over (etcd); None without a store."""
        persistence = self._servicer.persistence
        return persistence.deposed if persistence is not None else None

    @property
    def published(self) -> api.ClusterStatus:
        return self._servicer.published

    @property
    def connected(self) -> int:
        return self._servicer.connected

    def healthy(self, max_age: float) -> bool:
        """For systemd's watchdog: its timers fire (the ticker turned within ``max_age`` seconds)."""
        return self._servicer.ticked_within(max_age)

    def on_close(self, callback: Callable[[], None]) -> None:
        """``callback`` runs once the coordinator has stopped serving (e.g. to unregister its metrics)."""
        self._closers.append(callback)

    async def hand_over(self, timeout: float) -> None:
        """Before stepping down on purpose (etcd): every change is written and the orders waiting for it go out;
        from then on this coordinator decides nothing (no await in between), so its successor takes over exactly
        what the agents were told."""
        if self._servicer.persistence is not None:
            await self._servicer.persistence.flush(timeout)
        self._servicer.stop_deciding()

    async def wait_agents_gone(self, timeout: float = AGENTS_GONE_SECONDS) -> None:
        """After the job ended: give the agents time to read the verdict and hang up."""
        deadline = time.monotonic() + timeout
        while self._servicer.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def close(self, grace: float = 0.5) -> None:
        """Stops serving; after a verdict, once the agents have read it (at most AGENTS_GONE_SECONDS)."""
        if self.verdict is not None:
            await self.wait_agents_gone()
        await self._health.enter_graceful_shutdown()  # NOT_SERVING for every service
        await self._servicer.stop()
        self._servicer.close_sessions("the coordinator is shutting down")
        await self._server.stop(grace)
        closers, self._closers = self._closers, []
        for callback in closers:
            callback()


async def create_server(
    address: str,
    settings: api.RendezvousSettings,
    *,
    token: str | None = None,
    tls: TlsConfig | None = None,
    spec: api.JobSpec | None = None,
    heartbeat_interval: float = api.HEARTBEAT_INTERVAL_SECONDS,
    clock: Clock = time.monotonic,
    limits: Limits | None = None,
    store: JobStore | None = None,
    takeover: Takeover | None = None,
    info: api.CoordinatorInfo | None = None,
) -> CoordinatorHost:
    """Start a coordinator on ``address`` (port 0 picks a free one). Raises BindError if it cannot listen there:
    the port is taken (another agent of this host hosts it), or the address is not this machine's.

    With a ``store`` (etcd), the job's state is written there, and ``takeover`` is the state a predecessor left:
    the running generation's members get a node timeout (or the grace ``takeover`` gives them) to attach before
    they count as lost."""
    bind_host, _, bind_port = address.rpartition(":")
    credentials = server_credentials(tls) if tls is not None and tls.enabled else None
    limits = limits or Limits()
    rendezvous = Rendezvous(settings, clock, spec)
    rendezvous.wall_offset = time.time() - clock()
    if takeover is not None:
        rendezvous.take_over(takeover.recorded, rendezvous.wall_offset, grace=settings.node_timeout_seconds,
                             graces=takeover.graces)

    def new_server() -> grpc.aio.Server:
        # The guard is outermost, so that it bounds every call, authenticated or not (daemon/rendezvous/limits.py).
        guard = GuardInterceptor(limits, clock, heartbeat_interval,
                                 lambda: rendezvous.spec.max_nodes if rendezvous.spec else None)
        return grpc.aio.server(
            interceptors=[guard, *([TokenInterceptor(token)] if token else [])],
            options=[("grpc.so_reuseport", 0), *server_options(limits)],
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs(),
        )

    server, port = await listen(new_server, bind_host.strip("[]"), int(bind_port), credentials)
    if info is not None and info.address.endswith(":0"):  # the port it got
        info = dataclasses.replace(info, address=f"{info.address[:-2]}:{port}")
    servicer = RendezvousServicer(rendezvous, clock, heartbeat_interval, store=store, info=info)
    pb_grpc.add_RendezvousServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    servicer.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return CoordinatorHost(server, port, servicer, health_servicer)
