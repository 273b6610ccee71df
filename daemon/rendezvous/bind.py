"""Binding the coordinator's endpoint exclusively, so that of several contenders exactly one serves it.

gRPC binds a name to every address it resolves to, and succeeds when any one of them binds: two agents racing
for ``localhost`` could each win one of ``127.0.0.1`` and ``::1``. So every address is bound one by one, in the
one order of :func:`tfelastic.daemon.netutil.bind_addresses`: the first is the lock, and a server that cannot
bind them all gives back what it bound. No ``SO_REUSEPORT``.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tfelastic.daemon.netutil import bind_addresses, host_port, port_taken


class BindError(OSError):
    pass


async def listen(new_server: Callable[[], grpc.aio.Server], host: str, port: int,
                 credentials: grpc.ServerCredentials | None) -> tuple[grpc.aio.Server, int]:
    """A server (not started) listening on ``port`` of each address of ``host``, and the port; or BindError.

    Port 0 takes the port the first address gets for all of them, and tries again with a fresh one when another
    address has it taken already.
    """
    addresses = bind_addresses(host)
    if not addresses:
        raise BindError(f"cannot listen on {host_port(host, port)}: {host!r} is not an address of this machine; "
                        "give the host name or address of this node, or 0.0.0.0")
    if port and _endpoint_taken(addresses, port):  # the common case, without gRPC's error log
        raise BindError(f"cannot listen on {host_port(host, port)}: the address is in use")
    for _ in range(5 if port == 0 else 1):
        server = new_server()
        try:
            return server, _add_ports(server, addresses, port, credentials)
        except _InUse:
            await _release(server)
        except BaseException:
            await _release(server)
            raise
    raise BindError(f"cannot listen on {host_port(host, port)}: the address is in use")


class _InUse(Exception):
    pass


def _endpoint_taken(addresses: list[str], port: int) -> bool:
    return any(port_taken(each, port) for each in addresses)


def _add_ports(server: grpc.aio.Server, addresses: list[str], port: int,
               credentials: grpc.ServerCredentials | None) -> int:
    """Binds each address in turn, on the port the first one got. Raises _InUse when one is taken."""
    for each in addresses:
        address = host_port(each, port)
        try:
            bound = int(server.add_secure_port(address, credentials) if credentials
                        else server.add_insecure_port(address))
            problem = "gRPC could not bind it"
        except RuntimeError as e:  # gRPC raises or returns 0, depending on its version
            bound, problem = 0, str(e)
        if not bound:
            if port and port_taken(each, port):
                raise _InUse(address)
            raise BindError(f"cannot listen on {address}: {problem}")
        port = bound
    return port


async def _release(server: grpc.aio.Server) -> None:
    """Closes what a server that failed to bind all its addresses did bind. One that never started keeps its
    sockets until the process ends, even when stopped or collected: start it, so that stop() closes them."""
    await server.start()
    await server.stop(None)
