"""The election of the job's coordinator in etcd, and the leader's writes of the job's state.

Keys under ``/tfelastic/<job>/``: ``leader`` (JSON: node, address, since, kind) on the leader's lease, created
only if absent, so one candidate wins; ``state``, the durable state (rendezvous/durable.py), each write conditioned
on the leader key's create revision, the leader's fencing token; ``resigned``, the token of the last leader that
resigned (a key gone without it means a lost lease); ``coordinators/<name>``, standalone coordinators, which
agents yield to. etcd sees keep-alives, one write per change of state and idle watches; never the heartbeats.
docs/design.md describes the failover these keys carry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from tfelastic.daemon.aio import within
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdClient, EtcdError, EtcdUnavailable, KeyValue
from tfelastic.daemon.etcd.metrics import EtcdMetrics
from tfelastic.daemon.etcd.rpc import rpc_pb2
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.rendezvous import bounds
from tfelastic.daemon.rendezvous.durable import Deposed, DurableState, StoreUnavailable

log = logging.getLogger("tfelastic.etcd")
WRITE_ACCESS = ("Whoever can write to /tfelastic/ in etcd can stop this job or collect its token: turn etcd's "
                "authentication on, with a role per job (docs/operations.md)")


@dataclass(frozen=True)
class LeaderInfo:
    node: str  # the agent's node id, or the standalone coordinator's name
    address: str  # HOST:PORT of its gRPC Session service
    since: float  # wall clock, when it won
    kind: str = "agent"  # or "coordinator"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaderInfo | None:
        """None for anything a tfelastic coordinator does not write: the node a node id, the address HOST:PORT,
        the time a finite number, the kind one of two. Text from etcd is bounded like text from the network."""
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        node, address, since, kind = doc.get("node"), doc.get("address"), doc.get("since"), doc.get("kind", "agent")
        if not isinstance(node, str) or bounds.node_id_problem(node) is not None or kind not in KINDS:
            return None
        if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS or not _is_host_port(address):
            return None
        if isinstance(since, bool) or not isinstance(since, (int, float)) or not math.isfinite(since):
            return None
        return cls(node, address, float(since), kind)


KINDS = ("agent", "coordinator")
MAX_ADDRESS_CHARS = bounds.MAX_HOST_CHARS + 8  # [HOST]:PORT
MAX_SHOWN_CHARS = 200  # of a value from etcd, in a log line


def _is_host_port(address: str) -> bool:
    try:
        Endpoint.parse(address, "the coordinator's address in etcd")
    except ConfigError:
        return False
    return True


def shown(data: bytes) -> str:
    """Bytes from etcd, made printable and short for a log line."""
    return bounds.printable(data.decode(errors="replace"), MAX_SHOWN_CHARS) + ("..." if len(data) > MAX_SHOWN_CHARS
                                                                                else "")


class BadJobState(EtcdError):
    """The job's state in etcd is not one this version of tfelastic wrote (a wrong type, a value out of range):
    no coordinator can continue the job from it, and none may overwrite it unasked. Retrying will not help."""

    def __init__(self, key: str, target: EtcdTarget, problem: str) -> None:
        scheme = "https" if target.tls else "http"
        endpoints = ",".join(f"{scheme}://{endpoint}" for endpoint in target.endpoints)
        etcdctl = f"ETCDCTL_API=3 etcdctl --endpoints {endpoints}"
        super().__init__(
            f"the job's state in etcd, key {key}, is not one this tfelastic wrote ({problem}): no coordinator can "
            f"continue the job from it. Inspect it with '{etcdctl} get {key}' (add --cacert/--cert/--key or --user "
            f"as for the agents); to start the job over, which forgets its generation, restart budget, "
            f"quarantines and drained nodes, delete it with '{etcdctl} del {key}' and start the agents again")


class JobKeys:
    def __init__(self, job: str) -> None:
        self.prefix = f"/tfelastic/{job}/".encode()
        self.leader = self.prefix + b"leader"
        self.state = self.prefix + b"state"
        self.coordinators = self.prefix + b"coordinators/"
        self.resigned = self.prefix + b"resigned"  # the token of the last leader that gave the key up itself


def _created_if_absent(key: bytes, value: bytes, lease: int) -> tuple[rpc_pb2.Compare, rpc_pb2.RequestOp]:
    compare = rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL,
                              create_revision=0)
    return compare, rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


class Leadership:
    """This process leads the job while it holds the leader key. ``token``: the key's create revision."""

    def __init__(self, client: EtcdClient, keys: JobKeys, lease: int, ttl: int, token: int,
                 owns_lease: bool = True) -> None:
        self._client, self._keys = client, keys
        self.lease, self.ttl, self.token, self._owns_lease = lease, ttl, token, owns_lease
        self.lost = asyncio.Event()  # deposed: the lease expired, or a write found another leader

    async def keep_alive(self) -> None:
        """Renews the lease every TTL/3 until it is lost. etcd being unreachable is not a loss: while no quorum
        exists, nobody else can win either, and the job runs on (docs/design.md)."""
        unreachable_since: float | None = None
        while not self.lost.is_set():
            pause = self.ttl / 3
            try:
                # A member that went silent costs at most a third of the TTL, then the next one is tried at once:
                # one dead member must not cost the lease.
                if await self._client.keep_alive_once(self.lease, timeout=self.ttl / 3) == 0:
                    log.warning("this coordinator's etcd lease expired: another may lead now; stepping down")
                    self.lost.set()
                    return
                if unreachable_since is not None:
                    log.info("etcd answers again after %.1fs", time.monotonic() - unreachable_since)
                unreachable_since = None
            except EtcdError as e:
                pause = 0.05
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                    log.warning("cannot renew the coordinator's etcd lease: %s; the job runs on, and no new "
                                "generation forms until etcd answers", e)
                elif time.monotonic() - unreachable_since > self.ttl:
                    pause = self.ttl / 3  # no member answers: do not spin
            await asyncio.sleep(pause)

    async def save(self, state: DurableState) -> None:
        compare = rpc_pb2.Compare(key=self._keys.leader, target=rpc_pb2.Compare.CREATE,
                                  result=rpc_pb2.Compare.EQUAL, create_revision=self.token)
        put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=self._keys.state, value=state.to_json()))
        try:
            response = await self._client.txn([compare], [put])
        except EtcdError as e:  # retried whatever it is: no generation may start that etcd does not hold
            raise StoreUnavailable(str(e)) from None
        if not response.succeeded:
            self.lost.set()
            raise Deposed("another coordinator leads the job: this one's writes are refused")

    async def resign(self) -> None:
        """Gives the key up (if it is still ours) and the lease with it: the next leader need not wait a TTL."""
        compare = rpc_pb2.Compare(key=self._keys.leader, target=rpc_pb2.Compare.CREATE,
                                  result=rpc_pb2.Compare.EQUAL, create_revision=self.token)
        delete = rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=self._keys.leader))
        mark = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=self._keys.resigned, value=b"%d" % self.token))
        try:
            await self._client.txn([compare], [delete, mark])
            if self._owns_lease:
                await self._client.revoke(self.lease)
        except EtcdError as e:
            log.info("could not give the coordinator's key back (%s): it goes with the lease", e)
        self.lost.set()


