"""Where a command's settings come from (daemon/sources.py): flags, then TFELASTIC_* variables, then the job file,
for every command; and the exit codes of a malformed command line (2) against a bad setting (78)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tfelastic.daemon.agent.runner import trainer_env
from tfelastic.daemon.cli import (
    _operator_config,
    build_parser,
    config_from_coordinator_args,
    config_from_file,
    config_from_run_args,
    main,
)
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.rendezvous.api import Assignment, Member
from tfelastic.daemon.sources import config_variables, env_name

JOB = """\
[job]
name = "mnist"
command = ["python", "train.py"]
min_nodes = 2
max_nodes = 4

[node]
stop_grace = 7

[rendezvous]
endpoint = "127.0.0.1:29400"
token_file = "/etc/tfelastic/token"
heartbeat_interval = 1.0
node_timeout = 5.0

[metrics]
port = 9500
"""


@pytest.fixture
def job_file(tmp_path: Path) -> str:
    path = tmp_path / "mnist.toml"
    path.write_text(JOB)
    return str(path)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_run_takes_the_job_file_and_flags_and_the_environment_win_over_it(job_file: str) -> None:
    args = parse("run", "--config", job_file, "--stop-grace", "3")
    config = config_from_run_args(args, environ={"TFELASTIC_NODES": "2:8", "TFELASTIC_METRICS_PORT": "off"})
    assert config.job.command == ("python", "train.py") and config.job.name == "mnist"
    assert (config.job.min_nodes, config.job.max_nodes) == (2, 8)  # the environment over the file
    assert config.node.stop_grace == 3.0  # the flag over the file
    assert config.metrics.port is None  # the environment's "off"
    assert config.rendezvous.heartbeat_interval == 1.0  # the file's


def test_the_trainer_command_after_dashes_wins_over_the_files(job_file: str) -> None:
    config = config_from_run_args(parse("run", "--config", job_file, "--", "python", "other.py"), environ={})
    assert config.job.command == ("python", "other.py")


def test_run_takes_every_option_of_the_job_file_even_those_without_a_flag(tmp_path: Path) -> None:
    path = tmp_path / "env.toml"
    path.write_text(JOB.replace('max_nodes = 4\n', 'max_nodes = 4\nenv = { DATA_DIR = "/data" }\n'))
    config = config_from_run_args(parse("run", "--config", str(path)), environ={})
    assert config.job.env == (("DATA_DIR", "/data"),)  # no flag: the job file alone gives it
    assert (config.job.min_nodes, config.job.max_nodes) == (2, 4)  # max_nodes shares --nodes


def test_tfelastic_config_names_the_file(job_file: str) -> None:
    config = config_from_run_args(parse("run"), environ={"TFELASTIC_CONFIG": job_file})
    assert config.job.name == "mnist"


def test_the_agent_reads_the_environment_over_its_file(job_file: str) -> None:
    assert config_from_file(job_file, environ={"TFELASTIC_NODE_ID": "gpu-07"}).node.id == "gpu-07"


def test_operator_commands_find_their_job_in_the_job_file(job_file: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o600)
    config, read = _operator_config(parse("status", "--config", job_file, "--token-file", str(token)), environ={})
    assert config.job == "mnist" and config.rendezvous.endpoint == Endpoint("127.0.0.1", 29400)
    assert read == "secret"  # the flag's file, not the job file's
    etcd, _ = _operator_config(parse("report"), environ={"TFELASTIC_RENDEZVOUS": "etcd://10.0.0.1:2379",
                                                         "TFELASTIC_JOB": "bert"})
    assert isinstance(etcd.rendezvous.endpoint, EtcdTarget) and etcd.job == "bert"


def test_an_operator_command_without_a_rendezvous_says_where_to_give_it() -> None:
    with pytest.raises(ConfigError, match=r"^--rendezvous: required; .*--config JOB.toml, or \$TFELASTIC_RENDEZVOUS"):
        _operator_config(parse("status"), environ={})


def test_a_standalone_coordinator_listens_on_the_job_files_endpoint(job_file: str) -> None:
    config = config_from_coordinator_args(parse("coordinator", "--config", job_file), environ={})
    assert config.listen == Endpoint("127.0.0.1", 29400) and config.job == "mnist"
    assert config.rendezvous.node_timeout == 5.0 and config.metrics.port == 9500
    with pytest.raises(ConfigError, match=r"^--listen: required with an etcd rendezvous"):
        config_from_coordinator_args(parse("coordinator"), environ={"TFELASTIC_RENDEZVOUS": "etcd://h:2379"})


def test_a_head_node_candidate_on_etcd_takes_its_listen_address_from_the_environment() -> None:
    """tfelastic-coordinator@.service passes the job file alone: a drop-in's TFELASTIC_LISTEN says where to serve."""
    environ = {"TFELASTIC_RENDEZVOUS": "etcd://h:2379", "TFELASTIC_LISTEN": "10.0.0.9:29400"}
    config = config_from_coordinator_args(parse("coordinator"), environ=environ)
    assert config.listen == Endpoint("10.0.0.9", 29400) and isinstance(config.rendezvous.endpoint, EtcdTarget)
    flag = config_from_coordinator_args(parse("coordinator", "--listen", "10.0.0.8:1"), environ=environ)
    assert flag.listen == Endpoint("10.0.0.8", 1)  # the flag first, as everywhere
    with pytest.raises(ConfigError, match=r"^TFELASTIC_LISTEN: "):
        config_from_coordinator_args(parse("coordinator"), environ={**environ, "TFELASTIC_LISTEN": "nowhere"})


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("TFELASTIC_STOP_GRACE", "soon", "TFELASTIC_STOP_GRACE: 'soon' is not a number"),
    ("TFELASTIC_WORKER_PORT", "80.5", "TFELASTIC_WORKER_PORT: '80.5' is not a whole number"),
    ("TFELASTIC_NODES", "3:2", "TFELASTIC_NODES: '3:2': MAX 2 is below MIN 3"),
    ("TFELASTIC_WARM_START", "maybe", "TFELASTIC_WARM_START: 'maybe' is neither true nor false"),
    ("TFELASTIC_STALL_TIMEOUT", "soon", "TFELASTIC_STALL_TIMEOUT: 'soon' is neither 'auto' nor a number"),
])
def test_a_bad_variable_is_a_configuration_error_naming_it(job_file: str, variable: str, value: str,
                                                          message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        config_from_run_args(parse("run", "--config", job_file), environ={variable: value})
    assert str(excinfo.value).startswith(message), str(excinfo.value)


@pytest.mark.parametrize(("where", "named"), [
    ("flag", "--join-timeout"),
    ("variable", "TFELASTIC_JOIN_TIMEOUT"),
    ("file", "{file}: rendezvous.join_timeout"),
])
@pytest.mark.parametrize("command", ["run", "agent", "coordinator"])
def test_a_value_out_of_bounds_is_named_where_it_was_written(tmp_path: Path, command: str, where: str,
                                                            named: str) -> None:
    """A refusal after parsing names the setting the user wrote: a variable or the file's key, not a flag that was
    never given."""
    if where == "flag" and command == "agent":
        return  # tfelastic agent has no flags for settings: its job file and the variables
    path = tmp_path / "job.toml"
    written = "node_timeout = 5.0\njoin_timeout = -3\n" if where == "file" else "node_timeout = 5.0\n"
    path.write_text(JOB.replace("node_timeout = 5.0\n", written))
    environ = {"TFELASTIC_JOIN_TIMEOUT": "-3"} if where == "variable" else {}
    flags = ["--join-timeout", "-3"] if where == "flag" else []
    with pytest.raises(ConfigError) as excinfo:
        if command == "agent":
            config_from_file(str(path), environ=environ)
        elif command == "run":
            config_from_run_args(parse("run", "--config", str(path), *flags), environ=environ)
        else:
            config_from_coordinator_args(parse("coordinator", "--config", str(path), *flags), environ=environ)
    assert str(excinfo.value) == f"{named.format(file=path)}: -3.0 seconds must be 0 or more"


def test_a_job_name_from_the_environment_is_named_by_its_variable() -> None:
    with pytest.raises(ConfigError, match=r"^TFELASTIC_JOB: '\.\.' must be "):
        _operator_config(parse("status", "--rendezvous", "127.0.0.1:29400"), environ={"TFELASTIC_JOB": ".."})


def test_the_trainer_never_inherits_the_agents_settings_from_its_environment() -> None:
    base = {env_name("token_file"): "/etc/tfelastic/token", "TFELASTIC_CONFIG": "/etc/tfelastic/job.toml",
            env_name("metrics_port"): "9500", "PATH": "/usr/bin"}
    assignment = Assignment(1, 0, 1, (Member("a", 0, "h", 2222),), 0)
    env = trainer_env(base, assignment, job="mnist", node_id="a", backup_dir="/b", progress_socket="/p",
                      instrument=False)
    assert env["PATH"] == "/usr/bin"
    assert not {"TFELASTIC_TOKEN_FILE", "TFELASTIC_CONFIG", "TFELASTIC_METRICS_PORT"} & set(env)
    assert env["TFELASTIC_JOB"] == "mnist"  # the contract's own, set by the agent
    assert "TFELASTIC_RENDEZVOUS" in config_variables() and "TFELASTIC_NODES" in config_variables()


@pytest.mark.parametrize(("argv", "code"), [
    (["launch"], 2),  # an unknown subcommand
    (["run", "--bogus", "--", "true"], 2),  # an unknown flag
    (["run", "--rendezvous"], 2),  # a flag without its value
    (["run", "--rendezvous", "127.0.0.1:29400", "--stall-timeout", "soon", "--", "true"], 78),  # a bad value
    (["run", "--rendezvous", "127.0.0.1:29400", "--log-level", "loud", "--", "true"], 78),
])
def test_a_malformed_command_line_exits_2_and_a_bad_value_78(argv: list[str], code: int) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == code

