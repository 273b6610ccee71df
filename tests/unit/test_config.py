"""Unit tests of the agent configuration (:mod:`tfelastic.daemon.config`): every problem is a ConfigError whose
message names the option (a flag, or the file and its key)."""

from __future__ import annotations

import math
import os
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.config import AgentConfig, from_values, parse_nodes, validate
from tfelastic.daemon.config_file import load_toml
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.exit_codes import EX_CONFIG
from tfelastic.daemon.options import OPTIONS
from tfelastic.daemon.secret_file import read_token
from tfelastic.daemon.worker.stall import STALL_AUTO, StallLimits, StallTimeout

BASE = from_values({"command": ("python", "train.py"), "rendezvous": Endpoint("127.0.0.1", 29400),
                    "node_id": "node-a"})


def test_ex_config_is_78() -> None:
    assert EX_CONFIG == 78


# ------------------------------------------------------------------------------------------------ parse_nodes


@pytest.mark.parametrize(("text", "expected"), [("2", (2, 2)), ("2:4", (2, 4)), ("1", (1, 1)), ("3:3", (3, 3))])
def test_parse_nodes(text: str, expected: tuple[int, int]) -> None:
    assert parse_nodes(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("3:2", "--nodes: '3:2': MAX 2 is below MIN 3; write MIN:MAX, e.g. 2:4"),
    ("0", "--nodes: '0': the minimum must be at least 1"),
    ("0:2", "--nodes: '0:2': the minimum must be at least 1"),
    ("-1", "--nodes: '-1': the minimum must be at least 1"),
    ("x", "--nodes: 'x' is not MIN[:MAX], e.g. 2 or 2:4"),
    ("2:x", "--nodes: '2:x' is not MIN[:MAX], e.g. 2 or 2:4"),
    ("", "--nodes: '' is not MIN[:MAX], e.g. 2 or 2:4"),
    ("1:2:3", "--nodes: '1:2:3' is not MIN[:MAX], e.g. 2 or 2:4"),
])
def test_parse_nodes_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_nodes(text)
    assert str(excinfo.value) == message


def test_parse_nodes_refuses_a_missing_max() -> None:
    # "1:" has a ':' but no MAX: it is refused, not read as "MAX same as MIN".
    with pytest.raises(ConfigError, match=r"^--nodes: '1:'"):
        parse_nodes("1:")


def test_parse_nodes_names_the_option_it_is_given() -> None:
    with pytest.raises(ConfigError, match=r"^job\.toml: nodes: 'x' is not MIN\[:MAX\]"):
        parse_nodes("x", option="job.toml: nodes")


# ------------------------------------------------------------------------------------------------ Endpoint


@pytest.mark.parametrize(("text", "host", "port"), [
    ("head-node:29400", "head-node", 29400),
    ("127.0.0.1:1", "127.0.0.1", 1),
    ("[::1]:29400", "::1", 29400),
    ("[fe80::1]:65535", "fe80::1", 65535),
])
def test_endpoint_parse(text: str, host: str, port: int) -> None:
    endpoint = Endpoint.parse(text, "--rendezvous")
    assert endpoint == Endpoint(host, port)
    assert str(endpoint) == text


