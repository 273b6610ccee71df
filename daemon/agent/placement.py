"""Where an agent finds its coordinator, and whether it may become it.

- :class:`EmbeddedPlacement` (``--rendezvous HOST:PORT``): the coordinator's address is fixed, and the agent whose
  node owns it hosts it (hosting.py).
- :class:`EtcdPlacement` (``--rendezvous etcd://...``): every agent is a candidate (daemon/etcd/coordinator.py);
  the address of the one that leads is read from etcd, and followed when it changes. Its coordinator can fail
  over without stopping the workers, so the agent fences by what etcd says (agent/failover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.api import FatalSessionError
from tfelastic.daemon.agent.hosting import EmbeddedCoordinator
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.coordinator_setup import CoordinatorSetup
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdCredentials, EtcdError, EtcdUnavailable
from tfelastic.daemon.etcd.coordinator import Candidate, candidate_for
from tfelastic.daemon.etcd.election import BadJobState, LeaderInfo
from tfelastic.daemon.etcd.reach import EtcdTlsError, first_contact
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.rendezvous.api import JobState
from tfelastic.daemon.rendezvous.host import CoordinatorHost

log = logging.getLogger("tfelastic.agent")
RETRY_SECONDS = 0.5


def placement_for(config: AgentConfig, host: str, token: str | None, etcd: EtcdCredentials | None,
                  registry: CollectorRegistry) -> EmbeddedPlacement | EtcdPlacement:
    """An etcd rendezvous makes this agent a candidate that serves on ``host`` when elected; a HOST:PORT one, the
    coordinator's host when this node owns that address."""
    rdzv = config.rendezvous
    if rdzv.etcd is None:
        return EmbeddedPlacement(config, token, registry)
    return EtcdPlacement(config, rdzv.etcd, etcd or EtcdCredentials(), Endpoint(host, rdzv.coordinator_port), token,
                         registry)


def _setup(config: AgentConfig, token: str | None) -> CoordinatorSetup:
    """The coordinator this agent serves when it hosts or leads the job."""
    return CoordinatorSetup.of(config.node.id, config.rendezvous, config.node.failure_stop_grace, token)


def _log_if_failed(task: asyncio.Task[None]) -> None:
    """A candidate or follower that dies of a bug must say so: the node would silently stop being a candidate."""
    if not task.cancelled() and task.exception() is not None:
        log.error("etcd %s ended: %r", task.get_coro().__qualname__, task.exception())  # type: ignore[union-attr]


class EmbeddedPlacement:
    failover = False

    def __init__(self, config: AgentConfig, token: str | None, registry: CollectorRegistry) -> None:
        assert isinstance(config.rendezvous.endpoint, Endpoint)
        self._endpoint = config.rendezvous.endpoint
        self._hosting = EmbeddedCoordinator(_setup(config, token), self._endpoint, registry)
        self.changed = asyncio.Event()  # never: the address is fixed

    @property
    def host(self) -> CoordinatorHost | None:
        return self._hosting.host

    async def host_if_owner(self) -> None:
        """Hosts the coordinator now if this node owns its address (before any other listener of the agent)."""
        await self._hosting.try_hosting()

    async def start(self) -> None:
        pass

    async def coordinator(self) -> Endpoint | None:
        await self._hosting.try_hosting()
        return self._endpoint

    async def observe(self) -> tuple[int | None, float | None, bool]:
        return None, None, True

    def known_for(self) -> float | None:
        return None

    def named(self) -> Endpoint | None:
        return self._endpoint

    def lost(self) -> None:
        pass

    async def host_after_drain(self, signalled: asyncio.Event) -> None:
        await self._hosting.host_after_drain(signalled)

    async def close(self) -> None:
        await self._hosting.close()


