"""The configurations of the daemon's commands, as the option table (:mod:`tfelastic.daemon.options`) fills them:

* :class:`AgentConfig` (``tfelastic agent``/``run``): four sections, the same four as the TOML file's ([job],
  [node], [rendezvous], [metrics]);
* :class:`CoordinatorConfig` (``tfelastic coordinator``): where it listens, the rendezvous and metrics sections;
* :class:`OperatorConfig` (``status``, ``drain``, ``restart``, ``readmit``): the job and how to reach it.

Every problem is a :class:`ConfigError` that names the option the way the user wrote it (a flag, or ``FILE:
section.key``) and the fix; the CLI turns it into exit code 78 before anything starts. Checks that depend on the
machine are in :mod:`tfelastic.daemon.preflight`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfelastic.daemon.endpoint import Endpoint, TlsConfig, is_loopback_host
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.options import AGENT, COORDINATOR, OFF, OPTIONS, Option
from tfelastic.daemon.rendezvous import bounds
from tfelastic.daemon.rendezvous.api import STALL_LEARNED, JobSpec, RendezvousSettings
from tfelastic.daemon.rendezvous.roles import Role, Strategy
from tfelastic.daemon.worker.stall import StallLimits, StallTimeout
from tfelastic.trainer import snapshots


def _default(name: str) -> Any:
    return OPTIONS[name].default


@dataclass(frozen=True)
class JobConfig:
    """Settings every agent of a job must agree on (the coordinator compares them), and the trainer's launch."""

    command: tuple[str, ...] = _default("command")
    name: str = _default("job")
    min_nodes: int = _default("min_nodes")
    max_nodes: int = _default("max_nodes")
    strategy: str = _default("strategy")
    ps: int = _default("ps")
    worker_replacements: int = _default("worker_replacements")
    max_restarts: int = _default("max_restarts")
    restart_window: float = _default("restart_window")
    stall_timeout: StallTimeout = _default("stall_timeout")  # noqa: RUF009 (frozen)
    stall_floor: float = _default("stall_floor")
    stall_allowance: float = _default("stall_allowance")
    backup_dir: str = _default("backup_dir")  # "": ./tfelastic-backup/<job> in the working directory
    workdir: str = _default("workdir")
    env: tuple[tuple[str, str], ...] = _default("env")
    instrument: bool = _default("instrument")


@dataclass(frozen=True)
class NodeConfig:
    id: str = field(default_factory=OPTIONS["node_id"].default_value)
    worker_port: int = _default("worker_port")
    role: str = _default("role")
    advertise_address: str = _default("advertise_address")
    stop_grace: float = _default("stop_grace")
    failure_stop_grace: float = _default("failure_stop_grace")
    log_level: str = _default("log_level")
    check_min_free_mb: int = _default("check_min_free_mb")
    warm_start: bool = _default("warm_start")
    local_checkpoint_dir: str = _default("local_checkpoint_dir")  # "" or "off": off