@pytest.mark.parametrize(("text", "message"), [
    ("head-node", "--rendezvous: 'head-node' is not HOST:PORT; write it like 'head-node:29400'"),
    ("head-node:", "--rendezvous: 'head-node:' is not HOST:PORT; write it like 'head-node:29400'"),
    (":29400", "--rendezvous: ':29400' is not HOST:PORT; write it like 'head-node:29400'"),
    ("[]:29400", "--rendezvous: '[]:29400' is not HOST:PORT; write it like 'head-node:29400'"),
    ("head:-1", "--rendezvous: 'head:-1' is not HOST:PORT; write it like 'head-node:29400'"),
    ("head:port", "--rendezvous: 'head:port' is not HOST:PORT; write it like 'head-node:29400'"),
    ("head:0", "--rendezvous: port 0 in 'head:0' is out of range 1-65535"),
    ("head:70000", "--rendezvous: port 70000 in 'head:70000' is out of range 1-65535"),
    ("head:65536", "--rendezvous: port 65536 in 'head:65536' is out of range 1-65535"),
])
def test_endpoint_parse_errors_name_the_option(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        Endpoint.parse(text, "--rendezvous")
    assert str(excinfo.value) == message


def test_endpoint_port_zero_only_where_allowed() -> None:
    assert Endpoint.parse("0.0.0.0:0", "--listen", allow_port_zero=True) == Endpoint("0.0.0.0", 0)
    with pytest.raises(ConfigError, match=r"^--listen: port 0 in '0\.0\.0\.0:0' is out of range"):
        Endpoint.parse("0.0.0.0:0", "--listen")


@pytest.mark.parametrize("text", ["head:\u00b2", "head:\u00b9\u00b2"], ids=["superscript-2", "superscript-12"])
def test_endpoint_parse_refuses_non_ascii_digits_with_a_config_error(text: str) -> None:
    # str.isdigit() accepts superscript digits such as '²' but int() does not: the port is still refused with a
    # ConfigError naming the option, never a bare ValueError.
    with pytest.raises(ConfigError, match=r"^--rendezvous: "):
        Endpoint.parse(text, "--rendezvous")


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
    ("10.1.2.3", False), ("0.0.0.0", False), ("head-node", False), ("::", False),
])
def test_endpoint_is_loopback(host: str, loopback: bool) -> None:
    assert Endpoint(host, 29400).is_loopback() is loopback


# ------------------------------------------------------------------------------------------------ validate


def test_validate_returns_a_valid_config_unchanged() -> None:
    assert validate(BASE) is BASE


