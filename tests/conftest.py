from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import free_port

from tests.cluster import Cluster, processes_of

ClusterFactory = Callable[..., Cluster]


def _has_tensorflow() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("tf_keras") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_tf = pytest.mark.skip(reason="TensorFlow is not installed (pip install -e '.[trainer-cpu]')")
    skip_ns = pytest.mark.skip(reason="network namespaces need root and iproute2")
    can_netns = os.geteuid() == 0 and shutil.which("ip") is not None
    for item in items:
        if "tensorflow" in item.keywords and not _has_tensorflow():
            item.add_marker(skip_tf)
        if "netns" in item.keywords and not can_netns:
            item.add_marker(skip_ns)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Builds clusters whose processes are all checked to be gone when the test ends."""
    clusters: list[Cluster] = []

    def factory(trainer: list[str], **kwargs: Any) -> Cluster:
        endpoint = kwargs.pop("endpoint", None) or Endpoint("127.0.0.1", free_port())
        cluster = Cluster(tmp_path, endpoint, trainer, **kwargs)
        clusters.append(cluster)
        return cluster

    yield factory
    for cluster in clusters:
        cluster.stop()
    leftovers = processes_of(str(tmp_path))
    for p in leftovers:
        p.kill()
    assert not leftovers, f"processes outlived their agents: {[(p.pid, p.name()) for p in leftovers]}"
