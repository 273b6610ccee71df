from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from tfelastic.daemon.endpoint import Endpoint

from tests.cluster import Cluster, processes_of
from tests.ports import free_port

ClusterFactory = Callable[..., Cluster]

# Every process the suite starts inherits this variable (set by the outermost session: a run without xdist, or
# xdist's controller, before it starts its workers), so the session can find what outlived it, however it was
# reparented. A nested session (xdist's workers, the lowest-TensorFlow run's pytest) finds it set and leaves the
# check to the session that set it.
SESSION_ENV = "TFELASTIC_TEST_SESSION"
LEAK_GRACE_SECONDS = 15.0  # for processes that a teardown signalled but did not wait for (xdist's workers too)


def _has_tensorflow() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None and importlib.util.find_spec("tf_keras") is not None


def pytest_configure(config: pytest.Config) -> None:
    if SESSION_ENV not in os.environ:
        os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        config.stash[_owns_session] = os.environ[SESSION_ENV]


_owns_session = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after xdist has ended its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    marker = session.config.stash.get(_owns_session, None)
    if marker is None:
        return
    deadline = time.monotonic() + LEAK_GRACE_SECONDS
    while (leftovers := processes_of(f"{SESSION_ENV}={marker}")) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not leftovers:
        return
    described = []
    for p in leftovers:
        try:
            described.append(f"  pid {p.pid}: {' '.join(p.cmdline())[:300]}")
            p.kill()
        except psutil.Error:
            continue
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "processes the test session started outlived it (killed now):\n" + "\n".join(described)
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_tf = pytest.mark.skip(reason="TensorFlow is not installed (pip install -e '.[trainer-cpu]')")
    skip_ns = pytest.mark.skip(reason="network namespaces need root and iproute2")
    can_netns = os.geteuid() == 0 and shutil.which("ip") is not None
    groups: dict[str, str] = {}
    for item in items:
        if "tensorflow" in item.keywords and not _has_tensorflow():
            item.add_marker(skip_tf)
        if "netns" in item.keywords and not can_netns:
            item.add_marker(skip_ns)
        groups[item.nodeid] = xdist_group_of(item)
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker orders its collection the same way
        items[:] = start_order(items, groups)


def start_order(items: list[pytest.Item], groups: dict[str, str]) -> list[pytest.Item]:
    """Under xdist (run with --no-loadscope-reorder, so that it keeps this order): the two longest chains start
    first (the lowest-TensorFlow run, the serial group), then the tests that keep cores busy (TensorFlow
    processes), then those that mostly wait (agents on the counter trainer), and the many short unit tests fill the
    workers' ends. Measured: mixing busy and waiting tests instead made the waiting ones slow without making the
    busy ones faster (docs/testing.md)."""
    def rank(item: pytest.Item) -> int:
        if item.nodeid.startswith("tests/test_tensorflow_floor.py"):
            return 0
        if groups[item.nodeid] == "serial":
            return 1
        if "tensorflow" in item.keywords:
            return 2
        return 3 if "integration" in item.keywords else 4

    return sorted(items, key=rank)  # stable: each kind keeps the collection's order


SERIAL = ("netns", "systemd", "serial")  # the markers of tests that cannot share the machine with each other


def xdist_group_of(item: pytest.Item) -> str:
    """Which pytest-xdist worker group a test runs in (``--dist loadgroup``; without xdist, nothing changes).
    Tests that cannot share the machine with each other (fixed namespace names and addresses, the hermetic
    systemd) form one group, run one after another; a test that uses a fixture of module or session scope of
    ours (a TensorFlow process serving many cases, an etcd, a formed job) goes with its module, so that the
    fixture is set up once; every other test is its own group, for any free worker."""
    if any(marker in item.keywords for marker in SERIAL):
        return "serial"
    fixtures = getattr(item, "_fixtureinfo", None)
    for definitions in (fixtures.name2fixturedefs.values() if fixtures else ()):
        for definition in definitions:
            ours = str(definition.baseid).startswith("tests")
            if ours and definition.scope in ("module", "package", "session"):
                return item.nodeid.split("::")[0]
    return item.nodeid


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Builds clusters whose processes are all checked to be gone when the test ends; without warm start unless a
    test asks for it (``warm_start=True``)."""
    clusters: list[Cluster] = []

    def factory(trainer: list[str], **kwargs: Any) -> Cluster:
        endpoint = kwargs.pop("endpoint", None) or Endpoint("127.0.0.1", free_port())
        kwargs.setdefault("warm_start", False)  # tests/cluster.py: Cluster.warm_start
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


class Reaper:
    """Processes a test starts by hand, each killed (the process alone) at the test's end whatever its outcome."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[Any]] = []

    def popen(self, command: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        process: subprocess.Popen[Any] = subprocess.Popen(command, **kwargs)
        self.processes.append(process)
        return process

    def reap(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    found = Reaper()
    yield found
    found.reap()
