"""The real `tfelastic` CLI refuses bad configuration before it starts anything: exit code 78 (EX_CONFIG) and one
clear line on stderr that names the option, never a Python traceback.

A refusal is the CLI's own ``main()`` run in this process (:func:`tfelastic`): what it returns or exits with, and
what it prints. The cases where the process is the point (a retry until a timeout, a coordinator that answers, a
reader gone from a pipe, a foreign program on the port, and one refusal of each kind as a real process: exit
status 78 and 2 from ``python -m tfelastic.daemon``) run the real process (:func:`tfelastic_process`)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tfelastic.daemon import cli, commands
from tfelastic.daemon.netutil import port_taken

from tests.cluster import wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.quick]

EX_CONFIG = 78
USAGE = 2
LOOPBACK = "127.0.0.1:29400"


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def tfelastic_process(*args: str, cwd: Path) -> Result:
    proc = subprocess.run([sys.executable, "-m", "tfelastic.daemon", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, check=False)
    return Result(proc.returncode, proc.stdout, proc.stderr)


class WouldStart(Exception):
    """The command got past its checks: a real process would now set up its logging and start."""


def tfelastic(*args: str, cwd: Path) -> Result:
    """``tfelastic ARGS`` as ``main()`` in this process, from ``cwd``: its exit code (returned, or argparse's
    SystemExit), stdout and stderr. An exception out of main() is what the real process would print as a
    traceback: it fails the test. A command that passes its checks raises :class:`WouldStart` instead of starting."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(commands, "setup_logging", would_start)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    return Result(code, stdout.getvalue(), stderr.getvalue())


def would_start(*_: object) -> None:
    raise WouldStart("the configuration was accepted: the daemon would start")


def assert_config_error(result: Result, *expected: str) -> None:
    assert result.returncode == EX_CONFIG, result
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "", result.stdout
    for text in expected:
        assert text in result.stderr, result.stderr