@pytest.mark.parametrize(("changes", "message"), [
    ({"command": ()}, "the trainer command (after --): no trainer command given; add it after '--'"),
    ({"min_nodes": 0, "max_nodes": 0}, "--nodes: min_nodes is 0; it must be at least 1"),
    ({"min_nodes": 3, "max_nodes": 2}, "--nodes: max_nodes 2 is below min_nodes 3; write MIN:MAX"),
    ({"job": ""}, "--job: '' must be non-empty letters, digits, '-', '_' or '.'"),
    ({"job": "my job"}, "--job: 'my job' must be non-empty letters, digits, '-', '_' or '.'"),
    ({"job": ".."}, "--job: '..' must be non-empty letters, digits, '-', '_' or '.' (ASCII, starting with a letter"),
    ({"job": "."}, "--job: '.' must be non-empty letters"),
    ({"job": "modèle"}, "--job: 'modèle' must be non-empty letters"),
    ({"job": "a/b"}, "--job: 'a/b' must be non-empty"),
    ({"node_id": ""}, "--node-id: '' must be 1-128 letters, digits, '.', '_', ':', '@' or '-'"),
    ({"node_id": "node a"}, "--node-id: 'node a' must be 1-128 letters, digits, '.', '_', ':', '@' or '-'"),
    ({"worker_port": 65536}, "--worker-port: 65536 is out of range 0-65535"),
    ({"worker_port": -1}, "--worker-port: -1 is out of range 0-65535"),
    ({"max_restarts": -1}, "--max-restarts: -1 must be 0 or more"),
    ({"restart_window": -1.0}, "--restart-window: -1.0 seconds must be 0 or more"),
    ({"stall_timeout": StallTimeout(-0.5)}, "--stall-timeout: -0.5 seconds must be 0 or more"),
    ({"stall_timeout": StallTimeout(math.nan)}, "--stall-timeout: nan seconds must be 0 or more"),
    ({"stop_grace": -1.0}, "--stop-grace: -1.0 seconds must be 0 or more"),
    ({"last_call": -1.0}, "--last-call: -1.0 seconds must be 0 or more"),
    ({"settle": -1.0}, "--settle: -1.0 seconds must be 0 or more"),
    ({"join_timeout": -1.0}, "--join-timeout: -1.0 seconds must be 0 or more"),
    ({"heartbeat_interval": -1.0}, "--heartbeat-interval: -1.0 seconds must be 0 or more"),
    ({"node_timeout": -1.0}, "--node-timeout: -1.0 seconds must be 0 or more"),
    ({"node_timeout": 0.5}, "--node-timeout: 0.5s must exceed heartbeat_interval 0.5s"),
    ({"node_timeout": 0.4}, "--node-timeout: 0.4s must exceed heartbeat_interval 0.5s"),
    ({"heartbeat_interval": 0.0}, "--heartbeat-interval: 0.0s must be more than 0"),
    ({"log_level": "loud"}, "--log-level: 'loud' is not one of debug, info, warning, error"),
    ({"tls_cert": "c.pem"}, "--tls-cert/--tls-key: give both the certificate and its key"),
    ({"tls_key": "k.pem"}, "--tls-cert/--tls-key: give both the certificate and its key"),
])
def test_validate_errors_name_the_option(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate(BASE.replace(**changes))
    assert str(excinfo.value).startswith(message), str(excinfo.value)


@pytest.mark.parametrize("changes", [
    {"stall_timeout": StallTimeout(0.0)}, {"worker_port": 0}, {"max_restarts": 0}, {"job": "mnist-v2_run.1"},
    {"tls_cert": "c.pem", "tls_key": "k.pem"}, {"tls_ca": "ca.pem"}, {"log_level": "debug"},
])
def test_validate_accepts_boundary_values(changes: dict[str, Any]) -> None:
    config = BASE.replace(**changes)
    assert validate(config) is config


def test_validate_in_a_file_names_the_file() -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate(BASE.replace(stall_timeout=StallTimeout(-1.0)), where="/etc/job.toml")
    assert str(excinfo.value) == "/etc/job.toml: job.stall_timeout: -1.0 seconds must be 0 or more"


# ------------------------------------------------------------------------------------------------ TOML

FULL = """\
[job]
name = "mnist"
command = ["python", "train.py", "--epochs", "3"]
min_nodes = 2
max_nodes = 4
max_restarts = 5
restart_window = 600
stall_timeout = 120.5
backup_dir = "/shared/backup"
workdir = "/srv/train"
env = { NCCL_DEBUG = "WARN", A = "1" }

[node]
id = "node-7"
worker_port = 2222
advertise_address = "10.0.0.7"
stop_grace = 15
log_level = "debug"

[rendezvous]
endpoint = "head-node:29401"
token_file = "/etc/tfelastic/token"
last_call = 2
settle = 4.5
join_timeout = 900
heartbeat_interval = 1
node_timeout = 5
tls_cert = "/etc/tls/cert.pem"
tls_key = "/etc/tls/key.pem"
tls_ca = "/etc/tls/ca.pem"
"""

MINIMAL = """\
[job]
command = ["python", "train.py"]

[rendezvous]
endpoint = "127.0.0.1:29400"
"""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def toml_error(tmp_path: Path, text: str) -> tuple[str, str]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_toml(path)
    return path, str(excinfo.value)


def test_load_toml_maps_every_key_to_its_field(tmp_path: Path) -> None:
    config = load_toml(write(tmp_path, FULL))
    assert config == from_values(dict(
        command=("python", "train.py", "--epochs", "3"),
        rendezvous=Endpoint("head-node", 29401),
        job="mnist",
        min_nodes=2,
        max_nodes=4,
        node_id="node-7",
        worker_port=2222,
        advertise_address="10.0.0.7",
        backup_dir="/shared/backup",
        workdir="/srv/train",
        env=(("A", "1"), ("NCCL_DEBUG", "WARN")),
        max_restarts=5,
        restart_window=600.0,
        stall_timeout=StallTimeout(120.5),
        stop_grace=15.0,
        token_file="/etc/tfelastic/token",
        tls_cert="/etc/tls/cert.pem", tls_key="/etc/tls/key.pem", tls_ca="/etc/tls/ca.pem",
        last_call=2.0,
        settle=4.5,
        join_timeout=900.0,
        heartbeat_interval=1.0,
        node_timeout=5.0,
        log_level="debug",
    ))
    # integers in the file become floats for durations, and stay integers for counts
    for name in ("restart_window", "stop_grace", "last_call", "join_timeout", "heartbeat_interval", "node_timeout"):
        assert type(value_of(config, name)) is float, name
    for name in ("min_nodes", "max_nodes", "max_restarts", "worker_port"):
        assert type(value_of(config, name)) is int, name


def value_of(config: AgentConfig, name: str) -> object:
    section, key = OPTIONS[name].field
    return getattr(getattr(config, section), key)


def test_load_toml_minimal_file_takes_the_defaults(tmp_path: Path) -> None:
    config = load_toml(write(tmp_path, MINIMAL))
    assert config == BASE.replace(node_id=config.node.id)
    assert config.job.name == "default"
    assert config.node.id  # the hostname


def test_load_toml_splits_a_command_string_like_a_shell(tmp_path: Path) -> None:
    config = load_toml(write(tmp_path, """\
        [job]
        command = "python 'my train.py' --lr=0.1"
        [rendezvous]
        endpoint = "127.0.0.1:29400"
        """))
    assert config.job.command == ("python", "my train.py", "--lr=0.1")


def test_load_toml_broken_toml(tmp_path: Path) -> None:
    path, message = toml_error(tmp_path, "[job\ncommand = \n")
    assert message.startswith(f"--config: {path!r} is not valid TOML (UTF-8): ")


def test_load_toml_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "missing.toml")
    with pytest.raises(ConfigError) as excinfo:
        load_toml(path)
    assert str(excinfo.value) == f"--config: cannot read {path!r}: No such file or directory"


