"""Starting a coordinator from its configuration: the one way for the three kinds of process that host one, the
agent whose node owns the rendezvous address (:mod:`~tfelastic.daemon.agent.hosting`), ``tfelastic coordinator`` on
a head node (:mod:`~tfelastic.daemon.commands`) and an elected candidate on etcd
(:mod:`~tfelastic.daemon.etcd.coordinator`).
Each gets the same server, the same identity in status and etcd, and the job's metrics in its registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from tfelastic.daemon.config import RendezvousConfig
from tfelastic.daemon.endpoint import TlsConfig
from tfelastic.daemon.metrics.cluster import register_cluster_collector
from tfelastic.daemon.rendezvous.api import CoordinatorInfo, RendezvousSettings
from tfelastic.daemon.rendezvous.durable import JobStore, Takeover
from tfelastic.daemon.rendezvous.host import CoordinatorHost, create_server
from tfelastic.daemon.version import PROTOCOL, VERSION


@dataclass(frozen=True)
class CoordinatorSetup:
    """What a coordinator serves with, whichever process hosts it."""

    name: str  # the hosting agent's node id, or the head-node coordinator's name
    settings: RendezvousSettings
    heartbeat_interval: float
    failure_stop_grace: float  # the members' agents' grace after a failure (an etcd take-over waits for it)
    token: str | None = field(default=None, repr=False)  # a secret
    tls: TlsConfig | None = None

    @classmethod
    def of(cls, name: str, rendezvous: RendezvousConfig, failure_stop_grace: float, token: str | None
           ) -> CoordinatorSetup:
        return cls(name, rendezvous.settings(), rendezvous.heartbeat_interval, failure_stop_grace, token,
                   rendezvous.tls)


async def start_coordinator(setup: CoordinatorSetup, address: str, registry: CollectorRegistry | None = None, *,
                            store: JobStore | None = None, takeover: Takeover | None = None) -> CoordinatorHost:
    """Serves a coordinator on ``address`` (port 0: a free one) and exports the job's view in ``registry`` until
    it closes. Raises BindError when it cannot listen there (see :func:`create_server`)."""
    host = await create_server(address, setup.settings, token=setup.token, tls=setup.tls,
                               heartbeat_interval=setup.heartbeat_interval, store=store, takeover=takeover,
                               info=CoordinatorInfo(setup.name, address, time.time(), VERSION, PROTOCOL))
    if registry is not None:
        collector = register_cluster_collector(registry, lambda: host.published)
        host.on_close(lambda: registry.unregister(collector))
    return host
