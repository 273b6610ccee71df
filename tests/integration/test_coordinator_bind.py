"""Hosting the coordinator is exclusive: of the agents that race for one endpoint, exactly one hosts it.

gRPC binds a name such as ``localhost`` to every address it resolves to (``::1`` and ``127.0.0.1``) and succeeds
when any one binds. Two agents on one node used to each get a part of the endpoint and both host a coordinator
(CI: test_slurm's two tasks both logged "hosting the coordinator").
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import re
import socket
from collections.abc import Iterator

import pytest
from tfelastic.daemon.netutil import bind_addresses
from tfelastic.daemon.rendezvous import api, bind
from tfelastic.daemon.rendezvous.bind import BindError
from tfelastic.daemon.rendezvous.host import create_server

from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.quick]

both_loopbacks = pytest.mark.skipif(bind_addresses("localhost") != ["127.0.0.1", "::1"],
                                    reason="this machine cannot bind both 127.0.0.1 and ::1")


@contextlib.contextmanager
def listening(address: str, port: int) -> Iterator[None]:
    """Someone else listening on exactly one address, as a rival agent that won only that one would be."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((address, port))
        s.listen()
        yield


def listens(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        return s.connect_ex((address, port)) == 0


@both_loopbacks
@pytest.mark.parametrize("taken", ["127.0.0.1", "::1"])
def test_a_coordinator_does_not_settle_for_part_of_its_endpoint(taken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A rival that binds between the pre-check and our bind: the pre-check sees a free port.
    monkeypatch.setattr(bind, "_endpoint_taken", lambda addresses, port: False)
    port = free_port()

    async def host() -> None:
        coordinator = await create_server(f"localhost:{port}", api.RendezvousSettings())
        await coordinator.close()

    with listening(taken, port), pytest.raises(BindError, match=f"cannot listen on localhost:{port}"):
        asyncio.run(host())
    free = "::1" if taken == "127.0.0.1" else "127.0.0.1"
    assert not listens(free, port), f"the failed coordinator left {free}:{port} bound"


@both_loopbacks
def test_a_coordinator_on_localhost_listens_on_both_loopbacks() -> None:
    async def host() -> tuple[int, bool, bool]:
        coordinator = await create_server("localhost:0", api.RendezvousSettings())
        try:
            return coordinator.port, listens("127.0.0.1", coordinator.port), listens("::1", coordinator.port)
        finally:
            await coordinator.close()

    port, ipv4, ipv6 = asyncio.run(host())
    assert port > 0 and ipv4 and ipv6


def _contend(port: int, start: multiprocessing.synchronize.Barrier, done: multiprocessing.synchronize.Event,
             won: multiprocessing.queues.Queue[bool]) -> None:
    async def contend() -> None:
        start.wait()
        try:
            coordinator = await create_server(f"localhost:{port}", api.RendezvousSettings())
        except BindError:
            won.put(False)
            return
        won.put(True)
        await asyncio.get_running_loop().run_in_executor(None, done.wait)
        await coordinator.close()

    asyncio.run(contend())


def test_of_agents_racing_for_one_endpoint_exactly_one_hosts_it() -> None:
    spawn = multiprocessing.get_context("spawn")
    contenders = 4
    for _ in range(5):
        port = free_port()
        start, done, won = spawn.Barrier(contenders, timeout=60), spawn.Event(), spawn.Queue()
        processes = [spawn.Process(target=_contend, args=(port, start, done, won), daemon=True)
                     for _ in range(contenders)]
        for process in processes:
            process.start()
        try:
            outcomes = [won.get(timeout=60) for _ in processes]
        finally:
            done.set()
            for process in processes:
                process.join(30)
                if process.is_alive():
                    process.kill()
        assert sorted(outcomes) == [False] * (contenders - 1) + [True], outcomes


def test_an_address_of_another_machine_is_named_as_such() -> None:
    async def host() -> None:
        await create_server("192.0.2.1:29400", api.RendezvousSettings())  # TEST-NET-1

    with pytest.raises(BindError, match=re.escape("'192.0.2.1' is not an address of this machine")):
        asyncio.run(host())