def test_load_toml_file_that_is_not_utf8(tmp_path: Path) -> None:
    # A job file saved in Latin-1 is a ConfigError naming the file, not a UnicodeDecodeError.
    path = tmp_path / "job.toml"
    path.write_bytes(MINIMAL.encode() + b'[node]\nid = "n\xe9"\n')
    with pytest.raises(ConfigError) as excinfo:
        load_toml(str(path))
    assert str(path) in str(excinfo.value)


SECTIONS = "[job], [node], [metrics], [rendezvous]"


@pytest.mark.parametrize(("text", "expected"), [
    (MINIMAL + "[jobs]\nname = 'x'\n", f"unknown section [jobs]; expected one of {SECTIONS}"),
    ("top = 1\n" + MINIMAL, f"unknown section [top]; expected one of {SECTIONS}"),
])
def test_load_toml_unknown_section(tmp_path: Path, text: str, expected: str) -> None:
    path, message = toml_error(tmp_path, text)
    assert message == f"{path}: {expected}"


@pytest.mark.parametrize(("text", "unknown", "known"), [
    (MINIMAL.replace("[job]\n", "[job]\nnmae = 'x'\n"), "job.nmae",
     {"backup_dir", "command", "env", "max_nodes", "max_restarts", "min_nodes", "name", "restart_window",
      "stall_timeout", "workdir"}),
    (MINIMAL + "[node]\nnode_id = 'x'\n", "node.node_id",
     {"advertise_address", "id", "log_level", "stop_grace", "worker_port"}),
    (MINIMAL.replace("[rendezvous]\n", "[rendezvous]\ntoken = 'x'\n"), "rendezvous.token",
     {"endpoint", "heartbeat_interval", "join_timeout", "last_call", "node_timeout", "settle", "tls_ca", "tls_cert",
      "tls_key", "token_file"}),
], ids=["job", "node", "rendezvous"])
def test_load_toml_unknown_key(tmp_path: Path, text: str, unknown: str, known: set[str]) -> None:
    path, message = toml_error(tmp_path, text)
    prefix = f"{path}: unknown key {unknown}; expected one of "
    assert message.startswith(prefix), message
    listed = message.removeprefix(prefix).split(", ")
    assert listed == sorted(listed)
    assert known <= set(listed)  # keys may be added, never lost
    assert unknown.split(".")[1] not in listed


