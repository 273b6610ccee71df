"""Ports for the suite's own listeners (a test's coordinator, etcd, Prometheus, a hand-made TF_CONFIG), chosen so
that two pytest-xdist workers can never pick the same one.

The daemon picks its free ports (a trainer's, with --worker-port 0) from ``netutil.daemon_ports()``,
``[low/2, low)`` where ``low`` starts the kernel's ephemeral range. The suite takes ``[low/4, low/2)`` instead, cut
into one slice per worker: a test's port is then neither another worker's nor one an agent picks for itself.
"""

from __future__ import annotations

import os

from tfelastic.daemon import netutil


def worker_slice() -> range:
    """This worker's ports: its share of ``[low/4, low/2)`` (all of it without xdist)."""
    low = netutil.ephemeral_low()
    start, stop = max(1024, low // 4), max(2048, low // 2)
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % count if worker.isdigit() else 0
    share = (stop - start) // count
    return range(start + index * share, start + (index + 1) * share)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of this worker's slice that ``host`` can bind now."""
    return netutil.free_port(host, within=worker_slice())


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports of this worker's slice that ``host`` can bind now."""
    return netutil.free_ports(count, host, within=worker_slice())
