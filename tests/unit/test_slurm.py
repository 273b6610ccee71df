"""Unit tests of daemon/slurm.py: SLURM's host lists and task counts, the values derived from a job step's
environment, and their precedence (explicit flags and TOML keys > SLURM > built-in defaults). Pure code: the
environments are dicts shaped like what srun sets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.cli import build_parser, config_from_run_args
from tfelastic.daemon.config import AgentConfig, from_values
from tfelastic.daemon.config_file import load_toml
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.metrics.gpu import GpuCollector, visible_gpus
from tfelastic.daemon.options import default_of
from tfelastic.daemon.slurm import (
    PORT_BASE,
    SlurmError,
    SlurmStep,
    expand_gpu_ids,
    expand_hostlist,
    expand_tasks_per_node,
    parse_gpus_per_task,
    rendezvous_port,
)

from tests.nvml_fake import FakeNvml

HOME = "/home/alice"
METRICS_PORT = 9464  # AgentConfig's default
TOKEN = f"{HOME}/.tfelastic/token"

# Task 1 of `srun -N2 --ntasks-per-node=1` in job 4242: one agent on each of gpu-01 and gpu-02.
TWO_NODES = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
    "SLURM_STEP_NODELIST": "gpu-[01-02]", "SLURM_JOB_NODELIST": "gpu-[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": "gpu-02", "HOME": HOME,
}


def step(env: dict[str, str], *, token_exists: bool = True, **changes: str | None) -> SlurmStep:
    """A step whose environment is ``env`` with ``changes`` (None: unset); the default token file exists."""
    return step_of(env, changes, token_exists)


def step_of(env: dict[str, str], changes: dict[str, str | None], token_exists: bool = True) -> SlurmStep:
    environ = {**env, **{k: v for k, v in changes.items() if v is not None}}
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
    return SlurmStep(environ, exists=lambda path: token_exists and path == TOKEN)


# ------------------------------------------------------------------------------------------------ host lists


@pytest.mark.parametrize(("text", "hosts"), [
    ("localhost", ["localhost"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),  # the low bound's width pads
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[001-002]", ["n001", "n002"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # several brackets: every combination, leftmost slowest
    ("rack[0-1]-gpu[08-09]-ib", ["rack0-gpu08-ib", "rack0-gpu09-ib", "rack1-gpu08-ib", "rack1-gpu09-ib"]),
    ("node[1-2]-ib,login", ["node1-ib", "node2-ib", "login"]),
    ("[1-2]", ["1", "2"]),
    ("10.0.0.1,10.0.0.2", ["10.0.0.1", "10.0.0.2"]),
    ("a[3],b", ["a3", "b"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-2],m5,o[3-4,6,7-9]", "node[01-03,07],gpu-a[1-2]", "node[08-11]", "a[3],b"])
def test_expand_hostlist_agrees_with_tensorflow(text: str) -> None:
    """SlurmClusterResolver's expansion is what TensorFlow users expect; ours covers what it covers."""
    resolver = pytest.importorskip("tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver")
    assert expand_hostlist(text) == resolver.expand_hostlist(text)


@pytest.mark.parametrize(("text", "message"), [
    ("", "the host list is empty"),
    ("node[1-", "'node[1-': a '[' is never closed"),
    ("node]1", "']' at position 4 closes no bracket"),
    ("node[[1]]", "'[' at position 5 is inside another bracket"),
    ("node[]", "'' in [] is not a number or a range like 01-04"),
    ("node[a-b]", "'a-b' in [a-b] is not a number or a range like 01-04"),
    ("node[1-2-3]", "'1-2-3' in [1-2-3] is not a number or a range like 01-04"),
    ("node[3-1]", "range '3-1' in [3-1] runs backwards; write it low-high"),
    ("a,,b", "'a,,b' has an empty host name"),
    ("a,", "'a,' has an empty host name"),
    (",a", "',a' has an empty host name"),
    ("node 1", "'node 1' has whitespace at position 4"),
    ("node[1-99999999]", "more than 65536"),
    ("a[1-60000],b[1-60000]", "expands to more than 65536 hosts"),
])
def test_expand_hostlist_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        expand_hostlist(text)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(("text", "counts"), [
    ("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,3", [1, 2, 3]), ("8(x1)", [8]),
])
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(("text", "message"), [
    ("", "'' in '' is not COUNT or COUNT(xREPEAT), e.g. 2(x3)"),
    ("2(3)", "'2(3)' in '2(3)' is not COUNT or COUNT(xREPEAT)"),
    ("2(x3", "'2(x3' in '2(x3' is not COUNT"),
    ("2,,1", "'' in '2,,1' is not COUNT"),
    ("x", "'x' in 'x' is not COUNT"),
    ("0", "'0' in '0': counts and repeats must be at least 1"),
    ("2(x0)", "'2(x0)' in '2(x0)': counts and repeats must be at least 1"),
])
def test_expand_tasks_per_node_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        expand_tasks_per_node(text)
    assert message in str(excinfo.value)