@dataclass(frozen=True)
class RendezvousConfig:
    endpoint: Endpoint | EtcdTarget  # HOST:PORT of an embedded or standalone coordinator, or the job's etcd
    token_file: str = _default("token_file")
    tls_cert: str = _default("tls_cert")
    tls_key: str = _default("tls_key")
    tls_ca: str = _default("tls_ca")
    last_call: float = _default("last_call")
    settle: float = _default("settle")
    join_timeout: float = _default("join_timeout")
    heartbeat_interval: float = _default("heartbeat_interval")
    node_timeout: float = _default("node_timeout")
    restart_backoff: float = _default("restart_backoff")
    restart_backoff_max: float = _default("restart_backoff_max")
    quarantine_after: int = _default("quarantine_after")
    quarantine_window: float = _default("quarantine_window")
    quarantine_cooldown: float = _default("quarantine_cooldown")
    quarantine_cooldown_max: float = _default("quarantine_cooldown_max")
    node_probe: bool = _default("node_probe")
    coordinator_port: int = _default("coordinator_port")
    lease_ttl: int = _default("lease_ttl")
    etcd_ca: str = _default("etcd_ca")
    etcd_cert: str = _default("etcd_cert")
    etcd_key: str = _default("etcd_key")
    etcd_password_file: str = _default("etcd_password_file")

    @property
    def tls(self) -> TlsConfig:
        return TlsConfig(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def etcd(self) -> EtcdTarget | None:
        return self.endpoint if isinstance(self.endpoint, EtcdTarget) else None

    @property
    def route_host(self) -> str:
        """A host this node reaches the job through: the coordinator's, or etcd's first member."""
        return self.endpoint.endpoints[0].host if isinstance(self.endpoint, EtcdTarget) else self.endpoint.host

    def settings(self) -> RendezvousSettings:
        """The coordinator's timing."""
        return RendezvousSettings(last_call_seconds=self.last_call, settle_seconds=self.settle,
                                  join_timeout_seconds=self.join_timeout, node_timeout_seconds=self.node_timeout,
                                  restart_backoff_seconds=self.restart_backoff,
                                  restart_backoff_max_seconds=self.restart_backoff_max,
                                  quarantine_after=self.quarantine_after,
                                  quarantine_window_seconds=self.quarantine_window,
                                  quarantine_cooldown_seconds=self.quarantine_cooldown,
                                  quarantine_cooldown_max_seconds=self.quarantine_cooldown_max,
                                  probe_nodes=self.node_probe)


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = _default("metrics_port")  # None: no /metrics; 0: a free port (logged)
    address: str = _default("metrics_address")  # loopback: a listener elsewhere needs token_file
    token_file: str = _default("metrics_token_file")
    linger: float = _default("metrics_linger")  # after the job failed, /metrics stays up so Prometheus records it


_SECTIONS: dict[str, type] = {"job": JobConfig, "node": NodeConfig, "metrics": MetricsConfig,
                              "rendezvous": RendezvousConfig}


@dataclass(frozen=True)
class AgentConfig:
    job: JobConfig
    rendezvous: RendezvousConfig
    node: NodeConfig = field(default_factory=NodeConfig)
    metrics: MetricsConfig = MetricsConfig()

    def resolved_backup_dir(self) -> str:
        base = self.job.backup_dir or os.path.join("tfelastic-backup", self.job.name)
        return str(Path(self.job.workdir or ".", base).resolve())

    def local_tier(self) -> str | None:
        """This node's fast checkpoint tier of the job (``ROOT/JOB/NODE``), or None when the tier is off."""
        root = self.node.local_checkpoint_dir
        if root in ("", OFF):
            return None
        return snapshots.local_store_root(root, self.job.name, self.node.id)

    def command_digest(self) -> bytes:
        return hashlib.sha256(shlex.join(self.job.command).encode()).digest()

    def stall_limits(self) -> StallLimits:
        job = self.job
        return job.stall_timeout.limits(floor=job.stall_floor, allowance=job.stall_allowance)

    def job_spec(self) -> JobSpec:
        """What the coordinator compares across agents (and checks against its bounds)."""
        job, rdzv = self.job, self.rendezvous
        stall = job.stall_timeout.seconds
        return JobSpec(job.name, self.command_digest(), job.min_nodes, job.max_nodes, job.max_restarts,
                       job.restart_window, STALL_LEARNED if stall is None else stall, self.resolved_backup_dir(),
                       rdzv.heartbeat_interval, rdzv.node_timeout, job.strategy, job.ps)

    def value(self, name: str) -> Any:
        """An option's value by name (see :data:`OPTIONS`): ``config.value("node_id")`` is ``config.node.id``."""
        section, key = OPTIONS[name].field
        return getattr(getattr(self, section), key)

    def replace(self, **changes: Any) -> AgentConfig:
        """A copy with options changed by name (``stall_timeout=StallTimeout(5)``, ``node_id="n2"``)."""
        sections: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            section, key = OPTIONS[name].field
            sections.setdefault(section, {})[key] = value
        return dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **kw)
                                            for s, kw in sections.items()})


@dataclass(frozen=True)
class CoordinatorConfig:
    """A standalone coordinator: the job's only one on ``listen``, or with an etcd rendezvous a head-node candidate
    that listens there."""

    listen: Endpoint
    name: str  # how the coordinator names itself (status, etcd's leader key)
    job: str
    log_level: str
    rendezvous: RendezvousConfig
    metrics: MetricsConfig
    failure_stop_grace: float = _default("failure_stop_grace")  # the nodes' (an etcd take-over waits for it)

    def value(self, name: str) -> Any:
        section, key = OPTIONS[name].field
        if section in ("rendezvous", "metrics"):
            return getattr(getattr(self, section), key)
        return {"job": self.job, "node_id": self.name, "log_level": self.log_level}[name]


@dataclass(frozen=True)
class OperatorConfig:
    """What an operator command needs to reach its job's coordinator."""

    job: str
    rendezvous: RendezvousConfig


