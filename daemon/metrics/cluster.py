"""The coordinator's view of the job, so that one scrape target answers "is the job healthy?".

Scrapes run in the HTTP server's thread while the state machine lives on the event loop: the collector reads
the last status the loop published (an atomic reference), never the state machine itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector
from tfelastic.daemon.rendezvous.api import ClusterStatus, JobState, NodeState, RestartReason
from tfelastic.daemon.rendezvous.quarantine import QUARANTINE_KINDS

Metric = GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily


class ClusterCollector(Collector):
    def __init__(self, status: Callable[[], ClusterStatus]) -> None:
        self._status = status

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._status()
        yield InfoMetricFamily("tfelastic_cluster", "The job the coordinator serves.",
                               value={"tfelastic_job": snap.job})
        yield GaugeMetricFamily("tfelastic_cluster_generation", "Current (or last) generation.",
                                value=snap.generation)
        yield GaugeMetricFamily("tfelastic_cluster_members", "Workers in the running generation (0 between them).",
                                value=snap.world_size)
        desired = GaugeMetricFamily("tfelastic_cluster_desired_nodes", "The job's node range.", labels=["bound"])
        desired.add_metric(["min"], snap.min_nodes)
        desired.add_metric(["max"], snap.max_nodes)
        yield desired
        by_state = Counter(n.state for n in snap.nodes)
        nodes = GaugeMetricFamily("tfelastic_cluster_nodes", "Connected nodes by state.", labels=["state"])
        for node_state in NodeState:
            if node_state is not NodeState.UNKNOWN:  # a status client's only
                nodes.add_metric([node_state.value], by_state[node_state])
        yield nodes
        job = GaugeMetricFamily("tfelastic_cluster_job_state", "1 for the job's current state.", labels=["state"])
        for state in JobState:
            job.add_metric([state.value], 1 if state is snap.state else 0)
        yield job
        restarts = CounterMetricFamily("tfelastic_cluster_restarts", "Restarts of the job by reason.",
                                       labels=["reason"])
        for reason in RestartReason:
            restarts.add_metric([reason.value], snap.restarts_by_reason.get(reason.value, 0))
        yield restarts
        yield GaugeMetricFamily("tfelastic_cluster_max_restarts", "Failures allowed per restart window.",
                                value=snap.max_restarts)
        quarantined = GaugeMetricFamily("tfelastic_cluster_node_quarantined", "1 for each quarantined node, with "
                                        "what set it aside (worker_failures or node_check).", labels=["node", "kind"])
        for n in snap.nodes:
            if n.state is NodeState.QUARANTINED:
                quarantined.add_metric([n.node_id, n.quarantine_kind], 1)
        yield quarantined
        quarantines = CounterMetricFamily("tfelastic_cluster_quarantines", "Nodes quarantined since the "
                                          "coordinator started, by what set them aside.", labels=["kind"])
        for kind in QUARANTINE_KINDS:
            quarantines.add_metric([kind], snap.quarantines_by_kind.get(kind, 0))
        yield quarantines
        yield CounterMetricFamily("tfelastic_cluster_steps_redone", "Training steps done again after restarts "
                                  "(below the furthest step the job had reached).", value=snap.steps_redone)
        yield CounterMetricFamily("tfelastic_cluster_steps_lost", "Steps redone from below a checkpoint the job "
                                  "had saved: a backup deleted or damaged (logged as a warning).",
                                  value=snap.steps_lost)
        yield GaugeMetricFamily("tfelastic_cluster_vacant_tasks", "A parameter-server job's worker tasks without a "
                                "node: it trains on short-handed (status says which).", value=len(snap.vacant))
        if snap.goodput is not None:
            seconds = CounterMetricFamily("tfelastic_job_seconds", "The job's wall time since its first formation, "
                                          "by where it went (docs/goodput.md); goodput is training over the sum.",
                                          labels=["category"])
            for category, value in snap.goodput.seconds.items():
                seconds.add_metric([category], value)
            yield seconds


def register_cluster_collector(registry: CollectorRegistry,
                               status: Callable[[], ClusterStatus]) -> ClusterCollector:
    collector = ClusterCollector(status)
    registry.register(collector)
    return collector
