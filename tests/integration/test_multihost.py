"""Several hosts on one machine (network namespaces on a bridge, tests/netns-hosts.sh): a real partition."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.endpoint import Endpoint

from tests.cluster import COUNTER, FORM_WITH_ALL, Cluster, alive, members, wait_for
from tests.conftest import ClusterFactory

pytestmark = [pytest.mark.integration, pytest.mark.netns]

SCRIPT = Path(__file__).resolve().parent.parent / "netns-hosts.sh"
PREFIX, SUBNET, HOSTS = "tfet", "10.231.7", 3
ENV = {"TFE_NETNS_PREFIX": PREFIX, "TFE_NETNS_SUBNET": SUBNET}


def ns(i: int) -> str:
    return f"{PREFIX}-h{i}"


@pytest.fixture
def hosts() -> Iterator[None]:
    subprocess.run(["bash", str(SCRIPT), "down", str(HOSTS)], env=ENV, capture_output=True)
    subprocess.run(["bash", str(SCRIPT), "up", str(HOSTS)], env=ENV, check=True)
    try:
        yield
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(HOSTS)], env=ENV, check=True)


def status_from(cluster: Cluster, host: int, token_file: str) -> dict[str, Any] | None:
    """The status as seen from a host (the test itself has no address on the bridge)."""
    result = subprocess.run(["ip", "netns", "exec", ns(host), sys.executable, "-m", "tfelastic.daemon", "status",
                             "--rendezvous", str(cluster.endpoint), "--token-file", token_file, "--json"],
                            capture_output=True, text=True, timeout=30)
    return json.loads(result.stdout) if result.returncode == 0 else None


def test_partitioned_host_is_lost_fences_itself_and_rejoins_after_healing(
        hosts: None, make_cluster: ClusterFactory, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("multi-host-secret\n")
    token.chmod(0o600)
    cluster = make_cluster([sys.executable, COUNTER], endpoint=Endpoint(f"{SUBNET}.1", 29400), nodes="2:3",
                           extra_args=["--token-file", str(token), "--settle", "1", *FORM_WITH_ALL],
                           env={"COUNTER_STEPS": "400", "COUNTER_STEP_SECONDS": "0.05"})
    for i in range(1, HOSTS + 1):
        cluster.start(f"n{i}", netns=ns(i))

    def wait(predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            doc = status_from(cluster, 1, str(token))
            return doc if doc is not None and predicate(doc) else None
        result: dict[str, Any] = wait_for(check, timeout, what, interval=0.2)
        return result

    doc = wait(lambda d: d["generation"] == 1 and d["world_size"] == 3 and
               all(n["step"] for n in members(d)), 60, "3 hosts training")
    assert {n["address"].split(":")[0] for n in members(doc)} == {f"{SUBNET}.{i}" for i in (1, 2, 3)}
    cut_off = next(n["worker_pid"] for n in members(doc) if n["node_id"] == "n3")

    partitioned_at = time.monotonic()
    subprocess.run(["ip", "-n", ns(3), "link", "set", "eth0", "down"], check=True)
    doc = wait(lambda d: d["generation"] == 2 and d["world_size"] == 2 and d["state"] == "running", 30,
               "the others to re-form without the partitioned host")
    print(f"partition to re-formed generation: {time.monotonic() - partitioned_at:.2f}s")
    assert doc["restarts_by_reason"] == {"node_lost": 1}
    assert {n["node_id"] for n in members(doc)} == {"n1", "n2"}
    wait_for(lambda: not alive(cut_off), 20, "the partitioned host to stop its own worker (self-fencing)")
    assert "fencing: the coordinator is unreachable" in cluster.agents[2].log()

    subprocess.run(["ip", "-n", ns(3), "link", "set", "eth0", "up"], check=True)
    doc = wait(lambda d: d["generation"] >= 3 and d["world_size"] == 3 and d["state"] == "running", 60,
               "the healed host to rejoin by scale-up")
    assert doc["restarts_by_reason"].get("scale_up") == 1
    assert cluster.wait_all(120) == [0, 0, 0], cluster.logs()
    stale = [e for e in cluster.events() if e["event"] == "start" and e["stale"]]
    assert not stale, stale
    assert "Traceback" not in cluster.logs()  # evicting the lost host's session is routine, not an error


def test_a_host_whose_trainer_address_cannot_be_reached_is_set_aside_naming_it(
        hosts: None, make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """n3 advertises a second address of its host, whose packets from the coordinator's host go nowhere and are
    never answered (as behind a firewall that drops, or a dead NIC): the coordinator's probe gives up well before
    anyone's liveness timeout and names the address, instead of a TensorFlow start-up that would hang."""
    token = tmp_path / "token"
    token.write_text("multi-host-secret\n")
    token.chmod(0o600)
    cluster = make_cluster([sys.executable, COUNTER], endpoint=Endpoint(f"{SUBNET}.1", 29400), nodes="2:3",
                           extra_args=["--token-file", str(token), "--last-call", "5"],
                           env={"COUNTER_STEPS": "200", "COUNTER_STEP_SECONDS": "0.05"})
    cluster.start("n1", netns=ns(1))
    cluster.start("n2", netns=ns(2))
    hidden = f"{SUBNET}.33"
    subprocess.run(["ip", "-n", ns(3), "addr", "add", f"{hidden}/24", "dev", "eth0"], check=True)
    subprocess.run(["ip", "-n", ns(1), "neigh", "add", hidden, "lladdr", "02:00:00:00:00:99", "dev", "eth0", "nud",
                    "permanent"], check=True)  # a MAC address no host has: dropped without a word
    cluster.start("n3", netns=ns(3), extra=["--advertise-address", hidden])

    def quarantined(doc: dict[str, Any]) -> bool:
        return doc["world_size"] == 2 and any(n["state"] == "quarantined" for n in doc["nodes"])

    doc = wait_for(lambda: (d := status_from(cluster, 1, str(token))) is not None and quarantined(d) and d, 60,
                   "n1 and n2 running, n3 set aside", interval=0.2)
    [n3] = [n for n in doc["nodes"] if n["node_id"] == "n3"]
    assert n3["quarantine"]["kind"] == "node_check"
    assert n3["quarantine"]["reason"].startswith(f"node check failed: n3 cannot be reached at {hidden}:")
    assert n3["quarantine"]["reason"].endswith(" from the coordinator: no answer within 0.75s (a firewall, a "
                                               "dead NIC, or a wrong --advertise-address?)")
    assert "no message from the coordinator" not in cluster.agents[2].log()  # the probe did not make n3 fence
    assert {n["node_id"] for n in members(doc)} == {"n1", "n2"}
    assert cluster.wait_all(120) == [0, 0, 0], cluster.logs()
