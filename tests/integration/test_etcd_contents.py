"""What agents and coordinators do with etcd contents that tfelastic did not write: a job state of the wrong
shape, a leader key without a lease or not JSON. A real etcd, real agents with the counter trainer, a real
standalone coordinator."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tfelastic.daemon.exit_codes import ExitCode

from tests.cluster import COUNTER, wait_for
from tests.conftest import ClusterFactory
from tests.etcd import EtcdCluster

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
FAST = ["--stop-grace", "2", "--last-call", "0.5", "--join-timeout", "60"]
BAD_GENERATION: dict[str, object] = {"version": 1, "spec": None, "state": "waiting", "reason": "", "generation": "1",
                                     "members": []}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1).start()
    yield cluster
    cluster.stop()


def put(etcd: EtcdCluster, key: str, value: str) -> None:
    result = etcd.etcdctl("put", key, value)
    assert result.returncode == 0, result.stderr


def test_agents_refuse_a_job_state_of_the_wrong_shape_in_seconds_naming_the_key(make_cluster: ClusterFactory,
                                                                                 etcd: EtcdCluster) -> None:
    """Each agent in turn wins the election, reads the state, gives the lead up and exits 78 with the key, the
    field and the etcdctl commands; none overwrites the state."""
    put(etcd, "/tfelastic/shape/state", json.dumps(BAD_GENERATION))
    cluster = make_cluster(TRAINER, extra_args=[*FAST, "--job", "shape"], etcd=etcd.url)
    started = time.monotonic()
    agents = [cluster.start("a"), cluster.start("b")]
    codes = [agent.wait(40) for agent in agents]
    assert codes == [ExitCode.CONFIG] * 2, cluster.logs()
    assert time.monotonic() - started < 30
    for agent in agents:
        log = agent.log()
        assert "key /tfelastic/shape/state" in log and "generation: '1' is not an integer" in log, log
        assert f"etcdctl --endpoints {etcd.members[0].client_url} del /tfelastic/shape/state" in log
        assert "Traceback" not in log
    assert json.loads(etcd.etcdctl("get", "--print-value-only", "/tfelastic/shape/state").stdout) == BAD_GENERATION


def test_a_standalone_coordinator_refuses_it_too(tmp_path: Path, etcd: EtcdCluster) -> None:
    put(etcd, "/tfelastic/head/state", json.dumps(dict(BAD_GENERATION, generation=2 ** 80)))
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen", "127.0.0.1:0",
                             "--rendezvous", etcd.url, "--job", "head", "--metrics-port", "off"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "key /tfelastic/head/state" in result.stderr and "generation: 1208925819614629174706176 is out of " \
                                                             "range" in result.stderr, result.stderr


def test_report_refuses_it_as_a_bad_configuration_and_says_so_in_json_too(tmp_path: Path, etcd: EtcdCluster) -> None:
    put(etcd, "/tfelastic/ledger/state", json.dumps(BAD_GENERATION))
    base = [sys.executable, "-m", "tfelastic.daemon", "report", "--rendezvous", etcd.url, "--job", "ledger"]
    text = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert text.returncode == ExitCode.CONFIG and "key /tfelastic/ledger/state" in text.stderr, text
    assert "Traceback" not in text.stderr
    as_json = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert as_json.returncode == ExitCode.CONFIG, as_json
    assert "generation: '1' is not an integer" in json.loads(as_json.stdout)["error"]


def agent_finishes(make_cluster: ClusterFactory, etcd: EtcdCluster, job: str) -> str:
    """One agent of ``job`` trains to the end (exit 0) well before its join timeout; its log."""
    cluster = make_cluster(TRAINER, nodes="1", extra_args=[*FAST, "--job", job], etcd=etcd.url,
                           env={"COUNTER_STEPS": "5"})
    agent = cluster.start("a")
    assert agent.wait(40) == 0, cluster.logs()
    return agent.log()


def test_a_leader_key_without_a_lease_is_removed_and_the_election_goes_on(make_cluster: ClusterFactory,
                                                                          etcd: EtcdCluster) -> None:
    """No tfelastic leader's key lacks a lease (it goes with its leader); one that does would never go."""
    put(etcd, "/tfelastic/orphan/leader", "garbage")
    log = agent_finishes(make_cluster, etcd, "orphan")
    assert "the leader key /tfelastic/orphan/leader in etcd has no lease" in log and "'garbage'" in log, log


