"""``tfelastic_build_info``: which tfelastic a process runs, for a fleet in the middle of an upgrade."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge
from tfelastic.daemon.version import PROTOCOL, VERSION


def register_build_info(registry: CollectorRegistry, role: str) -> None:
    """``role``: agent or coordinator."""
    info = Gauge("tfelastic_build_info", "1, labelled with this process's tfelastic version, protocol and Python.",
                 ["version", "protocol", "python", "role"], registry=registry)
    info.labels(VERSION, str(PROTOCOL), platform.python_version(), role).set(1)
