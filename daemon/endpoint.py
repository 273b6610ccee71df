"""Addresses and TLS settings: what the configuration, the coordinator and its clients all need, below them all."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.netutil import host_port


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, option: str, *, allow_port_zero: bool = False) -> Endpoint:
        host, sep, port_text = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
            raise ConfigError(f"{option}: {text!r} is not HOST:PORT; write it like 'head-node:29400'")
        port = int(port_text)
        if not (0 if allow_port_zero else 1) <= port <= 65535:
            raise ConfigError(f"{option}: port {port} in {text!r} is out of range 1-65535")
        return cls(host, port)

    def __str__(self) -> str:
        return host_port(self.host, self.port)

    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""  # this process's certificate chain (PEM)
    key: str = ""  # its private key (PEM)
    ca: str = ""  # CA bundle that signs the peers; on a server it also makes client certificates required

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)
