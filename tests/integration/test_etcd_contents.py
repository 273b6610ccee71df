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

from tests.cluster import COUNTER
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
