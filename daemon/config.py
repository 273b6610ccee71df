"""Agent configuration: one :class:`AgentConfig` of four sections, the same four as the TOML file's ([job], [node],
[rendezvous], [metrics]), filled from a file (``tfelastic agent``) or from flags (``tfelastic run``).

:data:`OPTIONS` is the one table that names every setting three ways: the flag, the TOML key and the field it
fills. The CLI builds its parser from it, the TOML loader reads files with it, and every message names a
setting the way the user wrote it. Every problem is a :class:`ConfigError` that names the option and the fix; the
CLI turns it into exit code 78 before anything starts. The defaults are documented in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfelastic.daemon.endpoint import Endpoint, TlsConfig, is_loopback_host
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.url import EtcdTarget, is_etcd_url, parse_etcd_url
from tfelastic.daemon.rendezvous import bounds
from tfelastic.daemon.rendezvous.api import STALL_LEARNED, JobSpec, RendezvousSettings
from tfelastic.daemon.worker.stall import StallLimits
from tfelastic.trainer import snapshots

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class JobConfig:
    """Settings every agent of a job must agree on (the coordinator compares them), and the trainer's launch."""

    command: tuple[str, ...] = ()
    name: str = "default"
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int = 3
    restart_window: float = 3600.0
    stall_timeout: float | None = None  # None ("auto"): learned from the step times; 0 disables hang detection
    stall_floor: float = 20.0  # the least a learned limit can be
    stall_allowance: float = 300.0  # start-up, restore, the first steps, a save, an evaluation (learned mode)
    backup_dir: str = ""  # "": ./tfelastic-backup/<job> in the working directory
    workdir: str = ""
    env: tuple[tuple[str, str], ...] = ()
    instrument: bool = True  # trainers' model.fit reports progress by itself (tfelastic.trainer.instrument)


@dataclass(frozen=True)
class NodeConfig:
    id: str = field(default_factory=socket.gethostname)
    worker_port: int = 0  # 0: a free port, chosen anew for every generation
    advertise_address: str = ""  # "": the address this node uses to reach the rendezvous
    stop_grace: float = 10.0  # planned stops: scale-up, leave, shutdown (time for a trainer to checkpoint)
    failure_stop_grace: float = 0.25  # restarts after a failure: the collective is broken, nothing to save
    log_level: str = "info"
    check_min_free_mb: int = 1024  # the node check wants this much free in the backup dir
    warm_start: bool = True  # Python trainer commands launch through a standby interpreter (worker/warm.py)
    local_checkpoint_dir: str = snapshots.LOCAL_ROOT_DEFAULT  # the fast tier's root; "": off (trainer/snapshots.py)