def test_a_fake_leader_without_a_lease_is_removed_too(make_cluster: ClusterFactory, etcd: EtcdCluster) -> None:
    put(etcd, "/tfelastic/fake/leader", json.dumps({"node": "evil", "address": "127.0.0.1:1", "since": 0.0}))
    log = agent_finishes(make_cluster, etcd, "fake")
    assert "the leader key /tfelastic/fake/leader in etcd has no lease" in log, log


def test_a_leader_key_that_is_not_tfelastics_is_reported_while_its_lease_lasts(make_cluster: ClusterFactory,
                                                                               etcd: EtcdCluster) -> None:
    """With a lease, the key may be a live program's: the candidates wait for the lease, and say why (with the
    value cut short: a 1.4 MB value once made 1.4 MB log lines)."""
    lease = etcd.etcdctl("lease", "grant", "600").stdout.split()[1]
    huge = json.dumps({"node": "n" * 1_400_000, "address": "127.0.0.1:1", "since": 0.0})
    (etcd.tmp / "huge.json").write_text(huge)
    result = subprocess.run(f"ETCDCTL_API=3 etcdctl --endpoints {etcd.members[0].client_url} put --lease={lease} "
                            f"/tfelastic/held/leader < {etcd.tmp / 'huge.json'}", shell=True, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    cluster = make_cluster(TRAINER, nodes="1", extra_args=[*FAST, "--job", "held"], etcd=etcd.url,
                           env={"COUNTER_STEPS": "5"})
    agent = cluster.start("a")
    wait_for(lambda: "not one a tfelastic coordinator writes" in agent.log(), 30, "the report of the leader key")
    assert etcd.etcdctl("lease", "revoke", lease).returncode == 0
    assert agent.wait(40) == 0, cluster.logs()
    assert max(len(line) for line in agent.log().splitlines()) < 2000
    assert agent.log().count("not one a tfelastic coordinator writes") == 1  # once, not at every look


def test_a_head_node_registration_without_a_lease_does_not_keep_agents_from_leading(
        make_cluster: ClusterFactory, etcd: EtcdCluster) -> None:
    put(etcd, "/tfelastic/ghost/coordinators/head-9", "1")
    log = agent_finishes(make_cluster, etcd, "ghost")
    assert "/tfelastic/ghost/coordinators/head-9 in etcd has no lease" in log, log


def test_a_role_per_job_lets_a_job_run_and_keeps_it_out_of_other_jobs(make_cluster: ClusterFactory,
                                                                      tmp_path: Path) -> None:
    """The commands docs/operations.md recommends, on a real etcd: the job's user may write /tfelastic/JOB/ only."""
    folder = tmp_path / "etcd-auth"
    folder.mkdir()
    etcd = EtcdCluster(folder, size=1).start()
    try:
        for args in (["user", "add", "root:rootpw"], ["auth", "enable"],
                     ["role", "add", "tfelastic-mnist"],
                     ["role", "grant-permission", "tfelastic-mnist", "--prefix=true", "readwrite", "/tfelastic/mnist/"],
                     ["user", "add", "tfelastic-mnist:s3cret"], ["user", "grant-role", "tfelastic-mnist",
                                                                 "tfelastic-mnist"]):
            done = etcd.etcdctl(*args, user="" if args[:2] == ["user", "add"] and "root" in args[2] else "root:rootpw")
            assert done.returncode == 0, (args, done.stderr)
        secret = tmp_path / "etcd-password"
        secret.write_text("tfelastic-mnist:s3cret\n")
        secret.chmod(0o600)
        flags = [*FAST, "--etcd-password-file", str(secret)]
        cluster = make_cluster(TRAINER, nodes="1", extra_args=[*flags, "--job", "mnist"], etcd=etcd.url,
                               env={"COUNTER_STEPS": "5"})
        assert cluster.start("a").wait(40) == 0, cluster.logs()
        other = make_cluster(TRAINER, nodes="1", extra_args=[*flags, "--job", "other"], etcd=etcd.url)
        intruder = other.start("b")
        assert intruder.wait(40) == ExitCode.CONFIG, other.logs()
        assert "permission denied" in intruder.log(), intruder.log()
    finally:
        etcd.stop()
