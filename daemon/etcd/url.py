"""``etcd://HOST:PORT[,HOST:PORT...]`` and ``etcds://...`` (TLS): where the job's etcd is. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError

SCHEMES = ("etcd://", "etcds://")
DEFAULT_PORT = 2379


@dataclass(frozen=True)
class EtcdTarget:
    endpoints: tuple[Endpoint, ...]
    tls: bool

    def __str__(self) -> str:
        return ("etcds://" if self.tls else "etcd://") + ",".join(str(e) for e in self.endpoints)


def is_etcd_url(text: str) -> bool:
    return text.startswith(SCHEMES)


def parse_etcd_url(text: str, option: str = "--rendezvous") -> EtcdTarget:
    """Raises ConfigError naming ``option`` and the fix."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise ConfigError(f"{option}: {text!r} is not an etcd URL; write etcd://HOST:PORT[,HOST:PORT...] "
                          "(etcds:// for TLS), e.g. etcd://head-1:2379,head-2:2379,head-3:2379")
    if "/" in rest or "?" in rest or not rest:
        raise ConfigError(f"{option}: {text!r} must list etcd members as HOST:PORT separated by commas, with no "
                          "path, e.g. etcd://head-1:2379,head-2:2379,head-3:2379")
    endpoints = []
    for member in rest.split(","):
        if not member:
            raise ConfigError(f"{option}: {text!r} has an empty member between commas")
        if ":" not in member.strip("[]") or member.endswith("]"):
            member = f"{member}:{DEFAULT_PORT}"
        endpoints.append(Endpoint.parse(member, f"{option} ({text!r})"))
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"{option}: {text!r} names a member twice")
    return EtcdTarget(tuple(endpoints), tls=scheme == "etcds")
