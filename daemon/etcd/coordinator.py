"""A candidate for the job's coordinator, on etcd: it campaigns, and while it leads it serves the job's gRPC
Session protocol on its own address, with the job's state taken over from etcd and written back there.

Every agent of an etcd job is a candidate, and so is every ``tfelastic coordinator --rendezvous etcd://...`` on a
head node; head nodes win over agents (election.py). A leader stops serving when it is deposed (its lease expired,
or a write found another leader), when a head node registers (an agent leader), or when it is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from tfelastic.daemon.aio import first_of
from tfelastic.daemon.coordinator_setup import CoordinatorSetup, start_coordinator
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.client import EtcdClient, EtcdCredentials, EtcdError
from tfelastic.daemon.etcd.election import BadJobState, Election, LeaderInfo, Leadership
from tfelastic.daemon.etcd.metrics import EtcdMetrics
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.netutil import free_port, host_port
from tfelastic.daemon.rendezvous.bind import BindError
from tfelastic.daemon.rendezvous.durable import DurableState, Takeover
from tfelastic.daemon.rendezvous.host import CoordinatorHost

log = logging.getLogger("tfelastic.coordinator")


@dataclass(frozen=True)
class Candidate:
    setup: CoordinatorSetup
    listen: Endpoint  # port 0: a free one for each term
    head_node: bool  # a standalone coordinator: wins over agents
    linger: float = 0.0  # after the job it led ended: the job's metrics stay up this long (Prometheus records it)


def candidate_for(job: str, candidate: Candidate, *, target: EtcdTarget, credentials: EtcdCredentials,
                  lease_ttl: int, registry: CollectorRegistry) -> ElectedCoordinator:
    """A candidate for ``job``'s coordinator with its own client of the job's etcd (its ``election.client``)."""
    metrics = EtcdMetrics(registry)
    election = Election(EtcdClient(target, credentials, metrics), job, lease_ttl, metrics)
    return ElectedCoordinator(election, candidate, registry, metrics)


class ElectedCoordinator:
    def __init__(self, election: Election, candidate: Candidate, registry: CollectorRegistry,
                 metrics: EtcdMetrics) -> None:
        self.election, self._candidate = election, candidate
        self._registry, self.metrics = registry, metrics
        self.host: CoordinatorHost | None = None
        self._term_address = ""
        self._lease: int | None = None  # a head node's registration lease, which its leader key shares
        self.finished = asyncio.Event()  # a job this process coordinated has ended

    def healthy(self, max_age: float) -> bool:
        """For systemd's watchdog: the coordinator it hosts, if any, fires its timers (a campaign has none: that the
        watchdog's own task runs shows that the event loop turns)."""
        return self.host is None or self.host.healthy(max_age)

    async def run(self, stop: asyncio.Event) -> None:
        """Campaigns and serves, term after term, until ``stop`` (or the end of a job it served). Raises
        BadJobState when the job's state in etcd is not one it can continue (after giving the lead up)."""
        registration = asyncio.create_task(self._register()) if self._candidate.head_node else None
        try:
            while not stop.is_set() and not self.finished.is_set():
                leadership = await _first(self._campaign(), stop)
                if leadership is None:
                    return
                try:
                    await self._serve(leadership, stop)
                except BadJobState:
                    raise
                except EtcdError:
                    pass
        finally:
            if registration is not None:
                registration.cancel()

    async def _campaign(self) -> Leadership:
        listen = self._candidate.listen
        port = listen.port or free_port(listen.host)
        self._term_address = host_port(listen.host, port)
        info = LeaderInfo(self._candidate.setup.name, self._term_address, time.time(),
                          "coordinator" if self._candidate.head_node else "agent")
        return await self.election.campaign(info, self._may_lead, lambda: self._lease)

    async def _may_lead(self) -> bool:
        if self._candidate.head_node:
            return self._lease is not None  # registered first, so that agents give way
        return await self.election.head_nodes() == 0

    async def _serve(self, leadership: Leadership, stop: asyncio.Event) -> None:
        c = self._candidate
        try:
            recorded = await self.election.recorded_state()
            takeover = await self._takeover(recorded) if recorded is not None else None
            self.host = await start_coordinator(c.setup, self._term_address, self._registry, store=leadership,
                                                takeover=takeover)
        except BadJobState:
            await leadership.resign()  # each candidate reads the same state, and ends the same way
            raise
        except (BindError, EtcdError) as e:
            log.warning("cannot serve the job after winning the election (%s): giving the lead up", e)
            await leadership.resign()
            await asyncio.sleep(c.setup.settings.node_timeout_seconds)
            return
        log.info("coordinating the job on %s (generation %d taken over from etcd)", self._term_address,
                 recorded.generation if recorded else 0)
        keep_alive = asyncio.create_task(leadership.keep_alive())
        waits: list[Awaitable[object]] = [leadership.lost.wait(), stop.wait(), self.host.finished.wait()]
        if self.host.deposed is not None:
            waits.append(self.host.deposed.wait())
        if not c.head_node:
            waits.append(self._head_node_arrives())
        try:
            await first_of(*waits)
            if self.host.finished.is_set():
                self.finished.set()
                await self.host.wait_agents_gone()
                if c.linger:  # the alerts tell a finished job from a dead daemon by the verdict
                    log.info("the job ended: keeping its metrics up for %gs", c.linger)
                    await first_of(stop.wait(), timeout=c.linger)
            elif not leadership.lost.is_set():  # stepping down on purpose: a drain, SIGTERM, a head node
                await self.host.hand_over(c.setup.settings.node_timeout_seconds)
        finally:
            keep_alive.cancel()
            await self.host.close()
            self.host = None
            await leadership.resign()
            self.metrics.leading.set(0)
            log.info("no longer coordinating the job")

    async def _takeover(self, recorded: DurableState) -> Takeover:
        """An agent that led until its lease ran out is dead or cut off: its node is not waited for the whole
        node timeout plus grace, only until its worker is certainly gone (docs/design.md, "etcd: timing")."""
        previous = await self.election.lost_lease()
        setup = self._candidate.setup
        if previous is None or previous.kind != "agent" or previous.node == setup.name:
            return Takeover(recorded)
        node_timeout = setup.settings.node_timeout_seconds
        grace = departed_leader_grace(node_timeout, setup.failure_stop_grace, self.election.ttl)
        log.info("the last coordinator, %s, lost its etcd lease: its node counts as lost in %.2fs unless it "
                 "attaches", previous.node, grace)
        return Takeover(recorded, {previous.node: grace - node_timeout})

    async def _head_node_arrives(self) -> None:
        """An agent that leads gives way when a head-node coordinator registers."""
        while True:
            await asyncio.sleep(self.election.ttl)
            with contextlib.suppress(EtcdError):  # etcd without quorum: no head node can register either
                if await self.election.head_nodes() > 0:
                    break
        log.info("a head-node coordinator registered: handing the job over to it")

    async def _register(self) -> None:
        """A head node's registration, kept alive for as long as it runs (re-registered after an outage)."""
        while True:
            try:
                self._lease = await self.election.register_head_node(self._candidate.setup.name)
                while await self.election.client.keep_alive_once(self._lease) > 0:
                    await asyncio.sleep(self.election.ttl / 3)
                self._lease = None
            except EtcdError:
                await asyncio.sleep(self.election.ttl / 3)


def departed_leader_grace(node_timeout: float, failure_stop_grace: float, ttl: float) -> float:
    """How long a new coordinator waits for the node of a leader whose lease ran out: until that node's worker is
    certainly gone. Cut off at time P, that node stops its worker by P + node_timeout + failure_stop_grace (its
    own coordinator counts the others lost, or its agent fences). Its lease, renewed every TTL/3, ran out no
    earlier than P + 2/3 TTL, and this coordinator won after that."""
    return max(0.0, node_timeout + failure_stop_grace - 2 * ttl / 3)


async def _first(work: Awaitable[Leadership], stop: asyncio.Event) -> Leadership | None:
    """The result of ``work``, or None if ``stop`` comes first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None

