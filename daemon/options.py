"""Every setting of the daemon, once. :data:`OPTIONS` names each setting three ways (the flag, the TOML key and
the name the code uses), with its kind (how text and TOML values become its value, and its bounds), its default,
its help, and the commands that take it. The CLI's parsers, the TOML loader, the validation, the help and SLURM's
completion are all built from it; no other module lists option names.

Defaults that belong to a lower layer are read from there, not repeated: the coordinator's timing from
:class:`~tfelastic.daemon.rendezvous.api.RendezvousSettings`, hang detection's from
:class:`~tfelastic.daemon.worker.stall.StallLimits`.
"""

from __future__ import annotations

import argparse
import shlex
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.url import EtcdTarget, is_etcd_url, parse_etcd_url
from tfelastic.daemon.rendezvous import bounds
from tfelastic.daemon.rendezvous.api import HEARTBEAT_INTERVAL_SECONDS, RendezvousSettings
from tfelastic.daemon.rendezvous.roles import Role, Strategy
from tfelastic.daemon.worker.stall import STALL_AUTO, StallLimits, StallTimeout
from tfelastic.trainer import snapshots

# The commands an option belongs to (Option.commands).
AGENT, COORDINATOR, OPERATOR = "agent", "coordinator", "operator"
OFF = "off"  # --metrics-port off, --local-checkpoint-dir off, --stall-timeout off, --warm-start off


def parse_rendezvous(text: str, option: str = "--rendezvous") -> Endpoint | EtcdTarget:
    return parse_etcd_url(text, option) if is_etcd_url(text) else Endpoint.parse(text, option)


def _expect(value: Any, kind: type | tuple[type, ...], where: str) -> Any:
    """A TOML value of the Python type(s) ``kind`` (a bool is never a number)."""
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ConfigError(f"{where}: {value!r} must be a {names}")
    return value


# ------------------------------------------------------------------------------------------------ kinds


def _flag_parser(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError's message is printed as it is."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_flag


class Kind:
    """How one kind of option reads its value from a flag's text and from TOML, checks its bounds, and shows its
    default in the help. :meth:`flag_type` is what argparse calls on the text: a ValueError reads "invalid float
    value" when it is ``float``; an ArgumentTypeError's message is printed as it is."""

    def flag_type(self) -> Callable[[str], Any]:
        return str

    def from_toml(self, value: Any, where: str) -> Any:
        return _expect(value, str, where)

    def problem(self, value: Any) -> str | None:
        """What is wrong with a value (it starts with the value), or None."""
        return None

    def show(self, value: Any) -> str:
        return str(value)


class Text(Kind):
    pass


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        return None if value in self.choices else f"{value!r} is not one of {', '.join(self.choices)}"


@dataclass(frozen=True)
class Count(Kind):
    """A whole number, at least ``low``; ``high`` bounds it too ("out of range low-high"), with ``unit``."""

    low: int = 0
    high: int | None = None
    unit: str = ""

    def flag_type(self) -> Callable[[str], Any]:
        return int

    def from_toml(self, value: Any, where: str) -> Any:
        return _expect(value, int, where)

    def problem(self, value: Any) -> str | None:
        if self.high is None:
            return None if value >= self.low else f"{value} must be {self.low} or more"
        return None if self.low <= value <= self.high else f"{value}{self.unit} is out of range {self.low}-{self.high}"


PORT = Count(0, 65535)


class PortOrOff(Kind):
    """A port, or 'off' (None): no listener at all."""

    def flag_type(self) -> Callable[[str], Any]:
        return _flag_parser(self._parse)

    @staticmethod
    def _parse(text: str) -> int | None:
        if text == OFF:
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a port number or '{OFF}'") from None

    def from_toml(self, value: Any, where: str) -> Any:
        return None if value == OFF else _expect(value, int, where)

    def problem(self, value: Any) -> str | None:
        return None if value is None else PORT.problem(value)

    def show(self, value: Any) -> str:
        return OFF if value is None else str(value)


@dataclass(frozen=True)
class Seconds(Kind):
    """A duration: 0 or more (more than 0 if ``positive``), and no more than :data:`bounds.MAX_SECONDS`."""

    positive: bool = False

    def flag_type(self) -> Callable[[str], Any]:
        return float

    def from_toml(self, value: Any, where: str) -> Any:
        return float(_expect(value, (int, float), where))

    def problem(self, value: Any) -> str | None:
        if value < 0 or value != value:
            return f"{value} seconds must be 0 or more"
        if self.positive and value == 0:
            return f"{value}s must be more than 0"
        problem = bounds.seconds_problem("", value)  # inf, or a typo's extra digits
        return problem.text if problem is not None else None

    def show(self, value: Any) -> str:
        return f"{value:g}"


class StallTimeoutKind(Kind):
    def flag_type(self) -> Callable[[str], Any]:
        return _flag_parser(StallTimeout.parse)

    def from_toml(self, value: Any, where: str) -> Any:
        if isinstance(value, str) and value in StallTimeout.WORDS:
            return StallTimeout.parse(value)
        return StallTimeout(float(_expect(value, (int, float), where)))

    def problem(self, value: Any) -> str | None:
        return None if value.seconds is None else Seconds().problem(value.seconds)


class Switch(Kind):
    """On by default; its flag (--no-...) turns it off. In TOML: true or false."""

    def from_toml(self, value: Any, where: str) -> Any:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} must be true or false")
        return value


