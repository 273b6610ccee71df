"""Small network helpers shared by the agent, the coordinator, the CLI and the tests."""

from __future__ import annotations

import ipaddress
import random
import socket
from typing import Any


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1", within: range | None = None) -> int:
    """A port that is free now, for something that binds it later (a trainer, a test's coordinator).

    It comes from ``within``, by default :func:`daemon_ports`: below the kernel's ephemeral range, so that a port
    the kernel hands out for bind(0) or an outgoing connection in the meantime can never be the one we promised to
    someone else.
    """
    ports = within or daemon_ports()
    for _ in range(64):
        port = random.choice(ports)
        if can_bind(host, port):
            return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:  # a crowded range: let the kernel choose
        s.bind((host, 0))
        return int(s.getsockname()[1])


def can_bind(host: str, port: int) -> bool:
    """Whether a TCP socket could bind ``host:port`` now."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_ports(count: int, host: str = "127.0.0.1", within: range | None = None) -> list[int]:
    """``count`` different ports, each free now (:func:`free_port`): nothing holds a port until its user binds it, so
    picks made one after the other can repeat one, and two processes given the same port cannot both start."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host, within)
        if port not in ports:
            ports.append(port)
    return ports


def daemon_ports() -> range:
    """Where :func:`free_port` picks by default: ``[low/2, low)``, ``low`` the start of the ephemeral range."""
    low = ephemeral_low()
    return range(max(1024, low // 2), low)


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (bind(0), outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def is_local_address(host: str) -> bool:
    """Whether this machine owns ``host`` (a name or address): whether it can bind to it."""
    return bool(bind_addresses(host))


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on host:port. Binds like gRPC does (SO_REUSEADDR), so connections of a process
    that died (TIME_WAIT) do not count."""
    return not all(_binds(family, sockaddr, reuse=True) for family, sockaddr in _addresses(host, port))


def bind_addresses(host: str) -> list[str]:
    """The addresses of this machine that a server for ``host`` listens on, in the one order every contender
    binds them.

    gRPC binds a name to every address it resolves to, and succeeds when any one of them binds. Two agents that
    race to host the same endpoint could then each get a part of it (one ``::1``, the other ``127.0.0.1``) and
    both host a coordinator. Bound one by one in the same order, the first address is a lock: whoever binds it
    binds the rest, and everyone else fails on it.
    """
    try:
        found = {str(ipaddress.ip_address(host))}
    except ValueError:
        found = {str(sockaddr[0]) for _, sockaddr in _addresses(host, 0)}
    if host == "localhost":
        found |= {"127.0.0.1", "::1"}  # what gRPC's resolver gives for it, whatever /etc/hosts says
    ours = [address for address in found if _binds_address(address, 0, reuse=False)]
    return sorted(ours, key=lambda address: (":" in address, address))  # IPv4 first


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, Any]]:
    try:
        return [(info[0], info[4]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except OSError:
        return []


def _binds(family: socket.AddressFamily, sockaddr: Any, *, reuse: bool) -> bool:
    try:  # creating the socket fails too, where the kernel has no IPv6
        with socket.socket(family, socket.SOCK_STREAM) as s:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
            return True
    except OSError:
        return False


def _binds_address(address: str, port: int, *, reuse: bool) -> bool:
    """``_binds`` for a numeric address; getaddrinfo keeps an IPv6 scope (``fe80::1%eth0``) that bind needs."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                        flags=socket.AI_NUMERICHOST)[0]
    except OSError:
        return False
    return _binds(family, sockaddr, reuse=reuse)


def route_address(destination: str) -> str:
    """The local address this machine uses to reach ``destination``: what peers there can reach it at."""
    try:
        ip = ipaddress_of(destination)
        if ip.startswith("127.") or ip == "::1":
            return "127.0.0.1" if "." in ip else "::1"
        family = _family(ip)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def ipaddress_of(host: str) -> str:
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
