"""`srun tfelastic run -- python train.py` with nothing else: real agents whose only configuration is a simulated
SLURM job step's environment (what srun sets for each task), on this machine.

The simulated step is `srun -N1 -n2 --gpus-per-task=1` on node `localhost`: both tasks on one node, so the
rendezvous (the step's first host) is loopback and needs no token, as on a developer's machine.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.netutil import port_taken
from tfelastic.daemon.slurm import rendezvous_port

from tests.cluster import COUNTER, Cluster
from tests.conftest import ClusterFactory

pytestmark = pytest.mark.integration

TRAINER = [sys.executable, COUNTER]
EX_CONFIG = 78
RECORDED = "TFELASTIC_JOB,TFELASTIC_NODE_ID,CUDA_VISIBLE_DEVICES"


@pytest.fixture(autouse=True)
def no_inherited_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agents inherit this process's environment: only the simulated step may say which GPUs they have."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def free_job_id() -> int:
    """A job id whose rendezvous port is free here, so that the test does not meet another test's coordinator."""
    for _ in range(100):
        job = random.randint(100_000, 999_999)
        if not port_taken("localhost", rendezvous_port(job, 0)):
            return job
    raise AssertionError("no free port in the SLURM rendezvous range 29500-29999")


def srun_env(job: int, task: int, **changes: str) -> dict[str, str]:
    """What srun sets for task ``task`` of `srun -N1 -n2 --gpus-per-task=1` on node localhost (step 0 of ``job``)."""
    return {
        "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
        "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURMD_NODENAME": "localhost",
        "SLURM_GPUS_PER_TASK": "1", "SLURM_STEP_GPUS": "0,1", **changes,
    }