def _sections(values: dict[str, Any]) -> dict[str, Any]:
    """Each section built from the values given by option name; the rest take their defaults."""
    kwargs: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for name, value in values.items():
        section, key = OPTIONS[name].field
        kwargs[section][key] = value
    return {s: cls(**kwargs[s]) for s, cls in _SECTIONS.items()}


def from_values(values: dict[str, Any]) -> AgentConfig:
    """An AgentConfig from option values by name. ``rendezvous`` is required (the caller says how it was
    missing)."""
    return AgentConfig(**_sections(values))


def coordinator_from_values(values: dict[str, Any], listen: Endpoint) -> CoordinatorConfig:
    sections = _sections({"rendezvous": listen, **values})
    node = sections["node"]
    return CoordinatorConfig(listen, node.id, sections["job"].name, node.log_level, sections["rendezvous"],
                             sections["metrics"])


def operator_from_values(values: dict[str, Any]) -> OperatorConfig:
    sections = _sections(values)
    return OperatorConfig(sections["job"].name, sections["rendezvous"])


def label(name: str, where: str = "") -> str:
    """How a message names an option: its flag, or for a file ``PATH: section.key``."""
    option = OPTIONS[name]
    if where:
        return f"{where}: {option.key}"
    return option.flag or option.help


def labeller(where: str = "", sources: Mapping[str, str] | None = None) -> Callable[[str], str]:
    """How a command's messages name each option: as ``sources`` says it came (a variable, a job file's key), else
    as :func:`label` does."""
    given = sources or {}

    def opt(name: str) -> str:
        return given.get(name) or label(name, where)

    return opt


# ------------------------------------------------------------------------------------------------ validation

Label = Callable[[str], str]


def _check_options(options: Iterable[Option], value: Callable[[str], Any], opt: Label) -> None:
    """Each option's value against its kind's bounds."""
    for option in options:
        if (problem := option.problem(value(option.name))) is not None:
            raise ConfigError(f"{opt(option.name)}: {problem}")


def _options_of(command: str) -> list[Option]:
    return [o for o in OPTIONS.values() if command in o.commands and o.name not in ("rendezvous", "command")]


def validate(config: AgentConfig, where: str = "", sources: Mapping[str, str] | None = None) -> AgentConfig:
    """Checks values that do not depend on the environment, and every bound the coordinator enforces; raises
    ConfigError naming the option. ``where`` is "" for flags, or a TOML file's path; ``sources`` names the
    settings that came from elsewhere (sources.Gathered)."""
    opt = labeller(where, sources)
    job, node = config.job, config.node
    if not job.command:
        raise ConfigError(f"{opt('command')}: no trainer command given; add it after '--', "
                          "e.g. tfelastic run ... -- python train.py")
    if job.min_nodes < 1:
        raise ConfigError(f"{opt('min_nodes')}: min_nodes is {job.min_nodes}; it must be at least 1")
    if job.max_nodes < job.min_nodes:
        raise ConfigError(f"{opt('max_nodes')}: max_nodes {job.max_nodes} is below min_nodes {job.min_nodes}; "
                          "write MIN:MAX with MIN <= MAX, e.g. 2:4")
    _check_node_id(node.id, opt)
    _check_options(_options_of(AGENT), config.value, opt)
    _check_local_checkpoint_dir(node.local_checkpoint_dir, opt)
    if node.role != Role.ANY.value and job.strategy != Strategy.PARAMETER_SERVER.value:
        raise ConfigError(f"{opt('role')}: {node.role!r} is a task of a parameter-server job, and this job is "
                          f"{job.strategy}: drop {opt('role')} or set {opt('strategy')} parameter-server")
    _check_timing(config.rendezvous, opt)
    for problem in bounds.spec_problems(config.job_spec()):  # what the coordinator would refuse
        raise ConfigError(f"{opt(_option_of_spec_field(problem.field))}: {problem.text}")
    _check_serving(config, opt)
    return config


def validate_coordinator(config: CoordinatorConfig, sources: Mapping[str, str] | None = None) -> CoordinatorConfig:
    opt = labeller(sources=sources)
    _check_name(config.job, opt("job"))
    _check_node_id(config.name, opt)
    _check_options(_options_of(COORDINATOR), config.value, opt)
    _check_timing(config.rendezvous, opt)
    _check_serving(config, opt)
    return config


def _check_serving(config: AgentConfig | CoordinatorConfig, opt: Label) -> None:
    """What an agent and a coordinator check alike after the values: their ports, /metrics, TLS and etcd."""
    _check_ports(config, opt)
    _check_metrics(config.metrics, opt)
    _check_connection(config.rendezvous, opt)