class OnOff(Switch):
    """A flag that takes 'on' or 'off'."""

    def flag_type(self) -> Callable[[str], Any]:
        return _flag_parser(self._parse)

    @staticmethod
    def _parse(text: str) -> bool:
        if text not in ("on", OFF):
            raise ValueError(f"{text!r} is neither 'on' nor '{OFF}'")
        return text == "on"

    def show(self, value: Any) -> str:
        return "on" if value else OFF


class DirOrOff(Kind):
    """An absolute directory, or 'off' (""): the feature is off."""

    def flag_type(self) -> Callable[[str], Any]:
        return self._parse

    @staticmethod
    def _parse(text: str) -> str:
        return "" if text == OFF else text

    def from_toml(self, value: Any, where: str) -> Any:
        return self._parse(_expect(value, str, where))


class Command(Kind):
    def from_toml(self, value: Any, where: str) -> Any:
        if isinstance(value, str):
            try:
                value = shlex.split(value)
            except ValueError as e:
                raise ConfigError(f"{where}: cannot split {value!r} into words: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: must be a list of strings, e.g. [\"python\", \"train.py\"]")
        return tuple(value)


class Environment(Kind):
    def from_toml(self, value: Any, where: str) -> Any:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{where}: must be a table of strings, e.g. {{ NCCL_DEBUG = \"WARN\" }}")
        return tuple(sorted(value.items()))


class NodeRange(Kind):
    """--nodes MIN[:MAX] fills two options; the flag's text is parsed once both are known (parse_nodes)."""

    def from_toml(self, value: Any, where: str) -> Any:
        return _expect(value, int, where)


class Rendezvous(Kind):
    def from_toml(self, value: Any, where: str) -> Any:
        return parse_rendezvous(_expect(value, str, where), where)


# ------------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Option:
    """One setting. ``name`` is unique (the CLI's dest, SLURM's name for it); ``key`` is its TOML ``section.key``
    (the section's field of that name holds it); ``flag`` is "" when only the file sets it. ``note`` follows a
    range error; ``show_default`` is False where the help itself says what the default is."""

    name: str
    key: str
    flag: str
    help: str
    kind: Kind = field(default_factory=Text)
    default: Any = ""
    metavar: str | None = None
    commands: frozenset[str] = frozenset({AGENT})
    note: str = ""
    show_default: bool = True
    default_factory: Callable[[], Any] | None = None

    @property
    def field(self) -> tuple[str, str]:
        section, _, key = self.key.partition(".")
        return section, key

    def default_value(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default

    def problem(self, value: Any) -> str | None:
        problem = self.kind.problem(value)
        return f"{problem} ({self.note})" if problem is not None and self.note else problem

    def help_text(self) -> str:
        default = self.default_value()
        if not self.show_default or default in ("", None, ()) or (isinstance(self.kind, Switch) and \
                not isinstance(self.kind, OnOff)):
            return self.help
        return f"{self.help} (default {self.kind.show(default)})"


_ALL = frozenset({AGENT, COORDINATOR, OPERATOR})
_SERVING = frozenset({AGENT, COORDINATOR})  # what a coordinator needs too
_RDZV = RendezvousSettings()
_STALL = StallLimits()


def _timing(name: str, help: str, default: float, metavar: str = "S") -> Option:
    return Option(name, f"rendezvous.{name}", "--" + name.replace("_", "-"), help, Seconds(), default, metavar,
                  _SERVING)


_OPTIONS: Sequence[Option] = (
    # [job]
    Option("command", "job.command", "", "the trainer command (after --)", Command(), ()),
    Option("job", "job.name", "--job", "job name (default 'default'; under SLURM slurm-JOBID)", Text(), "default",
           commands=_ALL, show_default=False),
    Option("min_nodes", "job.min_nodes", "--nodes", "node count range (default 1; under SLURM the step's task count)",
           NodeRange(), 1, "MIN[:MAX]", show_default=False),
    Option("max_nodes", "job.max_nodes", "--nodes", "(the MAX of --nodes)", NodeRange(), 1),
    Option("strategy", "job.strategy", "--strategy",
           "mirrored (MultiWorkerMirroredStrategy: any failure restarts every worker) or parameter-server "
           "(ParameterServerStrategy: a chief, --ps parameter servers and workers; a failed worker is replaced "
           "alone)", Choice(tuple(s.value for s in Strategy)), Strategy.MIRRORED.value, "mirrored|parameter-server"),
    Option("ps", "job.ps", "--ps", "parameter servers of a parameter-server job", Count(0, 1000), 0, "N"),
    Option("worker_replacements", "job.worker_replacements", "--worker-replacements",
           "a parameter-server job: how often one node's worker may be replaced alone within --restart-window; "
           "its next failure restarts the job", Count(0, 1000), 10, "N"),
    Option("max_restarts", "job.max_restarts", "--max-restarts", "failures allowed per restart window", Count(0), 3,
           "N"),
    Option("restart_window", "job.restart_window", "--restart-window", "restart budget window in seconds", Seconds(),
           3600.0, "S"),
    Option("stall_timeout", "job.stall_timeout", "--stall-timeout",
           "no progress for this long is a hang: 'auto' learns it from the job's step times; 'off' (or 0) disables",
           StallTimeoutKind(), STALL_AUTO, "auto|off|SECONDS"),
    Option("stall_floor", "job.stall_floor", "--stall-floor", "the least a learned stall limit can be", Seconds(),
           _STALL.floor, "SECONDS"),
    Option("stall_allowance", "job.stall_allowance", "--stall-allowance",
           "with a learned stall limit: the time allowed for start-up, restore, the first step, a checkpoint save "
           "and an evaluation", Seconds(), _STALL.allowance, "SECONDS"),
    Option("backup_dir", "job.backup_dir", "--backup-dir",
           "BackupAndRestore directory on shared storage (default ./tfelastic-backup/JOB)", Text(), "", "DIR"),
    Option("workdir", "job.workdir", "--workdir", "trainer working directory (default: cwd)", Text(), "", "DIR"),
    Option("env", "job.env", "", "extra environment of the trainer", Environment(), ()),
    Option("instrument", "job.instrument", "--no-instrument",
           "do not make the trainer's model.fit report progress by itself (hang detection and status then need the "
           "trainer's own reports)", Switch(), True),
    # [node]
    Option("node_id", "node.id", "--node-id", "unique node id (default: hostname; under SLURM its node name)", Text(),
           metavar="ID", commands=_SERVING, show_default=False, default_factory=socket.gethostname),
    Option("worker_port", "node.worker_port", "--worker-port",
           "trainer port (0: a free port, new for every generation)", PORT, 0, "PORT", note="0 picks a free port",
           show_default=False),
    Option("advertise_address", "node.advertise_address", "--advertise-address",
           "address peers reach this node's trainer at (default: the route to the rendezvous)", Text(), "", "ADDR"),
    Option("role", "node.role", "--role",
           "a parameter-server job: the task this node may take (chief, ps, worker, or any)",
           Choice(tuple(r.value for r in Role)), Role.ANY.value, "any|chief|ps|worker"),
    Option("stop_grace", "node.stop_grace", "--stop-grace", "SIGTERM to SIGKILL grace period", Seconds(), 10.0, "S"),
    Option("failure_stop_grace", "node.failure_stop_grace", "--failure-stop-grace",
           "SIGTERM to SIGKILL grace after a failure", Seconds(), 0.25, "S"),
    Option("log_level", "node.log_level", "--log-level", "debug, info, warning or error",
           Choice(("debug", "info", "warning", "error")), "info", commands=_SERVING),
    Option("check_min_free_mb", "node.check_min_free_mb", "--check-min-free-mb",
           "the node check fails with less free space than this in the backup dir", Count(0), 1024, "MB"),
    Option("warm_start", "node.warm_start", "--warm-start",
           "launch Python trainer commands through a standby interpreter that has imported TensorFlow "
           "(other commands start cold)", OnOff(), True, "on|off"),
    Option("local_checkpoint_dir", "node.local_checkpoint_dir", "--local-checkpoint-dir",
           "root of the node-local snapshot tier, in memory (an absolute path; 'off' turns the tier off)",
           DirOrOff(), snapshots.LOCAL_ROOT_DEFAULT, "DIR|off"),
    # [rendezvous]
    Option("rendezvous", "rendezvous.endpoint", "--rendezvous",
           "the coordinator's endpoint, or the job's etcd: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS) "
           "(required; under SLURM the step's first host)", Rendezvous(), None, "HOST:PORT|etcd://...", _ALL),
    Option("token_file", "rendezvous.token_file", "--token-file",
           "file holding the shared secret (mode 600); required for non-loopback addresses", Text(), "", "PATH",
           _ALL),
    Option("tls_cert", "rendezvous.tls_cert", "--tls-cert", "certificate chain of this process (TLS)", Text(), "",
           "PEM", _ALL),
    Option("tls_key", "rendezvous.tls_key", "--tls-key", "private key of --tls-cert", Text(), "", "PEM", _ALL),
    Option("tls_ca", "rendezvous.tls_ca", "--tls-ca",
           "CA bundle of the peers; on a server it makes client certificates required (mTLS)", Text(), "", "PEM",
           _ALL),
    _timing("last_call", "after min nodes joined, wait this long for more", _RDZV.last_call_seconds),
    _timing("settle", "after a node joins a running job below max, wait this long", _RDZV.settle_seconds),
    _timing("join_timeout", "how long to wait below min nodes (or for an unreachable coordinator) before failing",
            _RDZV.join_timeout_seconds),
    Option("heartbeat_interval", "rendezvous.heartbeat_interval", "--heartbeat-interval", "heartbeat period",
           Seconds(positive=True), HEARTBEAT_INTERVAL_SECONDS, "S", _SERVING),
    _timing("node_timeout", "silence after which a node is lost", _RDZV.node_timeout_seconds),
    _timing("restart_backoff", "wait before the generation after a second failed one in a row, doubling each time; "
            "0 never waits", _RDZV.restart_backoff_seconds),
    _timing("restart_backoff_max", "the longest wait between failed generations", _RDZV.restart_backoff_max_seconds),
    Option("quarantine_after", "rendezvous.quarantine_after", "--quarantine-after",
           "set a node aside after its worker failed first this often within --quarantine-window; 0 never does",
           Count(0, 1000), _RDZV.quarantine_after, "N", _SERVING, note="0 never quarantines a node"),
    _timing("quarantine_window", "the window of --quarantine-after", _RDZV.quarantine_window_seconds),
    _timing("quarantine_cooldown", "how long a node stays quarantined the first time; each next time twice as long",
            _RDZV.quarantine_cooldown_seconds),
    _timing("quarantine_cooldown_max", "the longest quarantine", _RDZV.quarantine_cooldown_max_seconds),
    Option("node_probe", "rendezvous.node_probe", "--no-node-probe",
           "the coordinator does not try to reach a node's trainer port in its node check (a coordinator outside "
           "the nodes' trainer network)", Switch(), _RDZV.probe_nodes, commands=_SERVING),
    Option("coordinator_port", "rendezvous.coordinator_port", "--coordinator-port",
           "with etcd: the port this agent serves the job on when it is elected coordinator (0: a free port)",
           PORT, 0, "PORT", show_default=False),
    Option("lease_ttl", "rendezvous.lease_ttl", "--lease-ttl",
           "with etcd: the coordinator's lease in seconds; a dead coordinator is replaced about this long after",
           Count(1, 60, " seconds"), 2, "S", _SERVING,
           note="etcd raises a short lease to its own minimum, about 2 s with its default election timeout"),
    Option("etcd_ca", "rendezvous.etcd_ca", "--etcd-ca", "with etcds://: the CA bundle of etcd's certificates",
           Text(), "", "PEM", _ALL),
    Option("etcd_cert", "rendezvous.etcd_cert", "--etcd-cert", "with etcds://: this node's client certificate",
           Text(), "", "PEM", _ALL),
    Option("etcd_key", "rendezvous.etcd_key", "--etcd-key", "with etcds://: the key of --etcd-cert", Text(), "",
           "PEM", _ALL),
    Option("etcd_password_file", "rendezvous.etcd_password_file", "--etcd-password-file",
           "with etcd authentication: a file holding USER:PASSWORD (mode 600)", Text(), "", "PATH", _ALL),
    # [metrics]
    Option("metrics_port", "metrics.port", "--metrics-port",
           "serve Prometheus /metrics; 0 picks a free port, 'off' disables", PortOrOff(), 9464, "PORT", _SERVING),
    Option("metrics_address", "metrics.address", "--metrics-address",
           "address of /metrics (any other than loopback needs --metrics-token-file)", Text(), "127.0.0.1", "ADDR",
           _SERVING),
    Option("metrics_token_file", "metrics.token_file", "--metrics-token-file",
           "bearer token that scrapes of /metrics must present (mode 600)", Text(), "", "PATH", _SERVING),
    Option("metrics_linger", "metrics.linger", "--metrics-linger",
           "keep /metrics up this long after the job's verdict (any on the coordinator's node, a failure "
           "elsewhere) so that Prometheus records it", Seconds(), 30.0, "S",
           _SERVING),
)
OPTIONS = {option.name: option for option in _OPTIONS}
BY_KEY = {option.key: option for option in _OPTIONS}


def default_of(name: str) -> Any:
    """The built-in default of an option (the node id's is this host's name)."""
    return OPTIONS[name].default_value()


def options_of(command: str) -> tuple[str, ...]:
    """Every option ``command`` takes, from a flag, the environment or the job file, in the table's order."""
    return tuple(option.name for option in _OPTIONS if command in option.commands)


def flags_of(command: str) -> tuple[str, ...]:
    """The options ``command`` takes as flags, in the table's order; an option that shares its flag with the one
    before it (max_nodes, the MAX of --nodes) has none of its own."""
    names: list[str] = []
    flags: set[str] = set()
    for option in _OPTIONS:
        if command in option.commands and option.flag and option.flag not in flags:
            names.append(option.name)
            flags.add(option.flag)
    return tuple(names)
