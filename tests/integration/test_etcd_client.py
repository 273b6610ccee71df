"""tfelastic's etcd v3 client (daemon/etcd/client.py) against a real 3-member etcd on loopback: reads, writes,
transactions, leases, watches, a dead member, authentication and TLS."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdClient, EtcdCredentials, EtcdUnavailable
from tfelastic.daemon.etcd.election import Election, JobKeys, LeaderInfo
from tfelastic.daemon.etcd.metrics import EtcdMetrics
from tfelastic.daemon.etcd.rpc import rpc_pb2
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.rendezvous.api import JobState
from tfelastic.daemon.rendezvous.durable import Deposed, DurableState

from tests.certs import Pki
from tests.etcd import EtcdCluster
from tests.ports import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield cluster
    cluster.stop()


def created_if_absent(key: bytes, value: bytes, lease: int = 0) -> tuple[Any, Any]:
    compare = rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL,
                              create_revision=0)
    return compare, rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def test_reads_writes_and_a_transaction_that_creates_a_key_once(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = etcd.client()
        try:
            revision = await client.put(b"/t/a", b"1")
            kv = await client.get(b"/t/a")
            assert kv is not None and (kv.value, kv.mod_revision) == (b"1", revision)
            assert await client.get(b"/t/missing") is None
            await client.put(b"/t/b", b"2")
            assert [kv.key for kv in await client.get_prefix(b"/t/")] == [b"/t/a", b"/t/b"]
            compare, put = created_if_absent(b"/t/once", b"first")
            assert (await client.txn([compare], [put])).succeeded
            assert not (await client.txn([compare], [put])).succeeded  # exists now
            assert await client.delete(b"/t/a") == 1
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_lease_keeps_its_key_only_while_it_is_kept_alive(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = etcd.client()
        try:
            lease, ttl = await client.grant(1)
            assert ttl >= 1  # etcd may raise it to its minimum (docs/facts.md, fact 16)
            await client.put(b"/t/leased", b"x", lease=lease)
            for _ in range(4):
                await asyncio.sleep(ttl / 2)
                assert await client.keep_alive_once(lease) > 0
            assert await client.get(b"/t/leased") is not None
            deadline = time.monotonic() + ttl + 5
            while await client.get(b"/t/leased") is not None:
                assert time.monotonic() < deadline, "the leased key outlived its lease"
                await asyncio.sleep(0.2)
            assert await client.keep_alive_once(lease) == 0  # expired
        finally:
            await client.close()

    asyncio.run(scenario())


def test_one_candidate_wins_and_a_deposed_leaders_writes_are_refused(etcd: EtcdCluster) -> None:
    """The leader key's create revision is the fencing token: once another leads, the old leader's write of the
    job's state fails, whatever it still believes."""
    async def yes() -> bool:
        return True

    async def scenario() -> None:
        first, second = etcd.client(), etcd.client()
        try:
            old = await Election(first, "fencing", 2).campaign(LeaderInfo("a", "127.0.0.1:1", 0.0), yes)
            # Waiting: a running job always has a spec (a state without one is refused on read, durable_check.py).
            state = DurableState(spec=None, state=JobState.WAITING, reason="", generation=1, members=())
            await old.save(state)
            await first.revoke(old.lease)  # as if its lease had expired during a partition
            new = await Election(second, "fencing", 2).campaign(LeaderInfo("b", "127.0.0.1:2", 0.0), yes)
            assert new.token != old.token
            with pytest.raises(Deposed):
                await old.save(dataclasses.replace(state, generation=7))
            assert old.lost.is_set()
            recorded = await Election(second, "fencing", 2).recorded_state()
            assert recorded is not None and recorded.generation == 1  # the deposed write did not land
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())


def test_a_successor_knows_whether_the_last_leader_resigned_or_lost_its_lease(etcd: EtcdCluster) -> None:
    async def yes() -> bool:
        return True

    async def lead(client: EtcdClient, node: str) -> Any:
        return await Election(client, "succession", 2).campaign(LeaderInfo(node, "127.0.0.1:1", 0.0), yes)

    async def scenario() -> None:
        clients = [etcd.client() for _ in range(3)]
        try:
            first = await lead(clients[0], "a")
            waiting = Election(clients[1], "succession", 2)
            watched = etcd.watchers()
            second = asyncio.create_task(waiting.campaign(LeaderInfo("b", "127.0.0.1:2", 0.0), yes))
            await asyncio.wait_for(etcd.until_watched(watched), 10)  # b saw a's key and waits on it
            await clients[0].revoke(first.lease)  # a's lease runs out
            await asyncio.wait_for(second, 10)
            lost = await waiting.lost_lease()
            assert lost is not None and lost.node == "a"
            third = Election(clients[2], "succession", 2)
            watched = etcd.watchers()
            following = asyncio.create_task(third.campaign(LeaderInfo("c", "127.0.0.1:3", 0.0), yes))
            await asyncio.wait_for(etcd.until_watched(watched), 10)
            await second.result().resign()  # b gives the lead up itself
            await asyncio.wait_for(following, 10)
            assert await third.lost_lease() is None
        finally:
            for client in clients:
                await client.close()

    asyncio.run(scenario())