@dataclass(frozen=True)
class RendezvousConfig:
    endpoint: Endpoint | EtcdTarget  # HOST:PORT of an embedded or standalone coordinator, or the job's etcd
    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    last_call: float = 30.0  # the first round, with a node range: closes at once when max_nodes have joined
    settle: float = 3.0
    join_timeout: float = 600.0
    heartbeat_interval: float = 0.5
    node_timeout: float = 2.0
    restart_backoff: float = 1.0
    restart_backoff_max: float = 30.0
    quarantine_after: int = 2  # first failures of one node within quarantine_window that set it aside; 0: never
    quarantine_window: float = 3600.0
    quarantine_cooldown: float = 600.0  # doubles with each quarantine of the same node
    quarantine_cooldown_max: float = 21600.0
    node_probe: bool = True  # the coordinator tries to reach each checked node's trainer port
    coordinator_port: int = 0  # etcd: where this agent serves the job when it is elected (0: a free port)
    lease_ttl: int = 2  # etcd: the coordinator's lease; a dead one is replaced after about this long
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_password_file: str = ""  # USER:PASSWORD of etcd's own authentication

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


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = 9464  # None: no /metrics; 0: a free port (logged)
    address: str = "127.0.0.1"  # loopback: a listener elsewhere needs token_file
    token_file: str = ""
    linger: float = 30.0  # after the job failed, keep /metrics up so Prometheus records the verdict


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
        if not root or root == LOCAL_TIER_OFF:
            return None
        return snapshots.local_store_root(root, self.job.name, self.node.id)

    def command_digest(self) -> bytes:
        return hashlib.sha256(shlex.join(self.job.command).encode()).digest()

    def stall_limits(self) -> StallLimits:
        job = self.job
        return StallLimits(job.stall_timeout, floor=job.stall_floor, allowance=job.stall_allowance)

    def job_spec(self) -> JobSpec:
        """What the coordinator compares across agents (and checks against its bounds)."""
        job, rdzv = self.job, self.rendezvous
        return JobSpec(job.name, self.command_digest(), job.min_nodes, job.max_nodes, job.max_restarts,
                       job.restart_window, STALL_LEARNED if job.stall_timeout is None else job.stall_timeout,
                       self.resolved_backup_dir(), rdzv.heartbeat_interval,
                       rdzv.node_timeout)

    def rendezvous_settings(self) -> RendezvousSettings:
        r = self.rendezvous
        return RendezvousSettings(last_call_seconds=r.last_call, settle_seconds=r.settle,
                                  join_timeout_seconds=r.join_timeout, node_timeout_seconds=r.node_timeout,
                                  restart_backoff_seconds=r.restart_backoff,
                                  restart_backoff_max_seconds=r.restart_backoff_max,
                                  quarantine_after=r.quarantine_after, quarantine_window_seconds=r.quarantine_window,
                                  quarantine_cooldown_seconds=r.quarantine_cooldown,
                                  quarantine_cooldown_max_seconds=r.quarantine_cooldown_max,
                                  probe_nodes=r.node_probe)

    def value(self, name: str) -> Any:
        """An option's value by name (see :data:`OPTIONS`): ``config.value("node_id")`` is ``config.node.id``."""
        section, key = OPTIONS[name].field
        return getattr(getattr(self, section), key)

    def replace(self, **changes: Any) -> AgentConfig:
        """A copy with options changed by name (``stall_timeout=5``, ``node_id="n2"``): see :data:`OPTIONS`."""
        sections: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            section, key = OPTIONS[name].field
            sections.setdefault(section, {})[key] = value
        return dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **kw)
                                            for s, kw in sections.items()})


# ------------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class Option:
    """One setting: ``name`` (unique; the CLI's dest and SLURM's name for it), its TOML ``key`` (section.key; the
    section's field of that name holds it, ``tls_*`` aside), and its ``flag`` ("" when only the file sets it)."""

    name: str
    key: str
    flag: str
    help: str
    metavar: str | None = None

    @property
    def field(self) -> tuple[str, str]:
        section, _, key = self.key.partition(".")
        return section, key


