"""The `tfelastic` command: it parses, and nothing else. The flags come from the option table
(:mod:`tfelastic.daemon.options`), the other sources of a setting are in :mod:`tfelastic.daemon.sources`, and each
subcommand's work is in :mod:`tfelastic.daemon.commands`. A bad value exits with code 78 (EX_CONFIG) and a
message that names the option and the fix, before anything starts; a malformed command line (an unknown flag or
subcommand, a missing argument) exits 2, as every command-line tool does."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NoReturn

from tfelastic.daemon import commands
from tfelastic.daemon.cli_help import epilog
from tfelastic.daemon.completion import SHELLS, script
from tfelastic.daemon.config import (
    AgentConfig,
    CoordinatorConfig,
    OperatorConfig,
    coordinator_from_values,
    from_values,
    operator_from_values,
    parse_nodes,
    validate,
    validate_coordinator,
    validate_operator,
)
from tfelastic.daemon.config_file import load_toml
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.options import (
    AGENT,
    COORDINATOR,
    OPERATOR,
    OPTIONS,
    Choice,
    OnOff,
    Switch,
    flags_of,
    options_of,
    parse_rendezvous,
)
from tfelastic.daemon.secret_file import read_token
from tfelastic.daemon.slurm import SlurmStep
from tfelastic.daemon.sources import LISTEN_ENV, env_name, environment_values, gather
from tfelastic.daemon.version import describe

_UNSET: Any = object()  # the default of every option flag: not given (the configuration's default applies)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A value a flag's parser refused is a bad setting (78); anything else is a malformed command line."""
        self.print_usage(sys.stderr)
        flag_value = message.startswith("argument --") and not any(
            usage in message for usage in ("expected one argument", "expected at most", "not allowed with"))
        self.exit(ExitCode.CONFIG if flag_value else ExitCode.USAGE, f"tfelastic: error: {message}\n")


def _add_options(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    for name in names:
        option = OPTIONS[name]
        dest, kind = "nodes" if name == "min_nodes" else name, option.kind
        if isinstance(kind, Switch) and not isinstance(kind, OnOff):  # --no-...
            parser.add_argument(option.flag, dest=dest, action="store_const", const=False, default=_UNSET,
                                help=option.help_text())
        elif isinstance(kind, Choice):
            parser.add_argument(option.flag, dest=dest, default=_UNSET, help=option.help_text(), choices=kind.choices)
        else:
            parser.add_argument(option.flag, dest=dest, default=_UNSET, help=option.help_text(),
                                metavar=option.metavar, type=str if name == "min_nodes" else kind.flag_type())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tfelastic", description="Fault-tolerant, elastic TensorFlow training daemon.")
    parser.add_argument("--version", action="version", version=describe())
    sub = parser.add_subparsers(dest="command_name", required=True, parser_class=_Parser)
    add = partial(_add_command, sub)

    agent = add("agent", help="run the node daemon from a TOML job file")
    agent.add_argument("--config", required=True, metavar="JOB.toml", help="the job file (docs/configuration.md)")
    _add_no_slurm(agent)

    run = add("run", help="run the node daemon from flags (like torchrun)")
    _add_config(run)
    _add_options(run, flags_of(AGENT))
    _add_no_slurm(run)
    run.add_argument("trainer", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")

    coord = add("coordinator", help="run a standalone coordinator (e.g. on a head node)")
    coord.add_argument("--listen", metavar="HOST:PORT", help="where it serves the job (default: $TFELASTIC_LISTEN, "
                       "else the job file's rendezvous endpoint; required with an etcd rendezvous)")
    _add_config(coord)
    _add_options(coord, flags_of(COORDINATOR))

    status = add("status", help="show the cluster as the coordinator sees it")
    _add_operator_connection(status)
    status.add_argument("--json", action="store_true", help="print the documented JSON document")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="S",
                        help="refresh every S seconds (default 2)")

    drain = add("drain", help="remove a node on purpose: its trainer checkpoints, the job re-forms "
                                         "without it (not counted as a failure)")
    drain.add_argument("node", metavar="NODE", help="the node id to drain (see tfelastic status)")
    drain.add_argument("--reason", default="", help="recorded in the coordinator's log and the restart reason")
    drain.add_argument("--force", action="store_true", help="drain even if fewer than min nodes would remain")
    _add_operator_connection(drain)

    readmit = add("readmit", help="lift a node's quarantine: it checks itself and, if the check "
                                             "passes, joins again")
    readmit.add_argument("node", metavar="NODE", help="the quarantined node's id (see tfelastic status)")
    _add_operator_connection(readmit)

    report = add("report", help="where the job's time went: a line per generation, then the goodput "
                                           "and its badput by category (also after a job on etcd ended)")
    _add_operator_connection(report)
    report.add_argument("--json", action="store_true", help="print one JSON object")
    report.add_argument("--html", metavar="FILE", help="write the timeline as one self-contained HTML page to FILE "
                                                       "(- for standard output)")
    report.add_argument("--tensorboard", metavar="DIR", help="write the ledger as TensorBoard scalars into DIR "
                                                             "(needs the tensorboard package, not TensorFlow)")

    restart = add("restart", help="restart the job: every trainer checkpoints and stops, and the same "
                                             "nodes re-form (not counted as a failure)")
    restart.add_argument("--reason", default="", help="recorded in the coordinator's log and the restart reason")
    _add_operator_connection(restart)

    demo = add("demo", help="train on 2 local agents, kill a worker, show the recovery")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--nodes", type=int, default=2, choices=(2, 3))
    demo.add_argument("--faults", type=int, default=1, choices=range(1, 4), metavar="N",
                      help="how many workers to kill (default 1)")
    demo.add_argument("--workdir", default="", help="keep the demo's files here (default: a temp dir)")

    install = add("install", help="install the systemd units, the tfelastic user and /etc/tfelastic/JOB.toml "
                                  "from this installation (run as root)")
    install.add_argument("job", metavar="JOB", help="the job's name: its file is /etc/tfelastic/JOB.toml")
    install.add_argument("--prefix", default="", metavar="DIR", help="the environment the units run tfelastic "
                         "from (default: this one)")
    install.add_argument("--destdir", default="", metavar="DIR", help="install under DIR instead of / (packaging); "
                         "creates no user")
    install.add_argument("--uid", type=int, default=None, help="the tfelastic user's uid and gid: the same on "
                         "every node (files on shared storage carry numbers)")
    install.add_argument("--no-user", dest="make_user", action="store_false", help="do not create the user")

    completion = add("completion", help="print a shell completion script")
    completion.add_argument("shell", choices=SHELLS)
    return parser


def _add_command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, epilog=epilog(name),
                                                     formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    return parser


def _add_no_slurm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-slurm", action="store_true",
                   help="ignore SLURM's environment (also TFELASTIC_NO_SLURM=1); see docs/configuration.md#slurm")


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="JOB.toml", default=None,
                   help="read the settings this command has from the job file (flags and TFELASTIC_* variables "
                        "win; also $TFELASTIC_CONFIG)")