def config_error_line(result: Result) -> str:
    """The single stderr line of a ConfigError."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tfelastic: configuration error: "), result.stderr
    return lines[0].removeprefix("tfelastic: configuration error: ")


def test_a_refusal_and_a_usage_error_as_real_processes(tmp_path: Path) -> None:
    """The exit statuses a shell sees: 78 with the one-line message, 2 with the usage, no traceback."""
    refused = tfelastic_process("run", "--nodes", "0", "--rendezvous", LOOPBACK, "--", "true", cwd=tmp_path)
    assert_config_error(refused)
    assert config_error_line(refused) == "--nodes: '0': the minimum must be at least 1"
    usage = tfelastic_process("run", "--bogus", "--rendezvous", LOOPBACK, "--", "true", cwd=tmp_path)
    assert usage.returncode == USAGE and "Traceback" not in usage.stderr and usage.stdout == "", usage
    assert all(text in usage.stderr for text in UNRECOGNIZED_BOGUS), usage.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--nodes", "3:2", "--rendezvous", LOOPBACK, "--", "true"],
     "--nodes: '3:2': MAX 2 is below MIN 3; write MIN:MAX, e.g. 2:4"),
    (["run", "--nodes", "0", "--rendezvous", LOOPBACK, "--", "true"],
     "--nodes: '0': the minimum must be at least 1"),
    (["run", "--rendezvous", "nonsense", "--", "true"],
     "--rendezvous: 'nonsense' is not HOST:PORT; write it like 'head-node:29400'"),
    (["agent", "--config", "missing.toml"],
     "--config: cannot read 'missing.toml': No such file or directory"),
    (["run", "--rendezvous", LOOPBACK, "--metrics-port", "29400", "--", "true"],
     "--metrics-port: port 29400 is also --rendezvous's; give each listener of this process its own port"),
], ids=["nodes-max-below-min", "nodes-zero", "rendezvous-not-host-port", "config-file-missing", "port-given-twice"])
def test_bad_option_gives_the_exact_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = tfelastic(*args, cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result) == message


@pytest.mark.parametrize(("args", "prefix"), [
    (["run", "--rendezvous", LOOPBACK],
     "the trainer command (after --): no trainer command given; add it after '--'"),
    (["run", "--rendezvous", LOOPBACK, "--", "/nonexistent/program"],
     "trainer command: '/nonexistent/program' was not found or is not executable"),
    (["run", "--rendezvous", LOOPBACK, "--", "tfelastic-no-such-trainer"],
     "trainer command: 'tfelastic-no-such-trainer' was not found or is not executable"),
    (["run", "--rendezvous", "10.1.2.3:29400", "--", "true"],
     "--token-file: 10.1.2.3:29400 is not a loopback address, so a shared token is required"),
    (["coordinator", "--listen", "0.0.0.0:0"],
     "--token-file: 0.0.0.0:0 is not a loopback address, so a shared token is required"),
    # a superscript digit passes str.isdigit() but not int(): still a configuration error
    (["run", "--rendezvous", "127.0.0.1:\u00b2", "--", "true"], "--rendezvous: "),
    # not a flag any more: it may come from --config or $TFELASTIC_RENDEZVOUS, so its absence is a setting's
    (["run", "--", "true"], "--rendezvous: required outside a SLURM job step"),
], ids=["missing-trainer-command", "trainer-not-found", "trainer-not-on-path", "non-loopback-run-without-token",
        "coordinator-on-all-interfaces-without-token", "rendezvous-port-superscript-digit", "no-rendezvous"])
def test_bad_option_message_names_it(tmp_path: Path, args: list[str], prefix: str) -> None:
    result = tfelastic(*args, cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(prefix)


ETCD = "etcd://127.0.0.1:2379"


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--rendezvous", "etcd://", "--", "true"],
     "--rendezvous: 'etcd://' must list etcd members as HOST:PORT separated by commas, with no path, e.g. "
     "etcd://head-1:2379,head-2:2379,head-3:2379"),
    (["run", "--rendezvous", "etcd://head-1:2379/tfelastic", "--", "true"],
     "--rendezvous: 'etcd://head-1:2379/tfelastic' must list etcd members as HOST:PORT separated by commas, with no "
     "path, e.g. etcd://head-1:2379,head-2:2379,head-3:2379"),
    (["status", "--rendezvous", "etcd://head-1:2379,head-1:2379"],
     "--rendezvous: 'etcd://head-1:2379,head-1:2379' names a member twice"),
    (["run", "--rendezvous", LOOPBACK, "--etcd-ca", "ca.pem", "--", "true"],
     "--etcd-ca: only with an etcd rendezvous (--rendezvous etcd://HOST:PORT,...)"),
    (["run", "--rendezvous", ETCD, "--etcd-ca", "ca.pem", "--", "true"],
     f"--etcd-ca/--etcd-cert/--etcd-key: TLS to etcd needs an etcds:// URL, not {ETCD}"),
    (["run", "--rendezvous", ETCD, "--lease-ttl", "0", "--", "true"],
     "--lease-ttl: 0 seconds is out of range 1-60 (etcd raises a short lease to its own minimum, about 2 s with "
     "its default election timeout)"),
], ids=["etcd-no-members", "etcd-with-path", "etcd-member-twice", "etcd-option-without-etcd", "etcd-tls-without-etcds",
        "lease-ttl-zero"])
def test_a_bad_etcd_rendezvous_gives_the_exact_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = tfelastic(*args, cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result) == message


def test_an_etcd_password_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    secret = write_token(tmp_path, b"tfe:s3cret\n", 0o644)
    result = tfelastic("run", "--rendezvous", ETCD, "--etcd-password-file", str(secret), "--", "true", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(f"--etcd-password-file: {str(secret)!r} is readable by other users")


def test_an_etcd_agent_on_a_routable_address_needs_a_token(tmp_path: Path) -> None:
    result = tfelastic("run", "--rendezvous", ETCD, "--advertise-address", "10.1.2.3", "--", "true", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith("--token-file: 10.1.2.3 is not a loopback address")


def test_an_unreachable_etcd_is_retried_for_join_timeout_then_exits_1(tmp_path: Path) -> None:
    url = f"etcd://127.0.0.1:{free_port()}"
    result = tfelastic_process("run", "--rendezvous", url, "--join-timeout", "2", "--metrics-port", "off", "--", "true",
                       cwd=tmp_path)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    assert f"etcd at {url} stayed unreachable for join_timeout=2s" in result.stderr, result.stderr
    assert "does not answer yet" in result.stderr  # it was retried, not refused at once


def write_token(tmp_path: Path, content: bytes, mode: int) -> Path:
    token = tmp_path / "token"
    token.write_bytes(content)
    os.chmod(token, mode)
    return token


def test_token_file_readable_by_others(tmp_path: Path) -> None:
    token = write_token(tmp_path, b"s3cret\n", 0o644)
    result = tfelastic("run", "--rendezvous", LOOPBACK, "--token-file", str(token), "--", "true", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result) == (f"--token-file: {str(token)!r} is readable by other users (mode 644); "
                                         f"run: chmod 600 {token}")


def test_binary_token_file(tmp_path: Path) -> None:
    # A binary secret, as `openssl rand 32` without -hex writes it: refused as configuration, not a traceback.
    token = write_token(tmp_path, b"\xff\xfe\x00\x9c", 0o600)
    result = tfelastic("run", "--rendezvous", LOOPBACK, "--token-file", str(token), "--", "true", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith("--token-file: ")


@pytest.mark.parametrize(("content", "prefix"), [
    (b'[job\ncommand = ["true"\n', "--config: {path!r} is not valid TOML (UTF-8): "),
    (b'[job]\ncommand = ["true"]\nnodes = 2\n[rendezvous]\nendpoint = "127.0.0.1:29400"\n',
     "{path}: unknown key job.nodes; expected one of "),
    # a command string is split like a shell would, and this one never closes its quote
    (b'[job]\ncommand = "python \'train.py"\n[rendezvous]\nendpoint = "127.0.0.1:29400"\n',
     "{path}: job.command"),
    # saved in Latin-1, not UTF-8
    (b'[job]\ncommand = ["true"]\nname = "caf\xe9"\n[rendezvous]\nendpoint = "127.0.0.1:29400"\n',
     "--config: {path!r} is not valid TOML (UTF-8): "),
], ids=["broken-toml", "unknown-key", "command-with-unbalanced-quote", "not-utf8"])
def test_agent_config_file_error_names_the_file(tmp_path: Path, content: bytes, prefix: str) -> None:
    config = tmp_path / "job.toml"
    config.write_bytes(content)
    result = tfelastic("agent", "--config", str(config), cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(prefix.format(path=str(config)))


UNRECOGNIZED_BOGUS = ["tfelastic: error: unrecognized arguments: --bogus", "usage: tfelastic"]


@pytest.mark.parametrize(("args", "expected"), [
    (["run", "--bogus", "--rendezvous", LOOPBACK, "--", "true"], UNRECOGNIZED_BOGUS),
    (["run", "--rendezvous", LOOPBACK, "--bogus", "--", "true"], UNRECOGNIZED_BOGUS),
    (["status", "--rendezvous", LOOPBACK, "--bogus"], UNRECOGNIZED_BOGUS),
    (["coordinator", "--listen", LOOPBACK, "--bogus"], UNRECOGNIZED_BOGUS),
    (["launch"], ["tfelastic: error: argument command_name: invalid choice: 'launch'"]),
    (["drain", "--rendezvous", LOOPBACK], ["tfelastic: error: the following arguments are required: NODE"]),
], ids=["unknown-flag-run-first", "unknown-flag-run-later", "unknown-flag-status", "unknown-flag-coordinator",
        "unknown-subcommand", "missing-argument"])
def test_command_line_usage_error(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    """A malformed command line exits 2, as every command-line tool does (78 is for a bad setting)."""
    result = tfelastic(*args, cwd=tmp_path)
    assert result.returncode == USAGE, result
    assert "Traceback" not in result.stderr and result.stdout == "", result
    for text in expected:
        assert text in result.stderr, result.stderr


def test_status_with_nothing_listening_exits_1(tmp_path: Path) -> None:
    port = free_port()
    result = tfelastic_process("status", "--rendezvous", f"127.0.0.1:{port}", cwd=tmp_path)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith(f"tfelastic status: nothing listens at 127.0.0.1:{port}: no tfelastic "
                                    "coordinator runs there"), result.stderr
    assert "UNAVAILABLE" in result.stderr, result.stderr  # gRPC's own words stay, for whoever digs further


def test_status_json_with_nothing_listening_prints_an_error_object(tmp_path: Path) -> None:
    """A script that reads `status --json` always gets a JSON object: here one whose "error" says what is wrong."""
    port = free_port()
    result = tfelastic_process("status", "--json", "--rendezvous", f"127.0.0.1:{port}", "--job", "j7", cwd=tmp_path)
    assert result.returncode == 1, result
    document = json.loads(result.stdout)
    assert document["error"].startswith(f"nothing listens at 127.0.0.1:{port}"), document
    assert document["job"] == "j7" and document["rendezvous"] == f"127.0.0.1:{port}", document
    assert "Traceback" not in result.stderr, result.stderr


def test_status_json_with_a_bad_setting_prints_an_error_object_and_exits_78(tmp_path: Path) -> None:
    result = tfelastic("status", "--json", "--job", "j7", cwd=tmp_path)  # no rendezvous from any source
    assert result.returncode == 78, result
    document = json.loads(result.stdout)
    assert document["error"].startswith("configuration error: ") and "rendezvous" in document["error"], document
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(("args", "start"), [
    (["run", "--rendezvous", "127.0.0.1:29400", "--advertise-address", "192.0.2.1", "--", "true"],
     "--advertise-address: '192.0.2.1' is not an address of this machine"),
    (["status", "--rendezvous", "127.0.0.1:29400", "--watch", "0"], "--watch: 0.0 seconds must be more than 0"),
    (["coordinator", "--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"],
     "--tls-cert: cannot read '/nonexistent.pem'"),
])
def test_environment_checks_exit_78(args: list[str], start: str, tmp_path: Path) -> None:
    result = tfelastic(*args, cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(start)


def test_token_with_whitespace_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("two words\n")
    token.chmod(0o600)
    result = tfelastic("run", "--rendezvous", "127.0.0.1:29400", "--token-file", str(token), "--", "true",
                       cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(f"--token-file: {str(token)!r} must hold one word of printable ASCII")


# ------------------------------------------------------------------------------ values the coordinator would refuse

@pytest.mark.parametrize(("args", "start"), [
    (["--nodes", "2:4294967296"], "--nodes: node range 2:4294967296 is out of range 1..100000"),
    (["--nodes", "1:100001"], "--nodes: node range 1:100001 is out of range 1..100000"),
    (["--max-restarts", "4294967296"], "--max-restarts: 4294967296 is more than 100000"),
    (["--max-restarts", "200000"], "--max-restarts: 200000 is more than 100000"),
    (["--stall-timeout", "inf"], "--stall-timeout: timing inf is out of range 0..1e+09 seconds"),
    (["--stall-timeout", "1e10"], "--stall-timeout: timing 10000000000.0 is out of range 0..1e+09 seconds"),
    (["--restart-window", "inf"], "--restart-window: timing inf is out of range 0..1e+09 seconds"),
    (["--join-timeout", "inf"], "--join-timeout: timing inf is out of range 0..1e+09 seconds"),
    (["--stop-grace", "1e12"], "--stop-grace: timing 1000000000000.0 is out of range 0..1e+09 seconds"),
    (["--node-id", "a/b"], "--node-id: 'a/b' must be 1-128 letters, digits"),
    (["--node-id", "n" * 200], "--node-id: 'nnnn"),
], ids=["nodes-beyond-uint32", "nodes-beyond-the-coordinators-limit", "max-restarts-beyond-uint32",
        "max-restarts-beyond-the-limit", "stall-timeout-inf", "stall-timeout-1e10", "restart-window-inf",
        "join-timeout-inf", "stop-grace-huge", "node-id-slash", "node-id-200-characters"])
def test_a_value_the_coordinator_would_refuse_fails_before_anything_starts(
        tmp_path: Path, args: list[str], start: str) -> None:
    """Each of these used to start (and host a coordinator), then fail on every session attempt."""
    result = tfelastic("run", "--rendezvous", f"127.0.0.1:{free_port()}", *args, "--", "true", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(start)


def test_a_toml_value_that_does_not_fit_names_the_key(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(f'[job]\ncommand = ["true"]\nmax_nodes = 99999999999\n'
                      f'[rendezvous]\nendpoint = "127.0.0.1:{free_port()}"\n')
    result = tfelastic("agent", "--config", str(config), cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(f"{config}: job.max_nodes: node range 1:99999999999 is out of range")


@pytest.mark.parametrize(("content", "message"), [
    (b"a" * 2_000 + b"\n", "holds 2000 characters, more than the 1024 a token may have"),
    (b"a" * 20_000 + b"\n", "holds 20001 bytes, more than the 1024 characters a token may have"),  # not read
])
def test_a_token_too_long_for_grpc_metadata_is_refused_at_start(tmp_path: Path, content: bytes, message: str) -> None:
    token = write_token(tmp_path, content, 0o600)
    result = tfelastic("run", "--rendezvous", f"127.0.0.1:{free_port()}", "--token-file", str(token), "--", "true",
                       cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(f"--token-file: {str(token)!r} {message}")


@pytest.mark.parametrize(("text", "message"), [
    ("job = 5\n", "{path}: job must be a table ([job] with keys under it), not 5"),
    ('[[job]]\ncommand = ["true"]\n', "{path}: job must be a table ([job] with keys under it), not an array"),
], ids=["a-value", "an-array-of-tables"])
def test_a_known_section_of_the_wrong_shape_is_named_as_such(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text(text + '[rendezvous]\nendpoint = "127.0.0.1:29400"\n')
    result = tfelastic("agent", "--config", str(config), cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(message.format(path=config))


def test_status_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`tfelastic status --json | head -0`: the reader is gone before the document is written."""
    port = free_port()
    coordinator = subprocess.Popen([sys.executable, "-m", "tfelastic.daemon", "coordinator", "--listen",
                                    f"127.0.0.1:{port}", "--metrics-port", "off"], cwd=tmp_path,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    command = [sys.executable, "-m", "tfelastic.daemon", "status", "--json", "--rendezvous", f"127.0.0.1:{port}"]
    try:
        wait_for(lambda: tfelastic_process(*command[3:], cwd=tmp_path).returncode == 0, 30, "the coordinator to answer")
        for _ in range(3):
            status = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert status.stdout is not None and status.stderr is not None
            status.stdout.close()  # nobody reads what it prints
            stderr = status.stderr.read().decode()
            assert status.wait(60) == 0, stderr
            assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    finally:
        coordinator.terminate()
        coordinator.wait(30)


HTTP_SERVER = "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), " \
              "http.server.SimpleHTTPRequestHandler).serve_forever()"
SILENT_SERVER = "import socket, sys, time; s = socket.create_server(('127.0.0.1', int(sys.argv[1]))); " \
                "conns = []\nwhile True: conns.append(s.accept())"


@pytest.mark.parametrize("program", [HTTP_SERVER, SILENT_SERVER], ids=["http-server", "silent-listener"])
def test_a_foreign_program_on_the_local_rendezvous_port_is_named_and_ends_the_agent(tmp_path: Path,
                                                                                    program: str) -> None:
    """Not a wait behind gRPC's 'SETTINGS frame' retries: which port, which program, what to do; then exit 78."""
    port = free_port()
    foreign = subprocess.Popen([sys.executable, "-c", program, str(port)], cwd=tmp_path)
    try:
        wait_for(lambda: port_taken("127.0.0.1", port), 10, "the foreign program to listen")
        result = tfelastic_process("run", "--nodes", "1", "--rendezvous", f"127.0.0.1:{port}", "--join-timeout", "8",
                           "--metrics-port", "off", "--", "true", cwd=tmp_path)
    finally:
        foreign.kill()
        foreign.wait()
    assert result.returncode == EX_CONFIG, result.stderr
    assert f"the rendezvous port {port} of this host is held by pid {foreign.pid}" in result.stderr, result.stderr
    assert "not a tfelastic coordinator listens at the rendezvous address" in result.stderr, result.stderr
    assert "giving up after 8s of failed connections to the rendezvous address" in result.stderr, result.stderr


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd (Debian's etcd-server) is not installed")
def test_an_agent_aimed_at_a_grpc_server_of_another_service_names_it_and_exits_78(tmp_path: Path) -> None:
    """etcd's client port speaks gRPC, but not our service: said (not a traceback per retry), then exit 78."""
    from tests.etcd import EtcdCluster

    (tmp_path / "etcd").mkdir()
    etcd = EtcdCluster(tmp_path / "etcd").start()
    try:
        address = etcd.url.removeprefix("etcd://").split(",")[0]
        result = tfelastic_process("run", "--nodes", "1", "--rendezvous", address, "--join-timeout", "6",
                                   "--metrics-port", "off", "--", "true", cwd=tmp_path)
    finally:
        etcd.stop()
    assert result.returncode == EX_CONFIG, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("a gRPC server that is not a tfelastic coordinator listens") <= 2, result.stderr
    assert "giving up after 6s of failed connections to the rendezvous address" in result.stderr, result.stderr


def fifo(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    os.mkfifo(path, 0o600)
    return path


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_token_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """A FIFO hung the read for good, /dev/zero read until MemoryError: neither is read now."""
    named = {"fifo": lambda: fifo(tmp_path, "token"), "device": lambda: Path("/dev/zero"),
             "directory": lambda: tmp_path}[kind]()
    said = {"fifo": "is a FIFO", "device": "is a character device", "directory": "is a directory"}[kind]
    result = tfelastic("run", "--rendezvous", LOOPBACK, "--token-file", str(named), "--", "true", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result) == f"--token-file: {str(named)!r} {said}; name the regular file that holds " \
                                        "the secret"


def test_a_job_file_that_is_a_fifo_or_too_big_is_refused_before_it_is_read(tmp_path: Path) -> None:
    pipe = fifo(tmp_path, "job.toml")
    result = tfelastic("agent", "--config", str(pipe), cwd=tmp_path)
    assert_config_error(result, f"--config: {str(pipe)!r} is a FIFO")
    big = tmp_path / "big.toml"
    with big.open("wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of nothing
    result = tfelastic("agent", "--config", str(big), cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(f"--config: {str(big)!r} holds {64 << 20} bytes, more than the "
                                                f"{4 << 20} that a job's settings (TOML) may take")


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users: needs root")
def test_a_token_file_of_another_user_or_one_others_need_to_read_is_refused_with_no_chmod_advice(
        tmp_path: Path) -> None:
    token = write_token(tmp_path, b"secret-token\n", 0o600)
    os.chown(token, 65534, 65534)  # nobody's
    result = tfelastic("run", "--rendezvous", LOOPBACK, "--token-file", str(token), "--", "true", cwd=tmp_path)
    assert_config_error(result, "belongs to uid 65534, not to this process's user (uid 0) or root")
    os.chown(token, 0, 42)  # like /etc/shadow: root's, for a group of readers
    os.chmod(token, 0o640)
    result = tfelastic("run", "--rendezvous", LOOPBACK, "--token-file", str(token), "--", "true", cwd=tmp_path)
    assert_config_error(result, "is readable by other users (mode 640, group 42): not a file for a secret")
    assert "chmod 600 " + str(token) not in result.stderr


@pytest.mark.parametrize("command", ["report", "status", "drain"])
def test_an_operator_command_with_no_coordinator_says_so_once_with_its_own_name(tmp_path: Path,
                                                                                command: str) -> None:
    port = free_port()
    result = tfelastic_process(command, *(["a"] if command == "drain" else []), "--rendezvous", f"127.0.0.1:{port}",
                               cwd=tmp_path)
    assert result.returncode == 1, result
    assert result.stderr.startswith(f"tfelastic {command}: nothing listens at 127.0.0.1:{port}"), result.stderr
    assert f"tfelastic {command}: tfelastic" not in result.stderr, result.stderr  # report said its name twice


def test_a_coordinator_listening_elsewhere_than_its_job_files_endpoint_names_the_file(tmp_path: Path) -> None:
    """It blamed a --rendezvous that was never given."""
    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "x"\ncommand = ["true"]\n[rendezvous]\nendpoint = "127.0.0.1:29411"\n')
    result = tfelastic("coordinator", "--config", str(job), "--listen", "127.0.0.1:29412", cwd=tmp_path)
    assert_config_error(result)
    assert config_error_line(result).startswith(f"{job}: rendezvous.endpoint is 127.0.0.1:29411, but --listen is "
                                                "127.0.0.1:29412: a standalone coordinator serves where the agents "
                                                "look for it")


def test_report_refuses_a_page_and_json_both_on_stdout_and_says_so_in_json(tmp_path: Path) -> None:
    result = tfelastic("report", "--rendezvous", LOOPBACK, "--json", "--html", "-", cwd=tmp_path)
    message = "--html - and --json both print to standard output: give --html a FILE"
    assert result.returncode == EX_CONFIG and result.stderr == f"tfelastic: configuration error: {message}\n"
    assert json.loads(result.stdout) == {"error": f"configuration error: {message}"}


# A gRPC server that answers every call with an empty message, whatever its method (a proxy, a stub).
ANSWERS_ANYTHING = """
import sys, time
from concurrent import futures
import grpc
class Anything(grpc.GenericRpcHandler):
    def service(self, details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers([Anything()])
server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
server.start()
time.sleep(600)
"""


def test_drain_and_restart_answered_with_an_empty_reply_say_nothing_was_done(tmp_path: Path) -> None:
    """They printed an empty line and exited 0."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", ANSWERS_ANYTHING, str(port)], cwd=tmp_path)
    try:
        wait_for(lambda: port_taken("127.0.0.1", port), 20, "the server to listen")
        for command in (["drain", "a"], ["restart"], ["readmit", "a"]):
            result = tfelastic_process(*command, "--rendezvous", f"127.0.0.1:{port}", cwd=tmp_path)
            assert result.returncode == 1 and result.stdout == "", result
            assert f"the server at 127.0.0.1:{port} answered with an empty reply" in result.stderr, result.stderr
    finally:
        server.kill()
        server.wait()
