"""Agent configuration: one dataclass, filled from a TOML file (``agent``) or from flags (``run``).

Every problem is a :class:`ConfigError` whose message names the option and the fix; the CLI turns it into exit
code 78 (EX_CONFIG) before anything starts. The defaults are documented in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import shlex
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfelastic.daemon.netutil import host_port
from tfelastic.daemon.rendezvous.api import RendezvousSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EX_CONFIG = 78


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, option: str, *, allow_port_zero: bool = False) -> Endpoint:
        host, sep, port_text = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
            raise ConfigError(f"{option}: {text!r} is not HOST:PORT; write it like 'head-node:29400'")
        port = int(port_text)
        if not (0 if allow_port_zero else 1) <= port <= 65535:
            raise ConfigError(f"{option}: port {port} in {text!r} is out of range 1-65535")
        return cls(host, port)

    def __str__(self) -> str:
        return host_port(self.host, self.port)

    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""  # this process's certificate chain (PEM)
    key: str = ""  # its private key (PEM)
    ca: str = ""  # CA bundle that signs the peers; on a server it also makes client certificates required

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


@dataclass(frozen=True)
class AgentConfig:
    command: tuple[str, ...]
    rendezvous: Endpoint
    job: str = "default"
    min_nodes: int = 1
    max_nodes: int = 1
    node_id: str = field(default_factory=socket.gethostname)
    worker_port: int = 0  # 0: a free port, chosen anew for every generation
    advertise_address: str = ""  # "": the address this node uses to reach the rendezvous
    backup_dir: str = ""  # "": ./tfelastic-backup/<job> in the working directory
    workdir: str = ""
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 3
    restart_window: float = 3600.0
    stall_timeout: float = 300.0  # 0 disables hang detection
    stop_grace: float = 10.0  # planned stops: scale-up, leave, shutdown (time for a trainer to checkpoint)
    failure_stop_grace: float = 0.25  # restarts after a failure: the collective is broken, nothing to save
    token_file: str = ""
    tls: TlsConfig = TlsConfig()
    last_call: float = 1.0
    settle: float = 3.0
    join_timeout: float = 600.0
    heartbeat_interval: float = 0.5
    node_timeout: float = 2.0
    log_level: str = "info"
    metrics_port: int | None = 9464  # None: no /metrics; 0: a free port (logged)
    metrics_address: str = "127.0.0.1"  # loopback: a listener elsewhere needs metrics_token_file
    metrics_token_file: str = ""
    metrics_linger: float = 30.0  # after the job failed, keep /metrics up so Prometheus records the verdict
    instrument: bool = True  # trainers' model.fit reports progress by itself (tfelastic.trainer.instrument)

    def resolved_backup_dir(self) -> str:
        base = self.backup_dir or os.path.join("tfelastic-backup", self.job)
        return str(Path(self.workdir or ".", base).resolve())

    def command_digest(self) -> bytes:
        return hashlib.sha256(shlex.join(self.command).encode()).digest()

    def rendezvous_settings(self) -> RendezvousSettings:
        return RendezvousSettings(last_call_seconds=self.last_call, settle_seconds=self.settle,
                                  join_timeout_seconds=self.join_timeout, node_timeout_seconds=self.node_timeout)


_DURATIONS = ("restart_window", "stall_timeout", "stop_grace", "failure_stop_grace", "last_call", "settle",
              "join_timeout", "heartbeat_interval", "node_timeout", "metrics_linger")


_FLAGS = {"min_nodes": "--nodes", "max_nodes": "--nodes", "job": "--job", "command": "the trainer command (after --)"}
METRICS_OFF = "off"


def validate(config: AgentConfig, where: str = "") -> AgentConfig:
    """Checks values that do not depend on the environment; raises ConfigError naming the option.

    ``where`` is "" for flags (messages name ``--flag``) or a TOML file path (messages name ``section.key``).
    """

    def opt(name: str) -> str:
        if where:
            return f"{where}: {_TOML_NAMES.get(name, name)}"
        return _FLAGS.get(name, "--" + name.replace("_", "-"))

    if not config.command:
        raise ConfigError(f"{opt('command')}: no trainer command given; add it after '--', "
                          "e.g. tfelastic run ... -- python train.py")
    if config.min_nodes < 1:
        raise ConfigError(f"{opt('min_nodes')}: min_nodes is {config.min_nodes}; it must be at least 1")
    if config.max_nodes < config.min_nodes:
        raise ConfigError(f"{opt('max_nodes')}: max_nodes {config.max_nodes} is below min_nodes "
                          f"{config.min_nodes}; write MIN:MAX with MIN <= MAX, e.g. 2:4")
    if not config.job or not all(c.isalnum() or c in "-_." for c in config.job):
        raise ConfigError(f"{opt('job')}: {config.job!r} must be non-empty letters, digits, '-', '_' or '.'")
    if not config.node_id or any(c.isspace() for c in config.node_id):
        raise ConfigError(f"{opt('node_id')}: {config.node_id!r} must be non-empty without spaces")
    if not 0 <= config.worker_port <= 65535:
        raise ConfigError(f"{opt('worker_port')}: {config.worker_port} is out of range 0-65535 "
                          "(0 picks a free port)")
    if config.max_restarts < 0:
        raise ConfigError(f"{opt('max_restarts')}: {config.max_restarts} must be 0 or more")
    for name in _DURATIONS:
        value = getattr(config, name)
        if value < 0 or value != value:
            raise ConfigError(f"{opt(name)}: {value} seconds must be 0 or more")
    if config.heartbeat_interval <= 0:
        raise ConfigError(f"{opt('heartbeat_interval')}: {config.heartbeat_interval}s must be more than 0")
    if config.node_timeout <= config.heartbeat_interval:
        raise ConfigError(f"{opt('node_timeout')}: {config.node_timeout}s must exceed "
                          f"heartbeat_interval {config.heartbeat_interval}s")
    if config.log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{opt('log_level')}: {config.log_level!r} is not one of debug, info, warning, error")
    if config.metrics_port is not None and not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"{opt('metrics_port')}: {config.metrics_port} is out of range 0-65535")
    if config.metrics_port is not None and not is_loopback_host(config.metrics_address) \
            and not config.metrics_token_file:
        raise ConfigError(f"{opt('metrics_address')}: {config.metrics_address!r} is not loopback, so /metrics needs "
                          f"a bearer token; pass {opt('metrics_token_file')} (Prometheus: authorization: "
                          "credentials_file)")
    if bool(config.tls.cert) != bool(config.tls.key):
        raise ConfigError(f"{opt('tls_cert')}/{opt('tls_key')}: give both the certificate and its key")
    return config


def parse_nodes(text: str, option: str = "--nodes") -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        min_nodes = int(low)
        max_nodes = int(high) if sep else min_nodes
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not MIN[:MAX], e.g. 2 or 2:4") from None
    if min_nodes < 1:
        raise ConfigError(f"{option}: {text!r}: the minimum must be at least 1")
    if max_nodes < min_nodes:
        raise ConfigError(f"{option}: {text!r}: MAX {max_nodes} is below MIN {min_nodes}; write MIN:MAX, "
                          "e.g. 2:4")
    return min_nodes, max_nodes


def read_token(path: str, option: str = "--token-file") -> str:
    """The shared secret. Refuses a file that other users can read, and an empty one."""
    try:
        info = os.stat(path)
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{option}: {path!r} is not text; write a printable secret, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{option}: {path!r} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                          f"run: chmod 600 {shlex.quote(path)}")
    if not token:
        raise ConfigError(f"{option}: {path!r} is empty; put a random secret in it, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"{option}: {path!r} must hold one word of printable ASCII (it travels as gRPC "
                          f"metadata), e.g. openssl rand -hex 32 > {shlex.quote(path)}")
    return token


# ------------------------------------------------------------------------------------------------- TOML

_TOML_KEYS: dict[str, dict[str, str]] = {
    # section -> {toml key: AgentConfig field}
    "job": {"name": "job", "command": "command", "min_nodes": "min_nodes", "max_nodes": "max_nodes",
            "max_restarts": "max_restarts", "restart_window": "restart_window",
            "stall_timeout": "stall_timeout", "backup_dir": "backup_dir", "workdir": "workdir", "env": "env",
            "instrument": "instrument"},
    "node": {"id": "node_id", "worker_port": "worker_port", "advertise_address": "advertise_address",
             "stop_grace": "stop_grace", "failure_stop_grace": "failure_stop_grace", "log_level": "log_level"},
    "metrics": {"port": "metrics_port", "address": "metrics_address", "token_file": "metrics_token_file",
                "linger": "metrics_linger"},
    "rendezvous": {"endpoint": "rendezvous", "token_file": "token_file", "last_call": "last_call",
                   "settle": "settle", "join_timeout": "join_timeout",
                   "heartbeat_interval": "heartbeat_interval", "node_timeout": "node_timeout",
                   "tls_cert": "tls_cert", "tls_key": "tls_key", "tls_ca": "tls_ca"},
}


_TOML_NAMES = {field: f"{section}.{key}" for section, keys in _TOML_KEYS.items() for key, field in keys.items()}


Completion = Callable[[dict[str, Any]], dict[str, Any]]  # adds values the file left out (daemon/slurm.py)


def load_toml(path: str, complete: Completion | None = None) -> AgentConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path!r}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: {path!r} is not valid TOML (UTF-8): {e}") from None
    values: dict[str, Any] = {}
    for section, content in raw.items():
        if section not in _TOML_KEYS or not isinstance(content, dict):
            raise ConfigError(f"{path}: unknown section [{section}]; expected one of "
                              f"{', '.join('[' + s + ']' for s in _TOML_KEYS)}")
        for key, value in content.items():
            if key not in _TOML_KEYS[section]:
                raise ConfigError(f"{path}: unknown key {section}.{key}; expected one of "
                                  f"{', '.join(sorted(_TOML_KEYS[section]))}")
            values[_TOML_KEYS[section][key]] = (f"{section}.{key}", value)
    return validate(_from_values(values, path, complete), where=path)


def _from_values(values: dict[str, tuple[str, Any]], path: str, complete: Completion | None = None) -> AgentConfig:
    kwargs: dict[str, Any] = {}
    tls: dict[str, str] = {}
    fields = {f.name: f for f in dataclasses.fields(AgentConfig)}
    for name, (key, value) in values.items():
        where = f"{path}: {key}"
        if name == "command":
            if isinstance(value, str):
                try:
                    value = shlex.split(value)
                except ValueError as e:
                    raise ConfigError(f"{where}: cannot split {value!r} into words: {e}") from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: must be a list of strings, e.g. [\"python\", \"train.py\"]")
            kwargs[name] = tuple(value)
        elif name == "rendezvous":
            kwargs[name] = Endpoint.parse(_expect(value, str, where), where)
        elif name == "env":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise ConfigError(f"{where}: must be a table of strings, e.g. {{ NCCL_DEBUG = \"WARN\" }}")
            kwargs[name] = tuple(sorted(value.items()))
        elif name == "metrics_port":
            kwargs[name] = None if value == METRICS_OFF else _expect(value, int, where)
        elif name.startswith("tls_"):
            tls[name[4:]] = _expect(value, str, where)
        elif fields[name].type == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {value!r} must be true or false")
            kwargs[name] = value
        elif fields[name].type in ("float",):
            kwargs[name] = float(_expect(value, (int, float), where))
        elif fields[name].type in ("int",):
            kwargs[name] = _expect(value, int, where)
        else:
            kwargs[name] = _expect(value, str, where)
    if "max_nodes" not in kwargs and "min_nodes" in kwargs:
        kwargs["max_nodes"] = kwargs["min_nodes"]  # like --nodes N: a fixed size unless a range is given
    if complete is not None:
        kwargs = complete(kwargs)
    for required, key in (("command", "job.command"), ("rendezvous", "rendezvous.endpoint")):
        if required not in kwargs:
            raise ConfigError(f"{path}: {key} is required")
    return AgentConfig(tls=TlsConfig(**tls), **kwargs)


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(f"{where}: {value!r} must be a {names}")
    return value