_OPTIONS = [
    Option("command", "job.command", "", "the trainer command (after --)"),
    Option("job", "job.name", "--job", "job name (default 'default'; under SLURM slurm-JOBID)"),
    Option("min_nodes", "job.min_nodes", "--nodes", "node count range (default 1; under SLURM the step's task count)",
           "MIN[:MAX]"),
    Option("max_nodes", "job.max_nodes", "--nodes", "(the MAX of --nodes)"),
    Option("max_restarts", "job.max_restarts", "--max-restarts", "failures allowed per restart window", "N"),
    Option("restart_window", "job.restart_window", "--restart-window", "restart budget window in seconds", "S"),
    Option("stall_timeout", "job.stall_timeout", "--stall-timeout",
           "no progress for this long is a hang: 'auto' learns it from the job's step times; 0 disables",
           "auto|SECONDS"),
    Option("stall_floor", "job.stall_floor", "--stall-floor", "the least a learned stall limit can be", "SECONDS"),
    Option("stall_allowance", "job.stall_allowance", "--stall-allowance",
           "with a learned stall limit: the time allowed for start-up, restore, the first step, a checkpoint save "
           "and an evaluation", "SECONDS"),
    Option("backup_dir", "job.backup_dir", "--backup-dir",
           "BackupAndRestore directory on shared storage (default ./tfelastic-backup/JOB)", "DIR"),
    Option("workdir", "job.workdir", "--workdir", "trainer working directory (default: cwd)", "DIR"),
    Option("env", "job.env", "", "extra environment of the trainer"),
    Option("instrument", "job.instrument", "--no-instrument",
           "do not make the trainer's model.fit report progress by itself (hang detection and status then need the "
           "trainer's own reports)"),
    Option("node_id", "node.id", "--node-id", "unique node id (default: hostname; under SLURM its node name)", "ID"),
    Option("worker_port", "node.worker_port", "--worker-port",
           "trainer port (0: a free port, new for every generation)", "PORT"),
    Option("advertise_address", "node.advertise_address", "--advertise-address",
           "address peers reach this node's trainer at (default: the route to the rendezvous)", "ADDR"),
    Option("stop_grace", "node.stop_grace", "--stop-grace", "SIGTERM to SIGKILL grace period", "S"),
    Option("failure_stop_grace", "node.failure_stop_grace", "--failure-stop-grace",
           "SIGTERM to SIGKILL grace after a failure", "S"),
    Option("log_level", "node.log_level", "--log-level", "debug, info, warning or error"),
    Option("check_min_free_mb", "node.check_min_free_mb", "--check-min-free-mb",
           "the node check fails with less free space than this in the backup dir", "MB"),
    Option("warm_start", "node.warm_start", "--warm-start",
           "launch Python trainer commands through a standby interpreter that has imported TensorFlow "
           "(default on; other commands start cold)", "on|off"),
    Option("local_checkpoint_dir", "node.local_checkpoint_dir", "--local-checkpoint-dir",
           "root of the node-local snapshot tier, in memory (an absolute path; 'off' turns the tier off)",
           "DIR|off"),
    Option("rendezvous", "rendezvous.endpoint", "--rendezvous",
           "the coordinator's endpoint, or the job's etcd: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS) "
           "(required; under SLURM the step's first host)", "HOST:PORT|etcd://..."),
    Option("token_file", "rendezvous.token_file", "--token-file",
           "file holding the shared secret (mode 600); required for non-loopback addresses", "PATH"),
    Option("tls_cert", "rendezvous.tls_cert", "--tls-cert", "certificate chain of this process (TLS)", "PEM"),
    Option("tls_key", "rendezvous.tls_key", "--tls-key", "private key of --tls-cert", "PEM"),
    Option("tls_ca", "rendezvous.tls_ca", "--tls-ca",
           "CA bundle of the peers; on a server it makes client certificates required (mTLS)", "PEM"),
    Option("last_call", "rendezvous.last_call", "--last-call", "after min nodes joined, wait this long for more", "S"),
    Option("settle", "rendezvous.settle", "--settle",
           "after a node joins a running job below max, wait this long", "S"),
    Option("join_timeout", "rendezvous.join_timeout", "--join-timeout",
           "how long to wait below min nodes (or for an unreachable coordinator) before failing", "S"),
    Option("heartbeat_interval", "rendezvous.heartbeat_interval", "--heartbeat-interval", "heartbeat period", "S"),
    Option("node_timeout", "rendezvous.node_timeout", "--node-timeout", "silence after which a node is lost", "S"),
    Option("restart_backoff", "rendezvous.restart_backoff", "--restart-backoff",
           "wait before the generation after a second failed one in a row, doubling each time; 0 never waits", "S"),
    Option("restart_backoff_max", "rendezvous.restart_backoff_max", "--restart-backoff-max",
           "the longest wait between failed generations", "S"),
    Option("quarantine_after", "rendezvous.quarantine_after", "--quarantine-after",
           "set a node aside after its worker failed first this often within --quarantine-window; 0 never does",
           "N"),
    Option("quarantine_window", "rendezvous.quarantine_window", "--quarantine-window",
           "the window of --quarantine-after", "S"),
    Option("quarantine_cooldown", "rendezvous.quarantine_cooldown", "--quarantine-cooldown",
           "how long a node stays quarantined the first time; each next time twice as long", "S"),
    Option("quarantine_cooldown_max", "rendezvous.quarantine_cooldown_max", "--quarantine-cooldown-max",
           "the longest quarantine", "S"),
    Option("node_probe", "rendezvous.node_probe", "--no-node-probe",
           "the coordinator does not try to reach a node's trainer port in its node check (a coordinator outside "
           "the nodes' trainer network)"),
    Option("coordinator_port", "rendezvous.coordinator_port", "--coordinator-port",
           "with etcd: the port this agent serves the job on when it is elected coordinator (0: a free port)",
           "PORT"),
    Option("lease_ttl", "rendezvous.lease_ttl", "--lease-ttl",
           "with etcd: the coordinator's lease in seconds; a dead coordinator is replaced about this long after",
           "S"),
    Option("etcd_ca", "rendezvous.etcd_ca", "--etcd-ca", "with etcds://: the CA bundle of etcd's certificates",
           "PEM"),
    Option("etcd_cert", "rendezvous.etcd_cert", "--etcd-cert", "with etcds://: this node's client certificate",
           "PEM"),
    Option("etcd_key", "rendezvous.etcd_key", "--etcd-key", "with etcds://: the key of --etcd-cert", "PEM"),
    Option("etcd_password_file", "rendezvous.etcd_password_file", "--etcd-password-file",
           "with etcd authentication: a file holding USER:PASSWORD (mode 600)", "PATH"),
    Option("metrics_port", "metrics.port", "--metrics-port",
           "serve Prometheus /metrics; 0 picks a free port, 'off' disables", "PORT"),
    Option("metrics_address", "metrics.address", "--metrics-address",
           "address of /metrics (any other than loopback needs --metrics-token-file)", "ADDR"),
    Option("metrics_token_file", "metrics.token_file", "--metrics-token-file",
           "bearer token that scrapes of /metrics must present (mode 600)", "PATH"),
    Option("metrics_linger", "metrics.linger", "--metrics-linger",
           "after the job failed, keep /metrics up this long so Prometheus records it", "S"),
]
OPTIONS = {option.name: option for option in _OPTIONS}
_SECTIONS = {"job": JobConfig, "node": NodeConfig, "metrics": MetricsConfig, "rendezvous": RendezvousConfig}
METRICS_OFF = "off"
LOCAL_TIER_OFF = "off"  # --local-checkpoint-dir off (or ""): no node-local snapshot tier
STALL_AUTO = "auto"  # --stall-timeout auto (the default): a learned limit


