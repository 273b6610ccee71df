"""The `tfelastic` command: it parses, and nothing else. The flags come from the option table of
:mod:`tfelastic.daemon.config`; each subcommand's work is in :mod:`tfelastic.daemon.commands`. A bad value exits
with code 78 (EX_CONFIG) and a message that names the option and the fix, before anything starts."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from tfelastic.daemon import commands
from tfelastic.daemon.config import (
    LOCAL_TIER_OFF,
    METRICS_OFF,
    OPTIONS,
    STALL_AUTO,
    AgentConfig,
    default_of,
    from_values,
    load_toml,
    parse_nodes,
    parse_rendezvous,
    read_token,
    validate,
)
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.slurm import SlurmStep

_UNSET: Any = object()  # the default of every option flag: not given (the configuration's default applies)
_SECURITY = ("token_file", "tls_cert", "tls_key", "tls_ca")
_TIMING = ("last_call", "settle", "join_timeout", "heartbeat_interval", "node_timeout", "restart_backoff",
           "restart_backoff_max", "quarantine_after", "quarantine_window", "quarantine_cooldown",
           "quarantine_cooldown_max", "node_probe")
_METRICS = ("metrics_port", "metrics_address", "metrics_token_file", "metrics_linger")
_RUN = tuple(name for name, option in OPTIONS.items() if option.flag and name != "max_nodes")
_ETCD = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file")
_COORDINATOR = ("rendezvous", "job", "node_id", "lease_ttl", "log_level", *_SECURITY, *_ETCD, *_TIMING, *_METRICS)
_OPERATOR = ("job", *_SECURITY, *_ETCD)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(ExitCode.CONFIG, f"tfelastic: error: {message}\n")


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'on' nor 'off'")
    return text == "on"


def _stall_timeout(text: str) -> float | None:
    if text == STALL_AUTO:
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a number of seconds") from None


def _metrics_port(text: str) -> int | None:
    if text == METRICS_OFF:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number or 'off'") from None


def _local_checkpoint_dir(text: str) -> str:
    return "" if text == LOCAL_TIER_OFF else text  # the configuration checks the path


# Options whose help says what their default is (it depends on other values, or is explained there).
_DEFAULT_IN_HELP = frozenset({"job", "min_nodes", "node_id", "worker_port", "rendezvous", "backup_dir", "workdir"})


def _help(name: str) -> str:
    option, default = OPTIONS[name], default_of(name)
    if name == "stall_timeout":
        return f"{option.help} (default {STALL_AUTO})"
    if name in _DEFAULT_IN_HELP or default in ("", None) or isinstance(default, bool):
        return option.help
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{option.help} (default {shown})"


def _flag_type(name: str) -> Any:
    """How argparse reads the flag's value (--nodes and --rendezvous are parsed with their own rules later)."""
    default = default_of(name)
    if name == "metrics_port":
        return _metrics_port
    if name == "stall_timeout":
        return _stall_timeout
    if name == "warm_start":
        return _on_off
    if name == "local_checkpoint_dir":
        return _local_checkpoint_dir
    if isinstance(default, float):
        return float
    if isinstance(default, int) and not isinstance(default, bool) and name != "min_nodes":
        return int
    return str


def _add_options(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    for name in names:
        flag, dest = OPTIONS[name].flag, "nodes" if name == "min_nodes" else name
        if name in ("instrument", "node_probe"):
            parser.add_argument(flag, dest=dest, action="store_const", const=False, default=_UNSET, help=_help(name))
        elif name == "log_level":
            parser.add_argument(flag, dest=dest, default=_UNSET, help=_help(name),
                                choices=("debug", "info", "warning", "error"))
        else:
            parser.add_argument(flag, dest=dest, default=_UNSET, help=_help(name), metavar=OPTIONS[name].metavar,
                                type=_flag_type(name))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tfelastic", description="Fault-tolerant, elastic TensorFlow training daemon.")
    sub = parser.add_subparsers(dest="command_name", required=True, parser_class=_Parser)

    agent = sub.add_parser("agent", help="run the node daemon from a TOML job file")
    agent.add_argument("--config", required=True, metavar="JOB.toml")
    _add_no_slurm(agent)

    run = sub.add_parser("run", help="run the node daemon from flags (like torchrun)")
    _add_options(run, _RUN)
    _add_no_slurm(run)
    run.add_argument("trainer", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")

    coord = sub.add_parser("coordinator", help="run a standalone coordinator (e.g. on a head node)")
    coord.add_argument("--listen", required=True, metavar="HOST:PORT")
    _add_options(coord, _COORDINATOR)

    status = sub.add_parser("status", help="show the cluster as the coordinator sees it")
    _add_operator_connection(status)
    status.add_argument("--json", action="store_true", help="print the documented JSON document")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="S",
                        help="refresh every S seconds (default 2)")

    drain = sub.add_parser("drain", help="remove a node on purpose: its trainer checkpoints, the job re-forms "
                                         "without it (not counted as a failure)")
    drain.add_argument("node", metavar="NODE", help="the node id to drain (see tfelastic status)")
    drain.add_argument("--reason", default="", help="recorded in the coordinator's log and the restart reason")
    drain.add_argument("--force", action="store_true", help="drain even if fewer than min nodes would remain")
    _add_operator_connection(drain)

    readmit = sub.add_parser("readmit", help="lift a node's quarantine: it checks itself and, if the check "
                                             "passes, joins again")
    readmit.add_argument("node", metavar="NODE", help="the quarantined node's id (see tfelastic status)")
    _add_operator_connection(readmit)

    restart = sub.add_parser("restart", help="restart the job: every trainer checkpoints and stops, and the same "
                                             "nodes re-form (not counted as a failure)")
    restart.add_argument("--reason", default="", help="recorded in the coordinator's log and the restart reason")
    _add_operator_connection(restart)

    demo = sub.add_parser("demo", help="train on 2 local agents, kill a worker, show the recovery")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--nodes", type=int, default=2, choices=(2, 3))
    demo.add_argument("--faults", type=int, default=1, choices=range(1, 4), metavar="N",
                      help="how many workers to kill (default 1)")
    demo.add_argument("--workdir", default="", help="keep the demo's files here (default: a temp dir)")
    return parser


def _add_no_slurm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-slurm", action="store_true",
                   help="ignore SLURM's environment (also TFELASTIC_NO_SLURM=1); see docs/configuration.md#slurm")