@pytest.mark.parametrize(("section", "line", "expected"), [
    ("job", "min_nodes = '2'", "job.min_nodes: '2' must be a int"),
    ("job", "min_nodes = 2.0", "job.min_nodes: 2.0 must be a int"),
    ("job", "max_restarts = true", "job.max_restarts: True must be a int"),
    ("job", "stall_timeout = true", "job.stall_timeout: True must be a int or float"),
    ("job", "restart_window = '1h'", "job.restart_window: '1h' must be a int or float"),
    ("job", "name = 7", "job.name: 7 must be a str"),
    ("job", "env = { A = 1 }", 'job.env: must be a table of strings, e.g. { NCCL_DEBUG = "WARN" }'),
    ("job", "env = ['A=1']", 'job.env: must be a table of strings, e.g. { NCCL_DEBUG = "WARN" }'),
    ("node", "id = 7", "node.id: 7 must be a str"),
    ("node", "worker_port = '2222'", "node.worker_port: '2222' must be a int"),
    ("rendezvous", "tls_ca = 1", "rendezvous.tls_ca: 1 must be a str"),
    ("rendezvous", "heartbeat_interval = 'fast'", "rendezvous.heartbeat_interval: 'fast' must be a int or float"),
])
def test_load_toml_wrong_types(tmp_path: Path, section: str, line: str, expected: str) -> None:
    text = MINIMAL if section != "node" else MINIMAL + "[node]\n"
    text = text.replace(f"[{section}]\n", f"[{section}]\n{line}\n")
    path, message = toml_error(tmp_path, text)
    assert message == f"{path}: {expected}"


@pytest.mark.parametrize(("command", "expected"), [
    ("command = [1, 2]", "job.command: must be a list of strings"),
    ("command = 7", "job.command: must be a list of strings"),
    ("command = { a = 'b' }", "job.command: must be a list of strings"),
])
def test_load_toml_bad_command(tmp_path: Path, command: str, expected: str) -> None:
    path, message = toml_error(tmp_path, MINIMAL.replace('command = ["python", "train.py"]', command))
    assert message.startswith(f"{path}: {expected}")


def test_load_toml_command_string_with_unbalanced_quote(tmp_path: Path) -> None:
    # A command string is split like a shell would; an unbalanced quote is a ConfigError naming the file and the
    # key, not shlex's ValueError("No closing quotation").
    text = MINIMAL.replace('command = ["python", "train.py"]', "command = \"python 'train.py\"")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_toml(path)
    assert f"{path}: job.command" in str(excinfo.value)


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("endpoint = 29400", "rendezvous.endpoint: 29400 must be a str"),
    ("endpoint = 'nonsense'", "rendezvous.endpoint: 'nonsense' is not HOST:PORT"),
    ("endpoint = 'head:0'", "rendezvous.endpoint: port 0 in 'head:0' is out of range 1-65535"),
])
def test_load_toml_bad_endpoint(tmp_path: Path, endpoint: str, expected: str) -> None:
    path, message = toml_error(tmp_path, MINIMAL.replace('endpoint = "127.0.0.1:29400"', endpoint))
    assert message.startswith(f"{path}: {expected}")


def test_load_toml_requires_the_command(tmp_path: Path) -> None:
    path, message = toml_error(tmp_path, MINIMAL.replace('command = ["python", "train.py"]\n', "name = 'x'\n"))
    assert message == f"{path}: job.command is required"


def test_load_toml_requires_the_endpoint(tmp_path: Path) -> None:
    path, message = toml_error(tmp_path, MINIMAL.replace('endpoint = "127.0.0.1:29400"\n', ""))
    assert message == f"{path}: rendezvous.endpoint is required"


def test_load_toml_validates_values_naming_the_file(tmp_path: Path) -> None:
    path, message = toml_error(tmp_path, MINIMAL.replace("[job]\n", "[job]\nstall_timeout = -1\n"))
    assert message == f"{path}: job.stall_timeout: -1.0 seconds must be 0 or more"
    path, message = toml_error(tmp_path, MINIMAL.replace("[job]\n", "[job]\nmin_nodes = 3\nmax_nodes = 2\n"))
    assert message.startswith(f"{path}: ")
    assert "max_nodes 2 is below min_nodes 3" in message


