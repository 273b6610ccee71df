"""What etcd costs and how the coordinator's leadership moves, on the process's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EtcdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Histogram("tfelastic_etcd_request_duration_seconds", "etcd requests that got an answer, by "
                                  "method.", ["method"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.errors = Counter("tfelastic_etcd_request_errors", "etcd requests that failed, by method and gRPC code.",
                              ["method", "code"], registry=registry)
        self.leader_changes = Counter("tfelastic_coordinator_leader_changes", "Times the job's coordinator changed "
                                      "to another, as this process saw it in etcd (a failover).", registry=registry)
        self.elections_won = Counter("tfelastic_coordinator_elections_won", "Elections for the job's coordinator "
                                     "this process won.", registry=registry)
        self.leading = Gauge("tfelastic_coordinator_leading", "1 while this process is the job's coordinator.",
                             registry=registry)