def _add_operator_connection(p: argparse.ArgumentParser) -> None:
    _add_config(p)
    p.add_argument("--rendezvous", metavar="HOST:PORT|etcd://...", default=_UNSET,
                   help="the coordinator's endpoint, or the job's etcd (then --job names the job); or from --config "
                        "or $TFELASTIC_RENDEZVOUS")
    _add_options(p, [name for name in flags_of(OPERATOR) if name != "rendezvous"])


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options the command line gave, by name, parsed."""
    values = {name: getattr(args, name) for name in names if getattr(args, name, _UNSET) is not _UNSET}
    if getattr(args, "nodes", _UNSET) is not _UNSET:
        values["min_nodes"], values["max_nodes"] = parse_nodes(args.nodes)
    if isinstance(values.get("rendezvous"), str):
        values["rendezvous"] = parse_rendezvous(values["rendezvous"], "--rendezvous")
    return values


def config_from_run_args(args: argparse.Namespace, slurm: SlurmStep | None = None,
                         environ: Mapping[str, str] = os.environ) -> AgentConfig:
    command = list(args.trainer)
    if command and command[0] == "--":
        command = command[1:]
    flags = _given(args, flags_of(AGENT))
    if command:
        flags["command"] = tuple(command)
    values, sources = gather(flags, options_of(AGENT), environ, args.config)
    if slurm is not None:
        values = slurm.complete(values)  # flags win; SLURM fills the rest; the configuration's defaults after that
    if "rendezvous" not in values:
        raise ConfigError("--rendezvous: required outside a SLURM job step; give HOST:PORT, e.g. head-node:29400 "
                          "(or in --config, or $TFELASTIC_RENDEZVOUS)")
    values.setdefault("command", ())
    return validate(from_values(values), sources=sources)


def config_from_coordinator_args(args: argparse.Namespace,
                                 environ: Mapping[str, str] = os.environ) -> CoordinatorConfig:
    """``--rendezvous etcd://...`` makes the coordinator a head-node candidate of that job; without it, the job's
    one coordinator on ``--listen`` (by default the job file's rendezvous endpoint)."""
    given, sources = gather(_given(args, flags_of(COORDINATOR)), options_of(COORDINATOR), environ, args.config)
    endpoint = given.get("rendezvous")
    listen_text, listen_source = (args.listen, "--listen") if args.listen else (environ.get(LISTEN_ENV), LISTEN_ENV)
    if not listen_text and not isinstance(endpoint, Endpoint):
        raise ConfigError("--listen: required" + (" with an etcd rendezvous: where this candidate serves the job "
                                                   f"(or ${LISTEN_ENV})" if endpoint is not None
                                                   else "; give HOST:PORT, e.g. 0.0.0.0:29400"))
    listen = Endpoint.parse(listen_text, listen_source, allow_port_zero=True) if listen_text else endpoint
    assert isinstance(listen, Endpoint)
    if not isinstance(given.setdefault("rendezvous", listen), EtcdTarget) and given["rendezvous"] != listen:
        source = sources.get("rendezvous", "--rendezvous")
        raise ConfigError(f"{source} is {given['rendezvous']}, but {listen_source} is {listen}: a standalone "
                          "coordinator serves where the agents look for it; give both the same address (or leave "
                          f"{listen_source} out), or an etcd URL (etcd://HOST:PORT,...) to run a candidate")
    return validate_coordinator(coordinator_from_values(given, listen), sources)


def _operator_config(args: argparse.Namespace,
                     environ: Mapping[str, str] = os.environ) -> tuple[OperatorConfig, str | None]:
    values, sources = gather(_given(args, flags_of(OPERATOR)), options_of(OPERATOR), environ, args.config)
    if "rendezvous" not in values:
        raise ConfigError("--rendezvous: required; give the coordinator's HOST:PORT or the job's etcd://..., or "
                          "--config JOB.toml, or $TFELASTIC_RENDEZVOUS")
    config = validate_operator(operator_from_values(values), sources)
    return config, read_token(config.rendezvous.token_file) if config.rendezvous.token_file else None


def _operator_target(args: argparse.Namespace) -> tuple[Endpoint, str | None, TlsConfig]:
    """The coordinator to ask, its token and TLS; with an etcd rendezvous, the one etcd says leads the job."""
    config, token = _operator_config(args)
    rdzv = config.rendezvous
    endpoint = rdzv.endpoint if isinstance(rdzv.endpoint, Endpoint) else commands.find_coordinator(config)
    return endpoint, token, rdzv.tls


def config_from_file(path: str, slurm: SlurmStep | None = None,
                     environ: Mapping[str, str] = os.environ) -> AgentConfig:
    """``tfelastic agent --config JOB.toml``: the file, with TFELASTIC_* variables over it."""
    environment = environment_values(environ, options_of(AGENT))
    return load_toml(path, lambda values: _completed({**values, **environment}, slurm),
                     sources={name: env_name(name) for name in environment})


def _completed(values: dict[str, Any], slurm: SlurmStep | None) -> dict[str, Any]:
    return slurm.complete(values) if slurm is not None else values


def _dispatch(args: argparse.Namespace, slurm: SlurmStep | None) -> int:
    name = args.command_name
    if name == "agent":
        return commands.run_agent(config_from_file(args.config, slurm), slurm)
    if name == "run":
        return commands.run_agent(config_from_run_args(args, slurm), slurm)
    if name == "coordinator":
        return commands.run_coordinator(config_from_coordinator_args(args))
    if name == "demo":
        from tfelastic.daemon.demo import run_demo

        return run_demo(nodes=args.nodes, faults=args.faults, as_json=args.json, workdir=args.workdir)
    if name == "install":
        from tfelastic.daemon.install import run_install

        return run_install(args.job, prefix=args.prefix, destdir=args.destdir, uid=args.uid, make_user=args.make_user)
    if name == "completion":
        print(script(build_parser(), args.shell), end="")
        return ExitCode.SUCCEEDED
    if name == "report":
        from tfelastic.daemon.report import run_report

        if args.html == "-" and args.json:
            raise ConfigError("--html - and --json both print to standard output: give --html a FILE")
        return run_report(*_operator_config(args), as_json=args.json, html=args.html, tensorboard=args.tensorboard)
    if name == "status":
        if args.watch is not None and not args.watch > 0:
            raise ConfigError(f"--watch: {args.watch} seconds must be more than 0")
        return commands.run_status(*_operator_config(args), as_json=args.json, watch=args.watch)
    endpoint, token, tls = _operator_target(args)
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
    try:
        return _dispatch(args, slurm)
    except ConfigError as e:
        _json_error(args, f"configuration error: {e}")
        print(f"tfelastic: configuration error: {e}", file=sys.stderr)
        return ExitCode.CONFIG
    except commands.OperatorError as e:
        _json_error(args, str(e))
        print(f"tfelastic {args.command_name}: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


def _json_error(args: argparse.Namespace, error: str) -> None:
    """``status --json`` and ``report --json`` print a JSON object in every case: a script reads stdout."""
    if args.command_name in ("status", "report") and getattr(args, "json", False):
        print(json.dumps({"error": error}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