def default_of(name: str) -> Any:
    """The built-in default of an option (the node id's is this host's name)."""
    section, key = OPTIONS[name].field
    f = next(f for f in dataclasses.fields(_SECTIONS[section]) if f.name == key)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def from_values(values: dict[str, Any]) -> AgentConfig:
    """An AgentConfig from option values by name; the rest take their defaults. ``command`` and ``rendezvous``
    are required (the caller says which way they were missing)."""
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for name, value in values.items():
        section, key = OPTIONS[name].field
        sections[section][key] = value
    return AgentConfig(**{s: cls(**sections[s]) for s, cls in _SECTIONS.items()})


def label(name: str, where: str = "") -> str:
    """How a message names an option: its flag, or for a file ``PATH: section.key``."""
    option = OPTIONS[name]
    if where:
        return f"{where}: {option.key}"
    return option.flag or option.help


# ------------------------------------------------------------------------------------------------ validation

_DURATIONS = ("restart_window", "stall_timeout", "stall_floor", "stall_allowance", "stop_grace", "failure_stop_grace",
              "last_call", "settle",
              "join_timeout", "heartbeat_interval", "node_timeout", "restart_backoff", "restart_backoff_max",
              "quarantine_window", "quarantine_cooldown", "quarantine_cooldown_max", "metrics_linger")
_SPEC_OPTIONS = {"job": "job", "min_nodes": "min_nodes", "max_nodes": "max_nodes", "max_restarts": "max_restarts",
                 "restart_window_seconds": "restart_window", "stall_timeout_seconds": "stall_timeout",
                 "backup_dir": "backup_dir", "heartbeat_interval_seconds": "heartbeat_interval",
                 "node_timeout_seconds": "node_timeout"}