def _add_operator_connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rendezvous", required=True, metavar="HOST:PORT|etcd://...",
                   help="the coordinator's endpoint, or the job's etcd (then --job names the job)")
    _add_options(p, _OPERATOR)


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options the command line gave, by name, parsed."""
    values = {name: getattr(args, name) for name in names if getattr(args, name, _UNSET) is not _UNSET}
    if getattr(args, "nodes", _UNSET) is not _UNSET:
        values["min_nodes"], values["max_nodes"] = parse_nodes(args.nodes)
    if isinstance(values.get("rendezvous"), str):
        values["rendezvous"] = parse_rendezvous(values["rendezvous"], "--rendezvous")
    return values


def config_from_run_args(args: argparse.Namespace, slurm: SlurmStep | None = None) -> AgentConfig:
    command = list(args.trainer)
    if command and command[0] == "--":
        command = command[1:]
    values = {**_given(args, _RUN), "command": tuple(command)}
    if slurm is not None:
        values = slurm.complete(values)  # flags win; SLURM fills the rest; the configuration's defaults after that
    if "rendezvous" not in values:
        raise ConfigError("--rendezvous: required outside a SLURM job step; give HOST:PORT, e.g. head-node:29400")
    return validate(from_values(values))


def config_from_coordinator_args(args: argparse.Namespace) -> tuple[AgentConfig, Endpoint]:
    """The coordinator's configuration, and where it listens. ``--rendezvous etcd://...`` makes it a head-node
    candidate of that job; without it, the job's one coordinator on ``--listen``."""
    listen = Endpoint.parse(args.listen, "--listen", allow_port_zero=True)
    given = _given(args, _COORDINATOR)
    if not isinstance(given.setdefault("rendezvous", listen), EtcdTarget) and given["rendezvous"] != listen:
        raise ConfigError("--rendezvous: a standalone coordinator takes only an etcd URL there (etcd://HOST:PORT,...); "
                          "it listens on --listen")
    return validate(from_values({**given, "command": ("coordinator",)})), listen


def _operator_target(args: argparse.Namespace) -> tuple[Endpoint, str | None, TlsConfig]:
    """The coordinator to ask, its token and TLS; with an etcd rendezvous, the one etcd says leads the job."""
    values = {**_given(args, _OPERATOR), "command": ("operator",),
              "rendezvous": parse_rendezvous(args.rendezvous, "--rendezvous")}
    config = validate(from_values(values))
    rdzv = config.rendezvous
    token = read_token(rdzv.token_file) if rdzv.token_file else None
    endpoint = rdzv.endpoint if isinstance(rdzv.endpoint, Endpoint) else commands.find_coordinator(config)
    return endpoint, token, rdzv.tls


def _dispatch(args: argparse.Namespace, slurm: SlurmStep | None) -> int:
    name = args.command_name
    if name == "agent":
        return commands.run_agent(load_toml(args.config, slurm.complete if slurm else None), slurm)
    if name == "run":
        return commands.run_agent(config_from_run_args(args, slurm), slurm)
    if name == "coordinator":
        return commands.run_coordinator(*config_from_coordinator_args(args))
    if name == "demo":
        from tfelastic.daemon.demo import run_demo

        return run_demo(nodes=args.nodes, faults=args.faults, as_json=args.json, workdir=args.workdir)
    endpoint, token, tls = _operator_target(args)
    if name == "status":
        if args.watch is not None and not args.watch > 0:
            raise ConfigError(f"--watch: {args.watch} seconds must be more than 0")
        return commands.run_status(endpoint, token, tls, as_json=args.json, watch=args.watch)
    from tfelastic.daemon.rendezvous.client import drain_node, readmit_node, restart_job

    if name == "drain":
        return commands.run_operator(name, endpoint, tls, lambda: drain_node(endpoint, token, tls, args.node,
                                                                             args.reason, args.force))
    if name == "readmit":
        return commands.run_operator(name, endpoint, tls, lambda: readmit_node(endpoint, token, tls, args.node))
    return commands.run_operator(name, endpoint, tls, lambda: restart_job(endpoint, token, tls, args.reason))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    slurm = SlurmStep.detect(os.environ, off=getattr(args, "no_slurm", False))
    if args.command_name == "run" and args.rendezvous is _UNSET and slurm is None:
        parser.error("the following arguments are required: --rendezvous (outside a SLURM job step)")
    try:
        return _dispatch(args, slurm)
    except ConfigError as e:
        print(f"tfelastic: configuration error: {e}", file=sys.stderr)
        return ExitCode.CONFIG
    except commands.OperatorError as e:
        print(f"tfelastic {args.command_name}: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
