"""Ports for the suite's own listeners (a test's coordinator, etcd, Prometheus, a hand-made TF_CONFIG), chosen so
that two pytest-xdist workers can never pick the same one.

The daemon picks its free ports (a trainer's, with --worker-port 0) from ``netutil.daemon_ports()``,
``[low/2, low)`` where ``low`` starts the kernel's ephemeral range. The suite takes ``[low/4, low/2)`` instead, cut
into one slice per worker: a test's port is then neither another worker's nor one an agent picks for itself.

Within a worker, ports are handed out in turn around its slice, not at random: nothing holds a port from its pick
until its user binds it, and a test picks several before it starts anything (an etcd cluster's members, a
coordinator, a hand-made TF_CONFIG). A port comes round again only after the whole slice (two thousand or more).
"""

from __future__ import annotations

import os
import random

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
    """A port of this worker's slice that ``host`` can bind now, the next one round the slice."""
    return free_ports(1, host)[0]


_cursor: dict[range, int] = {}  # per slice: the index the next pick starts at


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports of this worker's slice that ``host`` can bind now, the next ones round the slice."""
    if count == 0:
        return []
    ports = worker_slice()
    start = _cursor.get(ports, random.randrange(len(ports)))  # a random start: a rerun does not retrace the last
    picked: list[int] = []
    for step in range(len(ports)):
        port = ports[(start + step) % len(ports)]
        if netutil.can_bind(host, port):
            picked.append(port)
        if len(picked) == count:
            _cursor[ports] = (start + step + 1) % len(ports)
            return picked
    raise RuntimeError(f"only {len(picked)} of the {count} ports asked for are free in {ports} ({host}): "
                       "something holds the suite's ports; look for processes an earlier run left behind")