def test_a_candidate_keeps_campaigning_after_etcd_compacted_the_leader_keys_revision(etcd: EtcdCluster) -> None:
    async def yes() -> bool:
        return True

    async def scenario() -> None:
        first, second = etcd.client(), etcd.client()
        try:
            leader = await Election(first, "compacted", 2).campaign(LeaderInfo("a", "127.0.0.1:1", 0.0), yes)
            keep_alive = asyncio.create_task(leader.keep_alive())
            for i in range(5):  # the store moves past the leader key's revision ...
                revision = await first.put(b"/t/filler", b"%d" % i)
            done = etcd.etcdctl("compact", str(revision))  # ... and forgets what came before
            assert done.returncode == 0, done.stderr
            candidate = asyncio.create_task(
                Election(second, "compacted", 2).campaign(LeaderInfo("b", "127.0.0.1:2", 0.0), yes))
            await asyncio.sleep(2.5)  # a TTL and more: it looked again at least once
            assert not candidate.done(), candidate  # still waiting, not dead of a cancelled watch
            keep_alive.cancel()
            await leader.resign()
            won = await asyncio.wait_for(candidate, 10)
            assert won.token > leader.token
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())


def test_a_leader_keeps_its_lease_while_the_member_it_talks_to_is_frozen(tmp_path: Path) -> None:
    """A SIGSTOPped member answers nothing and resets nothing, like a partitioned one: the keep-alive must move
    to another member before the lease runs out."""
    cluster = EtcdCluster(tmp_path).start()
    try:
        # Not the raft leader: freezing that one elects another, which extends every lease and hides the fault.
        status = json.loads(cluster.etcdctl("endpoint", "status", "-w", "json").stdout)
        frozen = next(i for i, s in enumerate(status) if s["Status"]["header"]["member_id"] != s["Status"]["leader"])

        async def yes() -> bool:
            return True

        async def scenario() -> None:
            # The observer is a witness, not the client under test: a generous timeout, and its channel to a
            # member that keeps answering opened before the freeze (on a loaded machine a new channel's first
            # linearizable read passed the daemon's 1.5 s, on each live member in turn).
            client, observer = cluster.client(), cluster.client(timeout=10.0)
            try:
                client._current = frozen  # the member the client talks to
                observer._current = (frozen + 1) % 3
                leader = await Election(client, "frozen", 2).campaign(LeaderInfo("a", "127.0.0.1:1", 0.0), yes)
                keep_alive = asyncio.create_task(leader.keep_alive())
                await observer.get(JobKeys("frozen").leader)
                await asyncio.sleep(0.5)
                cluster.kill(frozen, signal.SIGSTOP)
                try:
                    await asyncio.sleep(6.0)  # three TTLs
                    assert not leader.lost.is_set()
                    kv = await observer.get(JobKeys("frozen").leader)
                    assert kv is not None and LeaderInfo.from_json(kv.value).node == "a"  # type: ignore[union-attr]
                finally:
                    cluster.kill(frozen, signal.SIGCONT)
                    keep_alive.cancel()
            finally:
                await client.close()
                await observer.close()

        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_a_watch_sees_puts_and_deletes_from_a_revision(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        client = etcd.client()
        try:
            start = await client.put(b"/w/k", b"1")
            await client.put(b"/w/k", b"2")
            await client.delete(b"/w/k")
            seen = []
            async for response in client.watch(b"/w/", prefix=True, start_revision=start):
                seen += [(e.type, e.kv.value) for e in response.events]
                if len(seen) >= 3:
                    break
            assert seen == [(0, b"1"), (0, b"2"), (1, b"")]
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_dead_member_is_skipped(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path).start()
    try:
        cluster.kill(0)  # the client starts with the first member
        cluster.wait_healthy()  # the other two have a raft leader: the dead member is the only one to fail

        registry = CollectorRegistry()

        async def scenario() -> None:
            client = EtcdClient(cluster.target, metrics=EtcdMetrics(registry))
            try:
                await client.put(b"/d/k", b"v")
                kv = await client.get(b"/d/k")
                assert kv is not None and kv.value == b"v"
            finally:
                await client.close()

        asyncio.run(scenario())
        assert registry.get_sample_value("tfelastic_etcd_request_errors_total",
                                         {"method": "Put", "code": "UNAVAILABLE"}) == 1.0
        assert registry.get_sample_value("tfelastic_etcd_request_duration_seconds_count", {"method": "Put"}) == 1.0
        assert registry.get_sample_value("tfelastic_etcd_request_duration_seconds_count", {"method": "Range"}) == 1.0
        cluster.kill(1)  # quorum lost: a clear error, not a hang

        async def no_quorum() -> None:
            client = cluster.client()
            try:
                with pytest.raises(EtcdUnavailable, match="no etcd member answered"):
                    await client.put(b"/d/k", b"w")
            finally:
                await client.close()

        asyncio.run(no_quorum())
    finally:
        cluster.stop()


def test_users_and_passwords_of_etcds_own_authentication(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path, size=1).start()
    try:
        for args in (["user", "add", "root:rootpw"], ["user", "add", "tfe:s3cret"], ["role", "add", "tfe"],
                     ["role", "grant-permission", "tfe", "--prefix=true", "readwrite", "/tfelastic/"],
                     ["user", "grant-role", "tfe", "tfe"], ["auth", "enable"]):
            done = cluster.etcdctl(*args, user="root:rootpw" if args == ["auth", "enable"] else "")
            assert done.returncode == 0, done.stderr

        async def scenario() -> None:
            good = cluster.client(EtcdCredentials(user="tfe", password="s3cret"))
            wrong = cluster.client(EtcdCredentials(user="tfe", password="nope"))
            anonymous = cluster.client()
            try:
                await good.put(b"/tfelastic/j/x", b"1")
                with pytest.raises(EtcdAuthError, match="refused user 'tfe'"):
                    await wrong.put(b"/tfelastic/j/x", b"2")
                with pytest.raises(EtcdAuthError):
                    await anonymous.put(b"/tfelastic/j/x", b"3")
                with pytest.raises(EtcdAuthError):  # outside the user's prefix
                    await good.put(b"/other", b"4")
            finally:
                for client in (good, wrong, anonymous):
                    await client.close()

        asyncio.run(scenario())

        async def first_member_down() -> None:  # authentication, too, moves on to the next member
            member = cluster.members[0]
            target = EtcdTarget((Endpoint("127.0.0.1", free_port()), Endpoint(member.host, member.client_port)), False)
            client = EtcdClient(target, EtcdCredentials(user="tfe", password="s3cret"))
            try:
                await client.put(b"/tfelastic/j/y", b"1")
            finally:
                await client.close()

        asyncio.run(first_member_down())
        secret = tmp_path / "etcd-password"
        secret.write_text("tfe:nope\n")
        secret.chmod(0o600)
        agent = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "run", "--rendezvous", cluster.url,
                                "--etcd-password-file", str(secret), "--metrics-port", "off", "--", "true"],
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert agent.returncode == 78, agent  # wrong credentials: configuration, not retried
        assert "--etcd-password-file: " in agent.stderr and "Traceback" not in agent.stderr, agent.stderr
        assert "nope" not in agent.stderr  # the password is never printed
    finally:
        cluster.stop()


def test_etcds_with_client_certificates(tmp_path: Path) -> None:
    pki = Pki.create(tmp_path / "ca", "etcd-test-ca")
    server, client_leaf = pki.leaf("etcd-server"), pki.leaf("tfelastic-agent")
    cluster = EtcdCluster(tmp_path, size=1, tls=(pki.ca, server.cert, server.key)).start()
    try:
        async def scenario() -> None:
            client = EtcdClient(cluster.target, EtcdCredentials(ca=pki.ca, cert=client_leaf.cert, key=client_leaf.key))
            untrusted = EtcdClient(cluster.target, EtcdCredentials(ca=pki.ca))  # no client certificate
            try:
                await client.put(b"/tls/k", b"v")
                with pytest.raises(EtcdUnavailable):
                    await untrusted.get(b"/tls/k")
            finally:
                await client.close()
                await untrusted.close()

        asyncio.run(scenario())
    finally:
        cluster.stop()