def test_gpu_id_lists_and_gpus_per_task() -> None:
    assert expand_gpu_ids("0,1") == ["0", "1"]
    assert expand_gpu_ids("0-3,6") == ["0", "1", "2", "3", "6"]
    assert parse_gpus_per_task("2") == 2
    assert parse_gpus_per_task("a100:2") == 2
    assert parse_gpus_per_task("a100:1,v100:1") == 2
    for bad in ("", "a100", "0", "a100:x"):
        with pytest.raises(ValueError, match="is not \\[TYPE:\\]COUNT"):
            parse_gpus_per_task(bad)
    with pytest.raises(ValueError, match="the GPU list is empty"):
        expand_gpu_ids("")


def test_rendezvous_port_is_deterministic_in_its_range_and_apart_for_nearby_jobs_and_steps() -> None:
    assert rendezvous_port(4242, 0) == rendezvous_port(4242, 0) == PORT_BASE + 42 * 5
    ports = {rendezvous_port(job, s) for job in range(1000, 1100) for s in range(5)}
    assert len(ports) == 500  # 100 consecutive jobs x 5 steps: no two share a port
    assert min(ports) == 29500 and max(ports) == 29999


# ------------------------------------------------------------------------------------------------ detection


@pytest.mark.parametrize(("env", "detected"), [
    ({}, False),
    ({"SLURM_JOB_ID": "7"}, False),  # an allocation (salloc shell), not a task of a step
    ({"SLURM_PROCID": "0"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}, True),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "TFELASTIC_NO_SLURM": "1"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "TFELASTIC_NO_SLURM": "true"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "TFELASTIC_NO_SLURM": "0"}, True),
])
def test_detect(env: dict[str, str], detected: bool) -> None:
    assert (SlurmStep.detect(env) is not None) is detected


def test_no_slurm_flag_turns_detection_off() -> None:
    assert SlurmStep.detect(TWO_NODES, off=True) is None


# ------------------------------------------------------------------------------------------------ derived values


def test_one_task_per_node() -> None:
    s = step(TWO_NODES)
    values = s.complete({})
    assert values == {
        "job": "slurm-4242", "node_id": "gpu-02", "min_nodes": 2, "max_nodes": 2,
        "rendezvous": Endpoint("gpu-01", rendezvous_port(4242, 0)), "token_file": TOKEN,
    }
    assert s.note == (
        "SLURM job 4242 step 0, task 1: from SLURM: job=slurm-4242 (SLURM_JOB_ID), node_id=gpu-02 (SLURMD_NODENAME), "
        "min_nodes=2 (SLURM_STEP_NUM_TASKS), max_nodes=2 (SLURM_STEP_NUM_TASKS), "
        f"rendezvous=gpu-01:{rendezvous_port(4242, 0)} (SLURM_STEP_NODELIST, SLURM_JOB_ID, SLURM_STEP_ID), "
        f"token_file={TOKEN} ($HOME); given explicitly: nothing")


def test_several_tasks_per_node_get_node_ids_and_metrics_ports_of_their_own() -> None:
    env = {**TWO_NODES, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "3",
           "SLURM_LOCALID": "1"}
    values = step(env).complete({})
    assert values["node_id"] == "gpu-02-1"
    assert values["metrics_port"] == METRICS_PORT + 1
    assert (values["min_nodes"], values["max_nodes"]) == (4, 4)
    task0 = step(env, SLURM_PROCID="2", SLURM_LOCALID="0").complete({})
    assert (task0["node_id"], task0["metrics_port"]) == ("gpu-02-0", METRICS_PORT)