def validate(config: AgentConfig, where: str = "") -> AgentConfig:
    """Checks values that do not depend on the environment, and every bound the coordinator enforces; raises
    ConfigError naming the option. ``where`` is "" for flags, or a TOML file's path."""

    def opt(name: str) -> str:
        return label(name, where)

    job, node, rdzv, metrics = config.job, config.node, config.rendezvous, config.metrics
    if not job.command:
        raise ConfigError(f"{opt('command')}: no trainer command given; add it after '--', "
                          "e.g. tfelastic run ... -- python train.py")
    if job.min_nodes < 1:
        raise ConfigError(f"{opt('min_nodes')}: min_nodes is {job.min_nodes}; it must be at least 1")
    if job.max_nodes < job.min_nodes:
        raise ConfigError(f"{opt('max_nodes')}: max_nodes {job.max_nodes} is below min_nodes {job.min_nodes}; "
                          "write MIN:MAX with MIN <= MAX, e.g. 2:4")
    if (problem := bounds.node_id_problem(node.id)) is not None:
        raise ConfigError(f"{opt('node_id')}: {problem.text}")
    if not 0 <= node.worker_port <= 65535:
        raise ConfigError(f"{opt('worker_port')}: {node.worker_port} is out of range 0-65535 (0 picks a free port)")
    if job.max_restarts < 0:
        raise ConfigError(f"{opt('max_restarts')}: {job.max_restarts} must be 0 or more")
    if not 0 <= rdzv.quarantine_after <= 1000:
        raise ConfigError(f"{opt('quarantine_after')}: {rdzv.quarantine_after} is out of range 0-1000 (0 never "
                          "quarantines a node)")
    if node.check_min_free_mb < 0:
        raise ConfigError(f"{opt('check_min_free_mb')}: {node.check_min_free_mb} must be 0 or more")
    _validate_local_checkpoint_dir(node.local_checkpoint_dir, opt)
    for name in _DURATIONS:
        value = config.value(name)
        if value is None:  # stall_timeout "auto"
            continue
        if value < 0 or value != value:
            raise ConfigError(f"{opt(name)}: {value} seconds must be 0 or more")
        if (problem := bounds.seconds_problem(name, value)) is not None:  # inf, or a typo's extra digits
            raise ConfigError(f"{opt(name)}: {problem.text}")
    if rdzv.heartbeat_interval <= 0:
        raise ConfigError(f"{opt('heartbeat_interval')}: {rdzv.heartbeat_interval}s must be more than 0")
    if rdzv.node_timeout <= rdzv.heartbeat_interval:
        raise ConfigError(f"{opt('node_timeout')}: {rdzv.node_timeout}s must exceed "
                          f"heartbeat_interval {rdzv.heartbeat_interval}s")
    for problem in bounds.spec_problems(config.job_spec()):  # what the coordinator would refuse
        raise ConfigError(f"{opt(_SPEC_OPTIONS[problem.field])}: {problem.text}")
    if node.log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{opt('log_level')}: {node.log_level!r} is not one of debug, info, warning, error")
    if metrics.port is not None and not 0 <= metrics.port <= 65535:
        raise ConfigError(f"{opt('metrics_port')}: {metrics.port} is out of range 0-65535")
    if metrics.port is not None and not is_loopback_host(metrics.address) and not metrics.token_file:
        raise ConfigError(f"{opt('metrics_address')}: {metrics.address!r} is not loopback, so /metrics needs a "
                          f"bearer token; pass {opt('metrics_token_file')} (Prometheus: authorization: "
                          "credentials_file)")
    if bool(rdzv.tls_cert) != bool(rdzv.tls_key):
        raise ConfigError(f"{opt('tls_cert')}/{opt('tls_key')}: give both the certificate and its key")
    _validate_etcd(rdzv, opt)
    return config


def _validate_local_checkpoint_dir(root: str, opt: Callable[[str], str]) -> None:
    if root in ("", LOCAL_TIER_OFF):
        return
    if not os.path.isabs(root):
        raise ConfigError(f"{opt('local_checkpoint_dir')}: {root!r} is a relative path; give an absolute directory, "
                          f"e.g. {snapshots.LOCAL_ROOT_DEFAULT}, or '{LOCAL_TIER_OFF}' to turn the local tier off")
    if len(root) > bounds.MAX_PATH_CHARS or "\0" in root:
        raise ConfigError(f"{opt('local_checkpoint_dir')}: a path of {len(root)} characters must have at most "
                          f"{bounds.MAX_PATH_CHARS} and no NUL character")


def _validate_etcd(rdzv: RendezvousConfig, opt: Callable[[str], str]) -> None:
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
    if not 0 <= rdzv.coordinator_port <= 65535:
        raise ConfigError(f"{opt('coordinator_port')}: {rdzv.coordinator_port} is out of range 0-65535")
    if not 1 <= rdzv.lease_ttl <= 60:
        raise ConfigError(f"{opt('lease_ttl')}: {rdzv.lease_ttl} seconds is out of range 1-60 (etcd raises a short "
                          "lease to its own minimum, about 2 s with its default election timeout)")