class EtcdPlacement:
    failover = True

    def __init__(self, config: AgentConfig, target: EtcdTarget, credentials: EtcdCredentials, listen: Endpoint,
                 token: str | None, registry: CollectorRegistry) -> None:
        self._config, self._target = config, target
        self._candidate = candidate_for(config.job.name, Candidate(_setup(config, token), listen, head_node=False),
                                        target=target, credentials=credentials,
                                        lease_ttl=config.rendezvous.lease_ttl, registry=registry)
        self.election = self._candidate.election
        self.client = self.election.client
        self._metrics = self._candidate.metrics
        self.leader: LeaderInfo | None = None
        self._leader_since: float | None = None
        self._last_known: LeaderInfo | None = None  # the last leader etcd named, to count changes
        self._lost: LeaderInfo | None = None  # the coordinator whose session we lost: its key lingers a TTL
        self._tried: LeaderInfo | None = None  # the coordinator of the last session attempt
        self.changed = asyncio.Event()  # the leader changed: try it at once
        self._refusal: BadJobState | None = None  # the job's state in etcd cannot be continued: exit 78
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def host(self) -> CoordinatorHost | None:
        return self._candidate.host

    async def host_if_owner(self) -> None:
        """Nothing to bind now: an elected term's port is picked when it is won, below the range the kernel gives
        out for port 0 (netutil.free_port)."""

    async def start(self) -> None:
        """Reaches etcd first: wrong credentials or TLS settings that cannot work end the agent (exit 78) before
        anything starts, in seconds (etcd/reach.py); an etcd that does not answer is retried for join_timeout (then
        exit 1)."""
        try:
            self.leader = await first_contact(self.client, self.election.leader, self._config.rendezvous.join_timeout)
        except EtcdAuthError as e:
            raise FatalSessionError(f"--etcd-password-file: {e}; check the user and password (USER:PASSWORD "
                                    "in the file) and the user's role on /tfelastic/", ExitCode.CONFIG) from None
        except EtcdTlsError as e:
            raise FatalSessionError(str(e), ExitCode.CONFIG) from None
        except EtcdUnavailable as e:
            raise FatalSessionError(str(e), ExitCode.FAILED) from None
        self._leader_since = time.monotonic() if self.leader else None
        self._last_known = self.leader
        self._tasks = [asyncio.create_task(self._candidate.run(self._stop)), asyncio.create_task(self._follow())]
        self._tasks[0].add_done_callback(self._candidate_ended)
        self._tasks[1].add_done_callback(_log_if_failed)

    def _candidate_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and isinstance(task.exception(), BadJobState):
            self._refusal = task.exception()  # type: ignore[assignment]
            self.changed.set()
        else:
            _log_if_failed(task)

    async def coordinator(self) -> Endpoint | None:
        """The coordinator to try now; a session that breaks after attaching to it makes it the lost one.
        Raises FatalSessionError (exit 78) once this node found a job state in etcd that it cannot continue."""
        if self._refusal is not None:
            raise FatalSessionError(str(self._refusal), ExitCode.CONFIG)
        self._tried = self.leader
        return self.named()

    def named(self) -> Endpoint | None:
        """The coordinator etcd names now (None: none, or not an address)."""
        if self.leader is None:
            return None
        try:
            return Endpoint.parse(self.leader.address, "the coordinator's address in etcd")
        except ConfigError:
            log.error("the coordinator's address in etcd is not HOST:PORT: %r", self.leader.address)
            return None

    async def observe(self) -> tuple[int | None, float | None, bool]:
        """The job's generation in etcd (None: etcd did not answer), how long the current leader has been known,
        and whether etcd records that generation as running. Reads the leader too: a watch on a member that was
        cut off hears nothing, and says nothing."""
        try:
            leader = await self.election.leader()
            recorded = await self.election.recorded_state()
        except EtcdError:
            return None, self.known_for(), True
        self._set(leader)
        if recorded is None:
            return 0, self.known_for(), True
        return recorded.generation, self.known_for(), recorded.state is JobState.RUNNING

    def lost(self) -> None:
        """An attached session broke: its coordinator's key may linger a TTL, and while etcd names it, no
        coordinator counts as known. (A coordinator never attached to stays known: rule 3 of failover.py.)"""
        self._lost = self._tried

    async def observe_within(self, patience: float) -> tuple[int | None, float | None, bool]:
        """:meth:`observe`, or nothing if etcd does not answer before this node must decide whether to fence."""
        try:
            return await asyncio.wait_for(self.observe(), patience)
        except asyncio.TimeoutError:
            return None, self.known_for(), True

    async def another_leader(self, endpoint: Endpoint) -> Endpoint:
        """Returns once etcd names a coordinator other than ``endpoint``: one cut off from etcd but not from this
        agent is no longer the job's (its successor's take-over keeps our worker)."""
        while True:
            await self.changed.wait()
            self.changed.clear()
            leader = self.named()
            if leader is not None and leader != endpoint:
                return leader

    def known_for(self) -> float | None:
        """Seconds since etcd named the coordinator that leads now; None while none, or the lost one."""
        if self._leader_since is None or self.leader == self._lost:
            return None
        return time.monotonic() - self._leader_since

    async def host_after_drain(self, signalled: asyncio.Event) -> None:
        """A drained agent that leads just steps down: another agent takes the job over, and nothing restarts."""

    async def close(self) -> None:
        """Stops campaigning (a leader steps down and resigns) and following."""
        self._stop.set()
        for task in self._tasks[1:]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    async def _follow(self) -> None:
        """Keeps :attr:`leader` current: a read, then a watch from the revision after it."""
        keys = self.election.keys
        while True:
            try:
                kv, revision = await self.client.read(keys.leader)
                self._set(LeaderInfo.from_json(kv.value) if kv is not None else None)
                async for response in self.client.watch(keys.leader, start_revision=revision + 1):
                    for event in response.events:
                        self._set(LeaderInfo.from_json(event.kv.value) if event.type == 0 else None)
            except EtcdError:
                await asyncio.sleep(RETRY_SECONDS)

    def _set(self, leader: LeaderInfo | None) -> None:
        if leader == self.leader:
            return
        if leader is not None:
            log.info("the job's coordinator is %s at %s", leader.node, leader.address)
            if self._last_known is not None and leader != self._last_known:
                self._metrics.leader_changes.inc()
            self._last_known = leader
        self.leader = leader
        self._leader_since = time.monotonic() if leader is not None else None
        self.changed.set()