def test_several_tasks_per_node_without_a_tasks_per_node_variable() -> None:
    env = {**TWO_NODES, "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"}
    assert step(env, SLURM_STEP_TASKS_PER_NODE=None).complete({})["node_id"] == "gpu-02-1"


def test_job_variables_stand_in_for_missing_step_variables() -> None:
    s = step(TWO_NODES, SLURM_STEP_NUM_TASKS=None, SLURM_STEP_NODELIST=None, SLURM_STEP_ID=None,
             SLURM_JOB_NODELIST="gpu-[07-08]")
    values = s.complete({})
    assert values["min_nodes"] == 2
    assert values["rendezvous"] == Endpoint("gpu-07", rendezvous_port(4242, 0))
    assert "min_nodes=2 (SLURM_NTASKS)" in s.note and "(SLURM_JOB_NODELIST, " in s.note


def test_step_id_moves_the_port() -> None:
    assert step(TWO_NODES, SLURM_STEP_ID="3").complete({})["rendezvous"].port == rendezvous_port(4242, 3)


def test_loopback_first_host_needs_no_token() -> None:
    s = step(TWO_NODES, token_exists=False, SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2")
    values = s.complete({})
    assert values["rendezvous"] == Endpoint("localhost", rendezvous_port(4242, 0))
    assert "token_file" not in values


def test_missing_default_token_file_is_refused_with_the_command_that_creates_it() -> None:
    with pytest.raises(SlurmError) as excinfo:
        step(TWO_NODES, token_exists=False).complete({})
    assert str(excinfo.value) == (
        f"--token-file: the rendezvous gpu-01:{rendezvous_port(4242, 0)} is not loopback, so a shared token is "
        f"required, and the SLURM default token file {TOKEN} does not exist; create it once (the home directory is "
        f"shared by the nodes): (umask 077 && mkdir -p {HOME}/.tfelastic && openssl rand -hex 32 > {TOKEN}), "
        "or give a token file (--token-file, TOML rendezvous.token_file)")


def test_the_token_is_never_made_up_from_job_values() -> None:
    values = step(TWO_NODES).complete({})
    assert values["token_file"] == TOKEN  # a file the user created; nothing else token-like is derived
    assert set(values) == {"job", "node_id", "min_nodes", "max_nodes", "rendezvous", "token_file"}


@pytest.mark.parametrize(("changes", "message"), [
    ({"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": None},
     "SLURM_STEP_NUM_TASKS / SLURM_NTASKS: not set in this SLURM job step; start tfelastic with srun"),
    ({"SLURMD_NODENAME": None}, "SLURMD_NODENAME: not set in this SLURM job step"),
    ({"SLURM_STEP_NODELIST": "gpu-[01-", "SLURM_JOB_NODELIST": None},
     "SLURM_STEP_NODELIST: 'gpu-[01-': a '[' is never closed"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x3)"},
     "SLURM_STEP_TASKS_PER_NODE: '1(x3)' counts tasks on 3 nodes, but SLURM_STEP_NODELIST lists 2: gpu-01,gpu-02"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(y)"}, "SLURM_STEP_TASKS_PER_NODE: '2(y)' in '2(y)' is not COUNT"),
    ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID: '12a' is not a non-negative integer"),
    ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS: '0': a step has at least 1 task"),
])
def test_bad_or_missing_variables_are_named(changes: dict[str, str | None], message: str) -> None:
    with pytest.raises(SlurmError) as excinfo:
        step_of(TWO_NODES, changes).complete({})
    assert message in str(excinfo.value)


def test_a_missing_variable_is_no_error_when_an_explicit_value_replaces_it() -> None:
    s = step(TWO_NODES, SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS=None, SLURMD_NODENAME=None)
    values = s.complete({"min_nodes": 2, "max_nodes": 2, "node_id": "n2"})
    assert (values["node_id"], values["min_nodes"]) == ("n2", 2)


# ------------------------------------------------------------------------------------------------ GPUs


def gpu_env(values: dict[str, Any]) -> str | None:
    return dict(values.get("env", ())).get("CUDA_VISIBLE_DEVICES")


def test_cuda_visible_devices_set_by_slurm_is_kept() -> None:
    s = step(TWO_NODES, CUDA_VISIBLE_DEVICES="0,1", SLURM_STEP_GPUS="4,5")
    values = s.complete({})
    assert gpu_env(values) is None  # the trainer inherits the agent's environment, so it sees SLURM's value
    assert "CUDA_VISIBLE_DEVICES=0,1 (kept as set)" in s.note


@pytest.mark.parametrize(("changes", "expected"), [
    ({"SLURM_STEP_GPUS": "2,3"}, "2,3"),
    ({"SLURM_JOB_GPUS": "1"}, "1"),
    ({"GPU_DEVICE_ORDINAL": "0,1", "SLURM_STEP_GPUS": "6,7"}, "0,1"),  # relative to the device cgroup: first
    ({"SLURM_STEP_GPUS": "4-7", "SLURM_GPUS_PER_TASK": "2", "SLURM_LOCALID": "1"}, "6,7"),
    ({"SLURM_STEP_GPUS": "4-7", "SLURM_GPUS_PER_TASK": "a100:2", "SLURM_LOCALID": "0"}, "4,5"),
    ({"SLURM_STEP_GPUS": "3", "SLURM_GPUS_PER_TASK": "1", "SLURM_LOCALID": "0"}, "3"),
])
def test_cuda_visible_devices_from_slurm_gpu_variables(changes: dict[str, str | None], expected: str) -> None:
    s = step_of(TWO_NODES, changes)
    assert gpu_env(s.complete({})) == expected
    assert f"CUDA_VISIBLE_DEVICES={expected} (" in s.note


def test_no_gpu_variables_no_cuda_visible_devices() -> None:
    assert "env" not in step(TWO_NODES).complete({})


def test_explicit_cuda_visible_devices_in_job_env_wins() -> None:
    values = step(TWO_NODES, SLURM_STEP_GPUS="2,3").complete({"env": (("CUDA_VISIBLE_DEVICES", "7"),)})
    assert gpu_env(values) == "7"


def test_slurm_gpus_join_the_other_job_env_entries() -> None:
    values = step(TWO_NODES, SLURM_STEP_GPUS="2").complete({"env": (("NCCL_DEBUG", "WARN"),)})
    assert values["env"] == (("CUDA_VISIBLE_DEVICES", "2"), ("NCCL_DEBUG", "WARN"))


def test_too_few_gpus_for_this_task_is_an_error() -> None:
    with pytest.raises(SlurmError, match=r"SLURM_STEP_GPUS: '0,1,2' has 3 GPUs, too few for task SLURM_LOCALID=1 "
                                          r"with SLURM_GPUS_PER_TASK=2"):
        step(TWO_NODES, SLURM_STEP_GPUS="0,1,2", SLURM_GPUS_PER_TASK="2", SLURM_LOCALID="1").complete({})


@pytest.mark.parametrize(("value", "visible"), [
    (None, None), ("", ()), ("0,2", ("0", "2")), ("02", ("2",)), ("1,-1,2", ("1",)), ("-1", ()),
    ("GPU-abcd,3", ("GPU-abcd", "3")), ("MIG-1234", None),
])
def test_visible_gpus(value: str | None, visible: tuple[str, ...] | None) -> None:
    assert visible_gpus(value) == visible


def test_gpu_metrics_report_only_the_trainers_gpus() -> None:
    nvml = FakeNvml(4)
    collector = GpuCollector(nvml=nvml, visible=("1", nvml.gpus[3].uuid))  # CUDA takes UUIDs too
    reported = {s.labels["gpu"] for family in collector.collect() if family.name == "tfelastic_gpu_info"
                for s in family.samples}
    assert reported == {"1", "3"}
    assert collector.utilization()[0] == 2


# ------------------------------------------------------------------------------------------------ precedence


def values(config: AgentConfig, *names: str) -> tuple[object, ...]:
    return tuple(config.value(name) for name in names)


def run_config(*flags: str, env: dict[str, str] | None = TWO_NODES, token_exists: bool = True) -> AgentConfig:
    args = build_parser().parse_args(["run", *flags, "--", "python", "train.py"])
    return config_from_run_args(args, None if env is None else SlurmStep(env, exists=lambda p: token_exists))


def test_flags_win_over_slurm() -> None:
    config = run_config("--job", "mine", "--node-id", "n-7", "--nodes", "1:2", "--rendezvous", "127.0.0.1:4000",
                        "--token-file", "/etc/t", "--metrics-port", "off", token_exists=False)
    assert values(config, "job", "node_id", "min_nodes", "max_nodes") == ("mine", "n-7", 1, 2)
    assert values(config, "rendezvous", "token_file", "metrics_port") == (Endpoint("127.0.0.1", 4000), "/etc/t", None)


def test_slurm_wins_over_built_in_defaults() -> None:
    config = run_config("--node-id", "n-7")  # one flag given: only it is kept, SLURM fills the others
    assert values(config, "job", "node_id", "min_nodes", "max_nodes") == ("slurm-4242", "n-7", 2, 2)
    assert values(config, "rendezvous", "token_file") == (Endpoint("gpu-01", rendezvous_port(4242, 0)), TOKEN)
    assert config.value("metrics_port") == default_of("metrics_port")


def test_an_explicit_non_loopback_rendezvous_under_slurm_takes_the_default_token_file() -> None:
    config = run_config("--rendezvous", "head:29400")
    assert config.value("token_file") == TOKEN


def test_flag_equal_to_the_built_in_default_still_wins() -> None:
    config = run_config("--job", "default", "--nodes", "1")
    assert values(config, "job", "min_nodes", "max_nodes") == ("default", 1, 1)


def test_without_slurm_the_built_in_defaults_apply() -> None:
    config = run_config("--rendezvous", "127.0.0.1:4000", env=None)
    defaults = from_values({"command": ("x",), "rendezvous": Endpoint("127.0.0.1", 4000)})
    names = ("job", "min_nodes", "max_nodes", "token_file", "metrics_port")
    assert [config.value(n) for n in names] == [defaults.value(n) for n in names] == ["default", 1, 1, "", 9464]
    assert config.value("node_id") == defaults.node.id


def test_without_slurm_the_rendezvous_is_required() -> None:
    with pytest.raises(ConfigError, match=r"^--rendezvous: required outside a SLURM job step"):
        run_config(env=None)


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_toml_keys_win_over_slurm_and_slurm_fills_the_rest(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[job]\ncommand = ["python", "train.py"]\nname = "mnist"\n[node]\nid = "n-a"\n')
    s = step(TWO_NODES)
    config = load_toml(path, complete=s.complete)
    assert values(config, "job", "node_id", "min_nodes") == ("mnist", "n-a", 2)
    assert values(config, "rendezvous", "token_file") == (Endpoint("gpu-01", rendezvous_port(4242, 0)), TOKEN)
    assert s.note.endswith("given explicitly: job, node_id")


def test_toml_min_nodes_alone_fixes_max_nodes_before_slurm(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[job]\ncommand = ["true"]\nmin_nodes = 1\n')
    config = load_toml(path, complete=step(TWO_NODES).complete)
    assert values(config, "min_nodes", "max_nodes") == (1, 1)


def test_toml_max_nodes_below_slurms_task_count_names_the_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[job]\ncommand = ["true"]\nmax_nodes = 1\n')
    with pytest.raises(ConfigError, match=r"job\.toml: job\.max_nodes: max_nodes 1 is below min_nodes 2"):
        load_toml(path, complete=step(TWO_NODES).complete)


def test_toml_without_slurm_still_requires_the_endpoint(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[job]\ncommand = ["true"]\n')
    with pytest.raises(ConfigError, match=r"rendezvous\.endpoint is required"):
        load_toml(path)


def test_real_home_is_the_default_when_home_is_unset() -> None:
    env = {k: v for k, v in TWO_NODES.items() if k != "HOME"}
    seen: list[str] = []

    def exists(path: str) -> bool:
        seen.append(path)
        return True

    SlurmStep(env, exists=exists).complete({})
    assert seen == [os.path.join(os.path.expanduser("~"), ".tfelastic/token")]