def parse_rendezvous(text: str, option: str = "--rendezvous") -> Endpoint | EtcdTarget:
    return parse_etcd_url(text, option) if is_etcd_url(text) else Endpoint.parse(text, option)


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


MAX_TOKEN_CHARS = 1024  # far below gRPC's metadata limit (16 KiB); `openssl rand -hex 32` writes 64


def read_token(path: str, option: str = "--token-file") -> str:
    """The shared secret: one word of printable ASCII, in a file that only its owner can read."""
    return read_secret(path, option, words=True)


def read_secret(path: str, option: str, *, words: bool) -> str:
    """A secret from a file. Refuses a file that other users can read, an empty one and an oversized one; with
    ``words``, anything but one word of printable ASCII (what travels as gRPC metadata)."""
    try:
        info = os.stat(path)
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{option}: {path!r} is not text; write a printable secret, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{option}: {path!r} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                          f"run: chmod 600 {shlex.quote(path)}")
    if not secret:
        raise ConfigError(f"{option}: {path!r} is empty; put a random secret in it, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}")
    if len(secret) > MAX_TOKEN_CHARS:
        raise ConfigError(f"{option}: {path!r} holds {len(secret)} characters, more than the {MAX_TOKEN_CHARS} a "
                          "token may have (it travels in the metadata of every call); e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}")
    if words and (not (secret.isascii() and secret.isprintable()) or any(c.isspace() for c in secret)):
        raise ConfigError(f"{option}: {path!r} must hold one word of printable ASCII (it travels as gRPC "
                          f"metadata), e.g. openssl rand -hex 32 > {shlex.quote(path)}")
    return secret


# ------------------------------------------------------------------------------------------------- TOML

Completion = Callable[[dict[str, Any]], dict[str, Any]]  # adds values the file left out (daemon/slurm.py)
_BY_KEY = {option.key: option for option in _OPTIONS}


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
        if section not in _SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; expected one of "
                              f"{', '.join('[' + s + ']' for s in _SECTIONS)}")
        if not isinstance(content, dict):
            shape = "an array" if isinstance(content, list) else repr(content)
            raise ConfigError(f"{path}: {section} must be a table ([{section}] with keys under it), not {shape}")
        for key, value in content.items():
            option = _BY_KEY.get(f"{section}.{key}")
            if option is None:
                known = sorted(k.partition(".")[2] for k in _BY_KEY if k.startswith(section + "."))
                raise ConfigError(f"{path}: unknown key {section}.{key}; expected one of {', '.join(known)}")
            values[option.name] = _toml_value(option, value, f"{path}: {option.key}")
    if "max_nodes" not in values and "min_nodes" in values:
        values["max_nodes"] = values["min_nodes"]  # like --nodes N: a fixed size unless a range is given
    if complete is not None:
        values = complete(values)
    for required in ("command", "rendezvous"):
        if required not in values:
            raise ConfigError(f"{path}: {OPTIONS[required].key} is required")
    return validate(from_values(values), where=path)


def _toml_value(option: Option, value: Any, where: str) -> Any:
    if option.name == "command":
        if isinstance(value, str):
            try:
                value = shlex.split(value)
            except ValueError as e:
                raise ConfigError(f"{where}: cannot split {value!r} into words: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: must be a list of strings, e.g. [\"python\", \"train.py\"]")
        return tuple(value)
    if option.name == "rendezvous":
        return parse_rendezvous(_expect(value, str, where), where)
    if option.name == "env":
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{where}: must be a table of strings, e.g. {{ NCCL_DEBUG = \"WARN\" }}")
        return tuple(sorted(value.items()))
    if option.name == "metrics_port" and value == METRICS_OFF:
        return None
    if option.name == "local_checkpoint_dir" and value == LOCAL_TIER_OFF:
        return ""
    if option.name == "stall_timeout":
        return None if value == STALL_AUTO else float(_expect(value, (int, float), where))
    default = default_of(option.name)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} must be true or false")
        return value
    if isinstance(default, float):
        return float(_expect(value, (int, float), where))
    return _expect(value, type(default) if default is not None else int, where)


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(f"{where}: {value!r} must be a {names}")
    return value