def _check_ports(config: AgentConfig | CoordinatorConfig, opt: Label) -> None:
    """One port per listener of this process: a metrics server on the rendezvous port would answer the agents
    that dial their coordinator there, forever."""
    rdzv = config.rendezvous
    ports: dict[str, int | None] = {}
    if isinstance(config, CoordinatorConfig):
        ports["listen"] = config.listen.port
    elif isinstance(rdzv.endpoint, Endpoint):
        ports["rendezvous"] = rdzv.endpoint.port
    ports |= {"coordinator_port": rdzv.coordinator_port, "metrics_port": config.metrics.port}
    if isinstance(config, AgentConfig):
        ports["worker_port"] = config.node.worker_port

    def name_of(option: str) -> str:
        return "--listen" if option == "listen" else opt(option)

    seen: dict[int, str] = {}
    for option, port in ports.items():
        if port and port in seen:
            other = name_of(seen[port]).rpartition(": ")[2]  # a file's path is named once
            raise ConfigError(f"{name_of(option)}: port {port} is also {other}'s; give each listener of this "
                              "process its own port")
        if port:
            seen[port] = option


def validate_operator(config: OperatorConfig, sources: Mapping[str, str] | None = None) -> OperatorConfig:
    opt = labeller(sources=sources)
    _check_name(config.job, opt("job"))
    _check_connection(config.rendezvous, opt)
    return config


def _option_of_spec_field(name: str) -> str:
    """JobSpec's fields are named after the options (durations end in _seconds); its digest is the command's."""
    option = name.removesuffix("_seconds")
    return option if option in OPTIONS else "command"


def _check_name(job: str, option: str) -> None:
    if (problem := bounds.job_name_problem(job)) is not None:
        raise ConfigError(f"{option}: {problem.text}")


def _check_node_id(node_id: str, opt: Label) -> None:
    if (problem := bounds.node_id_problem(node_id)) is not None:
        raise ConfigError(f"{opt('node_id')}: {problem.text}")


def _check_timing(rdzv: RendezvousConfig, opt: Label) -> None:
    if rdzv.node_timeout <= rdzv.heartbeat_interval:
        raise ConfigError(f"{opt('node_timeout')}: {rdzv.node_timeout}s must exceed "
                          f"heartbeat_interval {rdzv.heartbeat_interval}s")


def _check_metrics(metrics: MetricsConfig, opt: Label) -> None:
    if metrics.port is not None and not is_loopback_host(metrics.address) and not metrics.token_file:
        raise ConfigError(f"{opt('metrics_address')}: {metrics.address!r} is not loopback, so /metrics needs a "
                          f"bearer token; pass {opt('metrics_token_file')} (Prometheus: authorization: "
                          "credentials_file)")


def _check_connection(rdzv: RendezvousConfig, opt: Label) -> None:
    """TLS and etcd settings that only make sense together."""
    if bool(rdzv.tls_cert) != bool(rdzv.tls_key):
        raise ConfigError(f"{opt('tls_cert')}/{opt('tls_key')}: give both the certificate and its key")
    etcd_options = [name for name in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file", "coordinator_port")
                    if getattr(rdzv, name)]
    if rdzv.etcd is None:
        if etcd_options:
            raise ConfigError(f"{opt(etcd_options[0])}: only with an etcd rendezvous ({opt('rendezvous')} "
                              "etcd://HOST:PORT,...)")
        return
    if not rdzv.etcd.tls and (rdzv.etcd_ca or rdzv.etcd_cert or rdzv.etcd_key):
        raise ConfigError(f"{opt('etcd_ca')}/{opt('etcd_cert')}/{opt('etcd_key')}: TLS to etcd needs an etcds:// "
                          f"URL, not {rdzv.etcd}")
    if bool(rdzv.etcd_cert) != bool(rdzv.etcd_key):
        raise ConfigError(f"{opt('etcd_cert')}/{opt('etcd_key')}: give both the certificate and its key")


def _check_local_checkpoint_dir(root: str, opt: Label) -> None:
    if root in ("", OFF):
        return
    if not os.path.isabs(root):
        raise ConfigError(f"{opt('local_checkpoint_dir')}: {root!r} is a relative path; give an absolute directory, "
                          f"e.g. {snapshots.LOCAL_ROOT_DEFAULT}, or '{OFF}' to turn the local tier off")
    if len(root) > bounds.MAX_PATH_CHARS or "\0" in root:
        raise ConfigError(f"{opt('local_checkpoint_dir')}: a path of {len(root)} characters must have at most "
                          f"{bounds.MAX_PATH_CHARS} and no NUL character")


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