class Election:
    def __init__(self, client: EtcdClient, job: str, ttl: int, metrics: EtcdMetrics | None = None) -> None:
        self.client, self.keys, self.ttl, self._metrics = client, JobKeys(job), ttl, metrics
        self._previous: tuple[LeaderInfo, int] | None = None  # the last leader whose key we saw go, and its token
        self._reported: set[tuple[bytes, int]] = set()  # keys no tfelastic wrote, by revision, already logged

    async def lost_lease(self) -> LeaderInfo | None:
        """The leader before this one, if its key went with its lease (it died, or etcd lost sight of it) rather
        than by resigning; None if it resigned or is not known."""
        if self._previous is None:
            return None
        leader, token = self._previous
        kv = await self.client.get(self.keys.resigned)
        return None if kv is not None and kv.value == b"%d" % token else leader

    async def leader(self, *, serializable: bool = False) -> LeaderInfo | None:
        """``serializable``: what any member knows, also without quorum (for `tfelastic status`)."""
        kv = await self.client.get(self.keys.leader, serializable=serializable)
        return LeaderInfo.from_json(kv.value) if kv is not None else None

    async def recorded_state(self) -> DurableState | None:
        """Raises BadJobState for a state this version did not write."""
        kv = await self.client.get(self.keys.state)
        if kv is None:
            return None
        try:
            return DurableState.from_json(kv.value)
        except ValueError as e:
            raise BadJobState(self.keys.state.decode(), self.client.target, str(e)) from None

    async def head_nodes(self) -> int:
        """The standalone coordinators registered. A registration without a lease is none of tfelastic's (it goes
        with its coordinator's lease) and would keep agents from leading for good: reported, not counted."""
        registered = await self.client.get_prefix(self.keys.coordinators)
        for kv in registered:
            if kv.lease == 0 and self._first_report(kv):
                log.error("the head-node registration %s in etcd has no lease, so no tfelastic coordinator wrote it "
                          "as it is: agents do not wait for it. Delete it with 'etcdctl del %s'. %s", shown(kv.key),
                          shown(kv.key), WRITE_ACCESS)
        return sum(1 for kv in registered if kv.lease != 0)

    async def campaign(self, info: LeaderInfo, may_lead: Callable[[], Awaitable[bool]],
                       lease: Callable[[], int | None] = lambda: None) -> Leadership:
        """Returns once this process holds the leader key. Waits while another leads, or while ``may_lead``
        says no (an agent, while a head-node coordinator is registered). ``lease``: a lease of the caller's to
        put the key on (a head node's registration lease: both go at once when it dies), else a new one."""
        while True:
            try:
                current = await self.client.get(self.keys.leader)
                if current is not None and current.lease == 0:
                    await self._remove_leaseless(current)
                    continue
                if current is not None:
                    self._remember(current)
                    self._report_foreign(current)
                elif await may_lead():
                    leadership = await self._try_to_lead(info, lease())
                    if leadership is not None:
                        if self._metrics is not None:
                            self._metrics.elections_won.inc()
                            self._metrics.leading.set(1)
                        return leadership
                await self._vacancy()
            except EtcdAuthError:
                raise
            except EtcdError as e:  # unavailable, a watch cancelled by compaction, ...: look again
                log.debug("campaign: %s; retrying", e)
                await asyncio.sleep(min(1.0, self.ttl / 4))

    async def register_head_node(self, name: str) -> int:
        """A standalone coordinator's registration (it wins over agents); returns its lease, to keep alive."""
        lease, _ = await self.client.grant(self.ttl)
        await self.client.put(self.keys.coordinators + name.encode(), b"1", lease=lease)
        return lease

    async def _try_to_lead(self, info: LeaderInfo, own: int | None) -> Leadership | None:
        lease, ttl = (own, self.ttl) if own is not None else await self.client.grant(self.ttl)
        compare, put = _created_if_absent(self.keys.leader, info.to_json(), lease)
        response = await self.client.txn([compare], [put])
        if response.succeeded:
            log.info("won the election: %s coordinates the job (lease TTL %ds)", info.node, ttl)
            return Leadership(self.client, self.keys, lease, ttl, int(response.header.revision), own is None)
        if own is None:
            await self.client.revoke(lease)
        return None

    async def _vacancy(self) -> None:
        """Returns when the leader key may be free: deleted (its lease expired, or it resigned), or after a
        TTL, to look again (a head-node coordinator may have gone)."""
        kv, revision = await self.client.read(self.keys.leader)
        if kv is not None:
            self._remember(kv)
        # From the key's own revision, so that a delete since the campaign's read is not missed; if etcd has
        # compacted that revision away, from the store's revision at the read.
        starts = [int(kv.mod_revision) + 1, revision + 1] if kv is not None else [revision + 1]
        for start in starts:
            try:
                await within(self._deleted(start), self.ttl)  # deleted, or a TTL to look again
                return
            except EtcdUnavailable:
                raise
            except EtcdError as e:  # the watch was cancelled: compacted
                log.debug("watching the leader key from revision %d: %s", start, e)

    def _remember(self, kv: KeyValue) -> None:
        """The leader key as last seen: who led, and its token. A candidate whose etcd member went silent may miss
        the delete, but it saw the key while it waited."""
        leader = LeaderInfo.from_json(kv.value)
        if leader is not None:
            self._previous = (leader, int(kv.create_revision))

    def _report_foreign(self, kv: KeyValue) -> None:
        """A leader key with a lease that no tfelastic wrote: said once, since it blocks the election."""
        if LeaderInfo.from_json(kv.value) is None and self._first_report(kv):
            log.error("the leader key %s in etcd holds %r, not one a tfelastic coordinator writes: no agent can "
                      "reach a coordinator, and no candidate leads until its lease %x ends. Delete it with "
                      "'etcdctl del %s'. %s", shown(kv.key), shown(kv.value), kv.lease, shown(kv.key), WRITE_ACCESS)

    async def _remove_leaseless(self, kv: KeyValue) -> None:
        """A leader key without a lease is none of tfelastic's (a leader's key goes with its lease) and would
        never go: deleted, if it is still the one seen, so that the candidates can campaign."""
        compare = rpc_pb2.Compare(key=kv.key, target=rpc_pb2.Compare.MOD, result=rpc_pb2.Compare.EQUAL,
                                  mod_revision=kv.mod_revision)
        delete = rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=kv.key))
        if (await self.client.txn([compare], [delete])).succeeded:
            log.error("the leader key %s in etcd has no lease, so no tfelastic coordinator wrote it as it is (it "
                      "held %r): deleted it, so that the election goes on. %s", shown(kv.key), shown(kv.value),
                      WRITE_ACCESS)

    def _first_report(self, kv: KeyValue) -> bool:
        """Whether this version of a key (by its revision) was not reported yet: a key is reported once."""
        seen = (bytes(kv.key), int(kv.mod_revision))
        if seen in self._reported:
            return False
        self._reported.add(seen)
        return True

    async def _deleted(self, start: int) -> None:
        async for response in self.client.watch(self.keys.leader, start_revision=start):
            for event in response.events:
                if event.type == 1:  # DELETE; prev_kv is the key as it was
                    if event.HasField("prev_kv"):
                        self._remember(event.prev_kv)
                    return