def first_starts(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The generation-1 start event of each trainer, by the node id it was given."""
    return {e["env"]["TFELASTIC_NODE_ID"]: e for e in events if e["event"] == "start" and e["generation"] == 1}


def test_srun_style_agents_form_the_job_from_slurms_environment_alone(make_cluster: ClusterFactory) -> None:
    job = free_job_id()
    port = rendezvous_port(job, 0)
    cluster = make_cluster(TRAINER, endpoint=Endpoint("localhost", port),
                           env={"COUNTER_STEPS": "10", "COUNTER_RECORD_ENV": RECORDED})
    # Task 0 as SLURM binds a task to its GPU (CUDA_VISIBLE_DEVICES set); task 1 as when SLURM only names the
    # step's GPUs: the agent gives the trainer GPU 1 of SLURM_STEP_GPUS=0,1 (one per task, SLURM_LOCALID=1).
    cluster.start("task0", placement=False, env=srun_env(job, 0, CUDA_VISIBLE_DEVICES="0"))
    cluster.start("task1", placement=False, env=srun_env(job, 1))
    assert cluster.wait_all(60) == [0, 0], cluster.logs()

    starts = first_starts(cluster.events())
    assert set(starts) == {"localhost-0", "localhost-1"}, starts
    assert {e["world_size"] for e in starts.values()} == {2}
    assert {e["env"]["TFELASTIC_JOB"] for e in starts.values()} == {f"slurm-{job}"}
    assert starts["localhost-0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert starts["localhost-1"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert [e["step"] for e in cluster.events() if e["event"] == "end"] == [10, 10]

    logs = [agent.log() for agent in cluster.agents]
    for task, log in enumerate(logs):
        assert (f"from SLURM: job=slurm-{job} (SLURM_JOB_ID), node_id=localhost-{task} (SLURMD_NODENAME, "
                "SLURM_LOCALID), min_nodes=2 (SLURM_STEP_NUM_TASKS), max_nodes=2 (SLURM_STEP_NUM_TASKS), "
                f"rendezvous=localhost:{port} (SLURM_STEP_NODELIST, SLURM_JOB_ID, SLURM_STEP_ID)") in log, log
    assert "CUDA_VISIBLE_DEVICES=0 (kept as set)" in logs[0]
    assert "CUDA_VISIBLE_DEVICES=1 (SLURM_STEP_GPUS, SLURM_GPUS_PER_TASK, SLURM_LOCALID)" in logs[1]
    assert sum(f"hosting the coordinator on localhost:{port}" in log for log in logs) == 1, logs


def test_explicit_flags_and_toml_keys_win_over_slurm(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    job = free_job_id()
    cluster = make_cluster(TRAINER, endpoint=Endpoint("localhost", rendezvous_port(job, 0)),
                           env={"COUNTER_STEPS": "5", "COUNTER_RECORD_ENV": RECORDED})
    cluster.start("task0", placement=False, extra=["--job", "override", "--node-id", "custom-0"],
                  env=srun_env(job, 0))
    toml = tmp_path / "job.toml"  # no rendezvous, no node id, no node count: SLURM's
    toml.write_text(f'[job]\nname = "override"\ncommand = {json.dumps(TRAINER)}\n'
                    f'backup_dir = {json.dumps(str(tmp_path / "backup"))}\n[metrics]\nport = 0\nlinger = 0\n')
    cluster.launch("task1", [sys.executable, "-m", "tfelastic.daemon", "agent", "--config", str(toml)],
                   srun_env(job, 1))
    assert cluster.wait_all(60) == [0, 0], cluster.logs()

    starts = first_starts(cluster.events())
    assert set(starts) == {"custom-0", "localhost-1"}, starts
    assert {e["env"]["TFELASTIC_JOB"] for e in starts.values()} == {"override"}
    assert {e["world_size"] for e in starts.values()} == {2}
    log0, log1 = (agent.log() for agent in cluster.agents)
    assert "given explicitly: job, node_id, metrics_port" in log0 and "node_id=localhost-0" not in log0, log0
    assert "given explicitly: job, metrics_port" in log1 and "node_id=localhost-1 (SLURMD_NODENAME" in log1, log1


def tfelastic(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    return subprocess.run([sys.executable, "-m", "tfelastic.daemon", *args], env={**inherited, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)


def test_non_loopback_first_host_without_a_token_exits_78_with_the_command_that_makes_one(tmp_path: Path) -> None:
    job = 4242
    env = srun_env(job, 0, SLURM_STEP_NODELIST="gpu-[01-02]", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                   SLURMD_NODENAME="gpu-01", HOME=str(tmp_path))
    result = tfelastic("run", "--", *TRAINER, env=env, cwd=tmp_path)
    assert result.returncode == EX_CONFIG, result
    token = tmp_path / ".tfelastic" / "token"
    assert result.stderr == (
        f"tfelastic: configuration error: --token-file: the rendezvous gpu-01:{rendezvous_port(job, 0)} is not "
        f"loopback, so a shared token is required, and the SLURM default token file {token} does not exist; "
        f"create it once (the home directory is shared by the nodes): (umask 077 && mkdir -p {token.parent} && "
        f"openssl rand -hex 32 > {token}), or give a token file (--token-file, TOML rendezvous.token_file)\n")
    assert not token.exists()


def test_the_command_in_the_token_message_makes_a_token_the_agent_accepts(tmp_path: Path) -> None:
    # An unroutable documentation address as the first host: no name lookup, and no coordinator ever answers.
    env = srun_env(4242, 1, SLURM_STEP_NODELIST="192.0.2.[1-2]", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                   SLURMD_NODENAME="192.0.2.2", HOME=str(tmp_path))
    refused = tfelastic("run", "--", *TRAINER, env=env, cwd=tmp_path)
    assert refused.returncode == EX_CONFIG, refused
    command = refused.stderr.split("create it once (the home directory is shared by the nodes): ")[1].split(", or")[0]
    subprocess.run(["bash", "-c", command], check=True, cwd=tmp_path)
    token = tmp_path / ".tfelastic" / "token"
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    result = tfelastic("run", "--join-timeout", "1", "--metrics-port", "off", "--", *TRAINER, env=env, cwd=tmp_path)
    assert result.returncode == 1, result  # past the configuration: the coordinator stayed unreachable
    assert f"token_file={token} ($HOME)" in result.stderr, result.stderr


@pytest.mark.parametrize(("flags", "env"), [(["--no-slurm"], {}), ([], {"TFELASTIC_NO_SLURM": "1"})],
                         ids=["flag", "environment"])
def test_no_slurm_ignores_the_job_step(tmp_path: Path, flags: list[str], env: dict[str, str]) -> None:
    result = tfelastic("run", *flags, "--", "true", env={**srun_env(4242, 0), **env}, cwd=tmp_path)
    assert result.returncode == EX_CONFIG, result
    assert "tfelastic: configuration error: --rendezvous: required outside a SLURM job step" in result.stderr, \
        result.stderr


def test_the_harness_keeps_a_surrounding_slurm_job_out_of_other_tests(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    cluster = Cluster(tmp_path, Endpoint("127.0.0.1", 1), TRAINER)
    assert not {"SLURM_JOB_ID", "SLURMD_NODENAME"} & set(cluster.agent_env())
    assert cluster.agent_env({"SLURM_JOB_ID": "8"})["SLURM_JOB_ID"] == "8"