@pytest.mark.parametrize(("text", "key"), [
    (MINIMAL.replace("[job]\n", "[job]\nname = 'my job'\n"), "job.name"),
    (MINIMAL + "[node]\nid = 'node 7'\n", "node.id"),
], ids=["job.name", "node.id"])
def test_load_toml_validation_names_the_key_in_the_file(tmp_path: Path, text: str, key: str) -> None:
    # A value refused by validate() is reported under the key as the file spells it (job.name, node.id), not
    # under the field name (job, node_id).
    path, message = toml_error(tmp_path, text)
    assert message.startswith(f"{path}: {key}: "), message


# ------------------------------------------------------------------------------------------------ tokens


def token_file(tmp_path: Path, content: bytes, mode: int) -> str:
    path = tmp_path / "token"
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o601])
def test_read_token_refuses_a_file_others_can_read(tmp_path: Path, mode: int) -> None:
    path = token_file(tmp_path, b"s3cret\n", mode)
    with pytest.raises(ConfigError) as excinfo:
        read_token(path)
    assert str(excinfo.value) == (f"--token-file: {path!r} is readable by other users (mode {mode:o}); "
                                  f"run: chmod 600 {path}")


@pytest.mark.parametrize("content", [b"", b"\n", b"  \n\t\n"])
def test_read_token_refuses_an_empty_file(tmp_path: Path, content: bytes) -> None:
    path = token_file(tmp_path, content, 0o600)
    with pytest.raises(ConfigError) as excinfo:
        read_token(path)
    assert str(excinfo.value).startswith(f"--token-file: {path!r} is empty; put a random secret in it")


def test_read_token_reads_and_strips(tmp_path: Path) -> None:
    path = token_file(tmp_path, b"  0123abcd\n\n", 0o600)
    assert read_token(path) == "0123abcd"
    os.chmod(path, 0o400)
    assert read_token(path) == "0123abcd"


def test_read_token_missing_file_names_the_option(tmp_path: Path) -> None:
    path = str(tmp_path / "nope")
    with pytest.raises(ConfigError) as excinfo:
        read_token(path, option="rendezvous.token_file")
    assert str(excinfo.value) == f"rendezvous.token_file: cannot read {path!r}: No such file or directory"


def test_read_token_binary_file_is_a_config_error(tmp_path: Path) -> None:
    # A binary secret (e.g. made with `openssl rand 32 > token`, without -hex) is a ConfigError naming the
    # option, not a UnicodeDecodeError.
    path = token_file(tmp_path, b"\xff\xfe\x00\x9c", 0o600)
    with pytest.raises(ConfigError, match=r"^--token-file: "):
        read_token(path)


# ------------------------------------------------------------------------------------------------ AgentConfig


def test_resolved_backup_dir_defaults_to_the_workdir(tmp_path: Path) -> None:
    config = BASE.replace(job="mnist", workdir=str(tmp_path))
    assert config.resolved_backup_dir() == str(tmp_path.resolve() / "tfelastic-backup" / "mnist")


def test_resolved_backup_dir_without_workdir_is_under_the_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert BASE.replace(job="j").resolved_backup_dir() == str(
        tmp_path.resolve() / "tfelastic-backup" / "j")


def test_resolved_backup_dir_relative_and_absolute(tmp_path: Path) -> None:
    relative = BASE.replace(workdir=str(tmp_path), backup_dir="ckpt/run1")
    assert relative.resolved_backup_dir() == str(tmp_path.resolve() / "ckpt" / "run1")
    absolute = BASE.replace(workdir=str(tmp_path), backup_dir="/shared/backup/mnist")
    assert absolute.resolved_backup_dir() == "/shared/backup/mnist"


