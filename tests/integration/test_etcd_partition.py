"""Case 3 of the etcd failover: the leader's host is cut off by a real partition. Three hosts in network
namespaces (tests/netns-hosts.sh), each with one etcd member and one agent."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import COUNTER, FORM_WITH_ALL, alive, assert_no_stale_workers, members, wait_for
from tests.conftest import ClusterFactory
from tests.etcd import EtcdCluster, leader_of

pytestmark = [pytest.mark.integration, pytest.mark.netns]

SCRIPT = Path(__file__).resolve().parent.parent / "netns-hosts.sh"
PREFIX, SUBNET, HOSTS = "tfeq", "10.231.9", 3
ENV = {"TFE_NETNS_PREFIX": PREFIX, "TFE_NETNS_SUBNET": SUBNET}
TEST_ADDRESS = f"{SUBNET}.254/24"  # the test's own address on the bridge: it reads etcd and status from outside


def ns(i: int) -> str:
    return f"{PREFIX}-h{i}"


def link(host: int, state: str) -> None:
    subprocess.run(["ip", "-n", ns(host), "link", "set", "eth0", state], check=True)


@pytest.fixture
def hosts() -> Iterator[None]:
    subprocess.run(["bash", str(SCRIPT), "down", str(HOSTS)], env=ENV, capture_output=True)
    subprocess.run(["bash", str(SCRIPT), "up", str(HOSTS)], env=ENV, check=True)
    subprocess.run(["ip", "addr", "add", TEST_ADDRESS, "dev", f"{PREFIX}br0"], check=True)
    try:
        yield
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(HOSTS)], env=ENV, check=True)


@pytest.fixture
def etcd(hosts: None, tmp_path: Path) -> Iterator[EtcdCluster]:
    folder = tmp_path / "etcd"
    folder.mkdir()
    cluster = EtcdCluster(folder, hosts=[f"{SUBNET}.{i}" for i in range(1, HOSTS + 1)],
                          netns=[ns(i) for i in range(1, HOSTS + 1)]).start()
    yield cluster
    cluster.stop()


def test_the_leaders_host_is_partitioned_the_majority_re_forms_and_it_rejoins_after_healing(
        make_cluster: ClusterFactory, etcd: EtcdCluster, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("partition-secret\n")
    token.chmod(0o600)
    cluster = make_cluster([sys.executable, COUNTER], nodes="2:3", etcd=etcd.url, token="partition-secret",
                           extra_args=["--token-file", str(token), "--stop-grace", "2", "--last-call", "0.5",
                                       "--settle", "1", *FORM_WITH_ALL],
                           env={"COUNTER_STEPS": "100000", "COUNTER_STEP_SECONDS": "0.05"})
    for i in range(1, HOSTS + 1):
        cluster.start(f"n{i}", netns=ns(i))
    before = cluster.wait_running(1, 3, step=5, timeout=60)
    leader = leader_of(etcd.url)
    assert leader is not None and leader.node in {"n1", "n2", "n3"}
    cut = int(leader.node[1:])
    cut_worker = next(n["worker_pid"] for n in members(before) if n["node_id"] == leader.node)

    partitioned_at = time.monotonic()
    link(cut, "down")
    doc = cluster.wait_status(
        lambda d: d["coordinator"] is not None and d["coordinator"]["node"] != leader.node
        and d["generation"] >= 2 and d["state"] == "running" and d["world_size"] == 2, 60,
        "the majority side to elect a leader and re-form without the partitioned host")
    print(f"partition to the majority's next generation: {time.monotonic() - partitioned_at:.2f}s")
    assert leader.node not in {n["node_id"] for n in members(doc)}
    assert doc["restarts_by_reason"].get("node_lost", 0) >= 1, doc
    wait_for(lambda: not alive(cut_worker), 30, "the partitioned host to stop its worker")
    assert_no_stale_workers(cluster.events())  # it was gone before the majority's next generation started

    link(cut, "up")
    wait_for(lambda: "stepping down" in cluster.agents[cut - 1].log(), 30,
             "the old leader to find itself deposed once etcd answers it again")
    doc = cluster.wait_status(lambda d: d["state"] == "running" and d["world_size"] == 3, 90,
                              "the healed host to rejoin as a member")
    assert doc["coordinator"]["node"] != leader.node
    assert leader.node in {n["node_id"] for n in members(doc)}
