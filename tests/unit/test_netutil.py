"""netutil.bind_addresses: the addresses a coordinator binds, in the order every contender binds them."""

from __future__ import annotations

import socket

from tfelastic.daemon.netutil import bind_addresses


def test_an_address_is_bound_as_given() -> None:
    assert bind_addresses("127.0.0.1") == ["127.0.0.1"]
    assert bind_addresses("0.0.0.0") == ["0.0.0.0"]
    assert bind_addresses("::") == ["::"]


def test_localhost_is_both_loopbacks_this_machine_has_ipv4_first() -> None:
    addresses = bind_addresses("localhost")
    assert addresses[0] == "127.0.0.1"
    assert set(addresses) <= {"127.0.0.1", "::1"}
    assert ("::1" in addresses) == _binds_ipv6_loopback()


def test_a_name_of_another_machine_has_no_address_here() -> None:
    assert bind_addresses("name-that-does-not-resolve.invalid") == []
    assert bind_addresses("192.0.2.1") == []  # TEST-NET-1: never an address of this machine


def _binds_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
            return True
    except OSError:
        return False