def test_command_digest() -> None:
    digest = BASE.command_digest()
    assert len(digest) == 32
    assert BASE.replace(job="other").command_digest() == digest  # only the command counts
    assert BASE.replace(command=("python", "train.py")).command_digest() == digest
    others = [("python", "eval.py"), ("python", "train.py", "--lr", "1"), ("python train.py",),
              ("python", "train.py", "")]
    digests = {BASE.replace(command=c).command_digest() for c in others}
    assert len(digests) == len(others)
    assert digest not in digests


def test_load_toml_max_nodes_defaults_to_min_nodes(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[job]\ncommand = ["true"]\nmin_nodes = 3\n[rendezvous]\nendpoint = "127.0.0.1:29400"\n')
    config = load_toml(str(job))
    assert (config.job.min_nodes, config.job.max_nodes) == (3, 3)


def test_quarantine_and_node_check_options_reach_the_coordinators_settings(tmp_path: Path) -> None:
    from tfelastic.daemon.cli import build_parser, config_from_run_args

    args = build_parser().parse_args(["run", "--rendezvous", "127.0.0.1:29400", "--quarantine-after", "3",
                                      "--quarantine-window", "60", "--quarantine-cooldown", "30",
                                      "--quarantine-cooldown-max", "120", "--no-node-probe", "--check-min-free-mb",
                                      "10", "--", "python", "train.py"])
    config = config_from_run_args(args, None)
    settings = config.rendezvous.settings()
    assert (settings.quarantine_after, settings.quarantine_window_seconds, settings.quarantine_cooldown_seconds,
            settings.quarantine_cooldown_max_seconds, settings.probe_nodes) == (3, 60.0, 30.0, 120.0, False)
    assert config.node.check_min_free_mb == 10
    defaults = load_toml(write(tmp_path, 'rendezvous.endpoint = "127.0.0.1:29400"\njob.command = ["python"]\n'))
    assert defaults.rendezvous.settings().probe_nodes and defaults.rendezvous.settings().quarantine_after == 2
    file = load_toml(write(tmp_path, 'rendezvous.endpoint = "127.0.0.1:29400"\njob.command = ["python"]\n'
                                     "rendezvous.node_probe = false\n", "probe.toml"))
    assert not file.rendezvous.settings().probe_nodes


def test_a_quarantine_count_out_of_range_names_the_option() -> None:
    config = from_values({"command": ("python",), "rendezvous": Endpoint("127.0.0.1", 29400),
                          "quarantine_after": -1})
    with pytest.raises(ConfigError, match="--quarantine-after: -1 is out of range 0-1000"):
        validate(config)


def test_stall_timeout_auto_is_the_default_and_learns_in_flags_and_files(tmp_path: Path) -> None:
    from tfelastic.daemon.cli import build_parser, config_from_run_args
    from tfelastic.daemon.rendezvous.api import STALL_LEARNED

    def run(*flags: str) -> AgentConfig:
        args = build_parser().parse_args(["run", "--rendezvous", "127.0.0.1:29400", *flags, "--", "python"])
        return config_from_run_args(args, None)

    default = run()
    assert default.job.stall_timeout == STALL_AUTO and default.stall_limits().fixed is None
    assert default.job_spec().stall_timeout_seconds == STALL_LEARNED  # the wire's "learned"
    assert run("--stall-timeout", "auto").job.stall_timeout == STALL_AUTO
    fixed = run("--stall-timeout", "90", "--stall-floor", "5", "--stall-allowance", "60")
    assert fixed.stall_limits() == StallLimits(fixed=90.0, floor=5.0, allowance=60.0)
    assert fixed.job_spec().stall_timeout_seconds == 90.0
    text = 'rendezvous.endpoint = "127.0.0.1:29400"\njob.command = ["python"]\njob.stall_timeout = "auto"\n'
    assert load_toml(write(tmp_path, text)).job.stall_timeout == STALL_AUTO


@pytest.mark.parametrize(("text", "message"), [
    ('job.stall_timeout = "soon"', "job.stall_timeout: 'soon' must be a int or float"),
    ("job.stall_timeout = -1", "job.stall_timeout: -1.0 seconds must be 0 or more"),  # not the wire's sentinel
    ("job.stall_floor = -5", "job.stall_floor: -5.0 seconds must be 0 or more"),
    ("job.stall_allowance = -5", "job.stall_allowance: -5.0 seconds must be 0 or more"),
])
def test_bad_stall_settings_in_a_file_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    _, error = toml_error(tmp_path, f'rendezvous.endpoint = "127.0.0.1:29400"\njob.command = ["python"]\n{text}\n')
    assert error.endswith(message), error


def test_a_bad_stall_timeout_flag_exits_78_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    from tfelastic.daemon.cli import build_parser

    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(["run", "--stall-timeout", "soon", "--", "python"])
    assert excinfo.value.code == 78
    assert "'soon' is neither 'auto' nor a number of seconds" in capsys.readouterr().err


def test_stall_timeout_off_disables_hang_detection_in_flags_and_files(tmp_path: Path) -> None:
    from tfelastic.daemon.cli import build_parser, config_from_run_args

    args = build_parser().parse_args(["run", "--rendezvous", "127.0.0.1:29400", "--stall-timeout", "off", "--",
                                      "python"])
    flags = config_from_run_args(args, None)
    text = 'rendezvous.endpoint = "127.0.0.1:29400"\njob.command = ["python"]\njob.stall_timeout = "off"\n'
    for config in (flags, load_toml(write(tmp_path, text))):
        assert config.stall_limits() == StallLimits(fixed=0.0)  # a fixed limit of 0: never stalled
        assert config.job_spec().stall_timeout_seconds == 0.0
        assert str(config.job.stall_timeout) == "off"


@pytest.mark.parametrize(("changes", "message"), [
    ({"metrics_port": 29400}, "--metrics-port: port 29400 is also --rendezvous's; give each listener of this "
                              "process its own port"),
    ({"worker_port": 29400}, "--worker-port: port 29400 is also --rendezvous's"),
    ({"worker_port": 9464}, "--worker-port: port 9464 is also --metrics-port's"),
])
def test_one_port_given_to_two_listeners_names_both(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate(BASE.replace(**changes))
    assert str(excinfo.value).startswith(message), str(excinfo.value)


def test_the_same_port_in_a_file_names_both_keys(tmp_path: Path) -> None:
    _, error = toml_error(tmp_path, 'rendezvous.endpoint = "127.0.0.1:29400"\njob.command = ["python"]\n'
                                    "metrics.port = 29400\n")
    assert error.endswith("job.toml: metrics.port: port 29400 is also rendezvous.endpoint's; give each listener of "
                          "this process its own port"), error


def test_a_coordinator_listening_on_its_metrics_port_is_refused() -> None:
    from tfelastic.daemon.cli import build_parser, config_from_coordinator_args

    args = build_parser().parse_args(["coordinator", "--listen", "127.0.0.1:29400", "--metrics-port", "29400"])
    with pytest.raises(ConfigError, match=r"^--metrics-port: port 29400 is also --listen's"):
        config_from_coordinator_args(args)


# ------------------------------------------------------------------------------------------------ the reference
DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_is_in_the_configuration_reference(name: str) -> None:
    """docs/configuration.md is the one reference of the options: a new flag without a row there is a doc gap."""
    option, text = OPTIONS[name], DOCS.read_text()
    if option.flag:
        assert f"`{option.flag}`" in text or f"`{option.flag} " in text or f"{option.flag}`" in text, option.flag
    _, key = option.field
    assert f"`{option.key}`" in text or f"`{option.key} " in text or f".{key}`" in text, option.key


def test_the_example_job_file_is_valid_and_the_same_file_serves_every_node() -> None:
    """systemd/example.toml is copied unchanged to every node: each node takes its host name as its id."""
    from tfelastic.daemon.cli import config_from_file

    config = config_from_file(str(DOCS.parents[1] / "systemd" / "example.toml"), environ={})
    assert config.node.id == socket.gethostname()
    assert config.job.stall_timeout == STALL_AUTO  # the default: learned, not a number copied from an example
