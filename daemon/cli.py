"""The `tfelastic` command. Every subcommand checks its whole configuration before it starts anything; a bad
value exits with code 78 (EX_CONFIG) and a message that names the option and the fix."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc
from tfelastic.daemon.config import (
    EX_CONFIG,
    METRICS_OFF,
    AgentConfig,
    ConfigError,
    Endpoint,
    TlsConfig,
    load_toml,
    parse_nodes,
    read_token,
    validate,
)
from tfelastic.daemon.netutil import host_port, is_local_address, port_taken
from tfelastic.daemon.rendezvous.api import JobState
from tfelastic.daemon.sdnotify import Notifier, journal_handler, run_notifying
from tfelastic.daemon.slurm import SlurmStep

DEFAULT = AgentConfig(command=("true",), rendezvous=Endpoint("localhost", 29400))
_UNSET: Any = object()  # the default of the flags that SLURM may fill: not given (daemon/slurm.py)
_SLURM_FILLS = ("nodes", "rendezvous", "job", "node_id", "token_file", "metrics_port")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_CONFIG, f"tfelastic: error: {message}\n")


def _add_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default="", metavar="PATH",
                   help="file holding the shared secret (mode 600); required for non-loopback addresses")
    p.add_argument("--tls-cert", default="", metavar="PEM", help="certificate chain of this process (TLS)")
    p.add_argument("--tls-key", default="", metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-ca", default="", metavar="PEM",
                   help="CA bundle of the peers; on a server it makes client certificates required (mTLS)")


def _add_operator_connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rendezvous", required=True, metavar="HOST:PORT", help="the coordinator's endpoint")
    _add_security(p)


def _metrics_port(text: str) -> int | None:
    if text == METRICS_OFF:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number or 'off'") from None


def _add_metrics(p: argparse.ArgumentParser) -> None:
    d = DEFAULT
    p.add_argument("--metrics-port", type=_metrics_port, default=d.metrics_port, metavar="PORT",
                   help=f"serve Prometheus /metrics; 0 picks a free port, 'off' disables (default {d.metrics_port})")
    p.add_argument("--metrics-address", default=d.metrics_address, metavar="ADDR",
                   help=f"address of /metrics (default {d.metrics_address}; any other needs --metrics-token-file)")
    p.add_argument("--metrics-token-file", default="", metavar="PATH",
                   help="bearer token that scrapes of /metrics must present (mode 600)")
    p.add_argument("--metrics-linger", type=float, default=d.metrics_linger, metavar="S",
                   help="after the job failed, keep /metrics up this long so Prometheus records it "
                        f"(default {d.metrics_linger:g})")


def _add_timing(p: argparse.ArgumentParser) -> None:
    d = DEFAULT
    p.add_argument("--last-call", type=float, default=d.last_call, metavar="S",
                   help=f"after min nodes joined, wait this long for more (default {d.last_call:g})")
    p.add_argument("--settle", type=float, default=d.settle, metavar="S",
                   help=f"after a node joins a running job below max, wait this long (default {d.settle:g})")
    p.add_argument("--join-timeout", type=float, default=d.join_timeout, metavar="S",
                   help=f"how long to wait below min nodes before failing (default {d.join_timeout:g})")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval, metavar="S",
                   help=f"heartbeat period (default {d.heartbeat_interval:g})")
    p.add_argument("--node-timeout", type=float, default=d.node_timeout, metavar="S",
                   help=f"silence after which a node is lost (default {d.node_timeout:g})")


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULT
    parser = _Parser(prog="tfelastic", description="Fault-tolerant, elastic TensorFlow training daemon.")
    sub = parser.add_subparsers(dest="command_name", required=True, parser_class=_Parser)

    agent = sub.add_parser("agent", help="run the node daemon from a TOML job file")
    agent.add_argument("--config", required=True, metavar="JOB.toml")
    _add_no_slurm(agent)

    run = sub.add_parser("run", help="run the node daemon from flags (like torchrun)")
    run.add_argument("--nodes", metavar="MIN[:MAX]",
                     help="node count range (default 1; under SLURM the step's task count)")
    run.add_argument("--rendezvous", metavar="HOST:PORT",
                     help="the coordinator's endpoint (required; under SLURM the step's first host)")
    run.add_argument("--job", help=f"job name (default {d.job!r}; under SLURM slurm-JOBID)")
    run.add_argument("--node-id", metavar="ID", help="unique node id (default: hostname; under SLURM its node name)")
    run.add_argument("--worker-port", type=int, default=0, metavar="PORT",
                     help="trainer port (default 0: a free port, new for every generation)")
    run.add_argument("--advertise-address", default="", metavar="ADDR",
                     help="address peers reach this node's trainer at (default: the route to the rendezvous)")
    run.add_argument("--backup-dir", default="", metavar="DIR",
                     help="BackupAndRestore directory on shared storage (default ./tfelastic-backup/JOB)")
    run.add_argument("--workdir", default="", metavar="DIR", help="trainer working directory (default: cwd)")
    run.add_argument("--max-restarts", type=int, default=d.max_restarts, metavar="N",
                     help=f"failures allowed per restart window (default {d.max_restarts})")
    run.add_argument("--restart-window", type=float, default=d.restart_window, metavar="S",
                     help=f"restart budget window (default {d.restart_window:g})")
    run.add_argument("--stall-timeout", type=float, default=d.stall_timeout, metavar="SECONDS",
                     help=f"no progress for this long is a hang; 0 disables (default {d.stall_timeout:g})")
    run.add_argument("--stop-grace", type=float, default=d.stop_grace, metavar="S",
                     help=f"SIGTERM to SIGKILL grace period (default {d.stop_grace:g})")
    run.add_argument("--failure-stop-grace", type=float, default=d.failure_stop_grace, metavar="S",
                     help=f"SIGTERM to SIGKILL grace after a failure (default {d.failure_stop_grace:g})")
    run.add_argument("--no-instrument", dest="instrument", action="store_false",
                     help="do not make the trainer's model.fit report progress by itself (hang detection and "
                          "status then need the trainer's own reports)")
    run.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    _add_security(run)
    _add_timing(run)
    _add_metrics(run)
    _add_no_slurm(run)
    run.set_defaults(**dict.fromkeys(_SLURM_FILLS, _UNSET))
    run.add_argument("trainer", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")

    coord = sub.add_parser("coordinator", help="run a standalone coordinator (e.g. on a head node)")
    coord.add_argument("--listen", required=True, metavar="HOST:PORT")
    coord.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    _add_security(coord)
    _add_timing(coord)
    _add_metrics(coord)

    status = sub.add_parser("status", help="show the cluster as the coordinator sees it")
    status.add_argument("--rendezvous", required=True, metavar="HOST:PORT", help="the coordinator's endpoint")
    status.add_argument("--json", action="store_true", help="print the documented JSON document")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="S",
                        help="refresh every S seconds (default 2)")
    _add_security(status)

    drain = sub.add_parser("drain", help="remove a node on purpose: its trainer checkpoints, the job re-forms "
                                         "without it (not counted as a failure)")
    drain.add_argument("node", metavar="NODE", help="the node id to drain (see tfelastic status)")
    drain.add_argument("--reason", default="", help="recorded in the coordinator's log and the restart reason")
    drain.add_argument("--force", action="store_true", help="drain even if fewer than min nodes would remain")
    _add_operator_connection(drain)

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


def _tls(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _given_run_values(args: argparse.Namespace) -> dict[str, Any]:
    """The AgentConfig fields that SLURM may fill, as far as flags gave them."""
    given = {name: getattr(args, name) for name in _SLURM_FILLS if getattr(args, name) is not _UNSET}
    if "nodes" in given:
        given["min_nodes"], given["max_nodes"] = parse_nodes(given.pop("nodes"))
    if "rendezvous" in given:
        given["rendezvous"] = Endpoint.parse(given["rendezvous"], "--rendezvous")
    return given


def config_from_run_args(args: argparse.Namespace, slurm: SlurmStep | None = None) -> AgentConfig:
    command = list(args.trainer)
    if command and command[0] == "--":
        command = command[1:]
    values = _given_run_values(args)
    if slurm is not None:
        values = slurm.complete(values)  # flags win; SLURM fills the rest; AgentConfig's defaults after that
    if "rendezvous" not in values:
        raise ConfigError("--rendezvous: required outside a SLURM job step; give HOST:PORT, e.g. head-node:29400")
    return validate(AgentConfig(
        command=tuple(command), **values, worker_port=args.worker_port,
        advertise_address=args.advertise_address, backup_dir=args.backup_dir, workdir=args.workdir,
        max_restarts=args.max_restarts, restart_window=args.restart_window, stall_timeout=args.stall_timeout,
        stop_grace=args.stop_grace, failure_stop_grace=args.failure_stop_grace,
        tls=_tls(args), last_call=args.last_call,
        settle=args.settle, join_timeout=args.join_timeout, heartbeat_interval=args.heartbeat_interval,
        node_timeout=args.node_timeout, log_level=args.log_level,
        metrics_address=args.metrics_address, metrics_token_file=args.metrics_token_file,
        metrics_linger=args.metrics_linger, instrument=args.instrument,
    ))


def _token_for(endpoint: Endpoint, token_file: str, option: str = "--token-file") -> str | None:
    """Reads the token; a non-loopback endpoint without one is refused."""
    if token_file:
        return read_token(token_file, option)
    if not endpoint.is_loopback():
        raise ConfigError(f"{option}: {endpoint} is not a loopback address, so a shared token is required; "
                          "create one with 'openssl rand -hex 32 > token && chmod 600 token' and pass "
                          f"{option} token")
    return None


def _check_environment(config: AgentConfig) -> None:
    """Checks that depend on this machine: the trainer command exists, the TLS files can be read."""
    workdir = config.workdir or "."
    if not os.path.isdir(workdir):
        raise ConfigError(f"--workdir: {workdir!r} is not a directory")
    program = config.command[0]
    found = (os.access(os.path.join(workdir, program), os.X_OK) if "/" in program
             else shutil.which(program, path=dict(config.env).get("PATH", os.environ.get("PATH"))))
    if not found:
        raise ConfigError(f"trainer command: {program!r} was not found or is not executable; "
                          "give a program on PATH or a path to an executable")
    _check_tls_files(config.tls)
    hosts = is_local_address(config.rendezvous.host)
    if hosts and config.tls.enabled and not config.tls.cert:
        raise ConfigError(f"--tls-cert/--tls-key: this node owns {config.rendezvous} and may host the coordinator, "
                          "which needs a certificate and key to serve TLS")
    if config.advertise_address and not is_local_address(config.advertise_address):
        raise ConfigError(f"--advertise-address: {config.advertise_address!r} is not an address of this machine")
    _check_metrics_listen(config)
    _check_backup_dir(config)


def _check_backup_dir(config: AgentConfig) -> None:
    """The trainer must be able to write its checkpoints; under systemd's ProtectSystem=strict a backup_dir
    outside ReadWritePaths= would otherwise fail only at the first save, as a worker failure."""
    path = existing = config.resolved_backup_dir()  # absolute
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--backup-dir: {path!r} cannot be written by this user ({existing} is read-only "
                          "or not writable); fix its permissions, or under systemd add it to ReadWritePaths= "
                          "(docs/operations.md)")


def _check_metrics_listen(config: AgentConfig) -> None:
    if config.metrics_port and port_taken(config.metrics_address, config.metrics_port):
        raise ConfigError(f"--metrics-port: {config.metrics_address}:{config.metrics_port} is in use; give each "
                          "agent on this host its own port (0 picks a free one)")


def _check_tls_files(tls: TlsConfig) -> None:
    for option, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca)):
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{option}: cannot read {path!r}")


def setup_logging(level: str, node: str = "") -> None:
    tag = f"tfelastic[{node}]" if node else "tfelastic"
    journal = journal_handler(f"%(levelname)s {tag} %(name)s: %(message)s")  # journald stamps the time itself
    if journal is not None:
        logging.basicConfig(level=level.upper(), handlers=[journal])
        return
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s.%(msecs)03d %(levelname)s {tag} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _warn_if_clear_text(endpoint: Endpoint, tls: TlsConfig) -> None:
    if not endpoint.is_loopback() and not tls.enabled:
        logging.getLogger("tfelastic").warning(
            "%s is not loopback and TLS is off: the token and all rendezvous traffic cross the network in clear "
            "text; use --tls-cert/--tls-key/--tls-ca on untrusted networks", endpoint)


def _metrics_token(config: AgentConfig) -> str | None:
    return read_token(config.metrics_token_file, "--metrics-token-file") if config.metrics_token_file else None


def _run_agent(config: AgentConfig, slurm: SlurmStep | None = None) -> int:
    from tfelastic.daemon.agent.agent import Agent

    token = _token_for(config.rendezvous, config.token_file)
    metrics_token = _metrics_token(config)
    _check_environment(config)
    notifier = Notifier()  # first: the trainer must not inherit $NOTIFY_SOCKET
    setup_logging(config.log_level, f"{config.job}/{config.node_id}")  # journald: job and node in every line
    _warn_if_clear_text(config.rendezvous, config.tls)
    if slurm is not None:
        logging.getLogger("tfelastic").info("%s", slurm.note)
    agent = Agent(config, token, metrics_token=metrics_token)
    return asyncio.run(run_notifying(agent, notifier, f"joining the rendezvous at {config.rendezvous}"))


def _run_coordinator(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry
    from tfelastic.daemon.metrics.cluster import register_cluster_collector
    from tfelastic.daemon.metrics.http import serve_metrics
    from tfelastic.daemon.rendezvous.server import BindError, create_server

    listen = Endpoint.parse(args.listen, "--listen", allow_port_zero=True)
    token = _token_for(listen, args.token_file)
    tls = _tls(args)
    timing = validate(AgentConfig(command=("coordinator",), rendezvous=listen, last_call=args.last_call,
                                  settle=args.settle, join_timeout=args.join_timeout,
                                  heartbeat_interval=args.heartbeat_interval, node_timeout=args.node_timeout,
                                  tls=tls, metrics_port=args.metrics_port, metrics_address=args.metrics_address,
                                  metrics_token_file=args.metrics_token_file, metrics_linger=args.metrics_linger))
    metrics_token = _metrics_token(timing)
    _check_metrics_listen(timing)
    setup_logging(args.log_level, "coordinator")
    _warn_if_clear_text(listen, tls)
    _check_tls_files(tls)
    settings = timing.rendezvous_settings()

    async def serve() -> int:
        try:
            coordinator = await create_server(str(listen), settings, token=token, tls=tls,
                                              heartbeat_interval=timing.heartbeat_interval)
        except BindError as e:
            raise ConfigError(f"--listen: {e}") from None
        logging.getLogger("tfelastic.coordinator").info("listening on %s:%d", listen.host, coordinator.port)
        metrics = None
        if timing.metrics_port is not None:
            registry = CollectorRegistry()
            register_cluster_collector(registry, lambda: coordinator.servicer.published)
            metrics = serve_metrics(registry, timing.metrics_address, timing.metrics_port, metrics_token)
            logging.getLogger("tfelastic.coordinator").info(
                "metrics on http://%s/metrics", host_port(timing.metrics_address, metrics.port))
        await coordinator.servicer.finished.wait()
        await coordinator.wait_agents_gone(timeout=10.0)
        failed = coordinator.servicer.rendezvous.state is JobState.FAILED
        if metrics is not None and failed:  # let Prometheus scrape the verdict
            await asyncio.sleep(timing.metrics_linger)
        await coordinator.stop()
        if metrics is not None:
            metrics.close()
        return 1 if failed else 0

    return asyncio.run(serve())


def _run_status(args: argparse.Namespace) -> int:
    from tfelastic.daemon.rendezvous.client import fetch_status
    from tfelastic.daemon.status import render_table, status_to_json

    endpoint = Endpoint.parse(args.rendezvous, "--rendezvous")
    token = read_token(args.token_file) if args.token_file else None
    _check_tls_files(_tls(args))
    if args.watch is not None and not args.watch > 0:
        raise ConfigError(f"--watch: {args.watch} seconds must be more than 0")
    while True:
        try:
            doc = status_to_json(asyncio.run(fetch_status(endpoint, token, _tls(args))))
        except grpc.RpcError as e:
            print(_describe_rpc_error("status", endpoint, e, tls=_tls(args).enabled), file=sys.stderr)
            return 1
        if args.watch is not None:
            print("\033[2J\033[H", end="")
        print(json.dumps(doc, indent=2) if args.json else render_table(doc), flush=True)
        if args.watch is None:
            return 0
        time.sleep(args.watch)


def _describe_rpc_error(command: str, endpoint: Endpoint, error: grpc.RpcError, *, tls: bool = False) -> str:
    from tfelastic.daemon.rendezvous.client import handshake_problem

    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        problem = handshake_problem(error.details() or "", tls)
        hint = f" (TLS: {problem})" if problem else ""
        return f"tfelastic {command}: no cluster reachable at {endpoint}: {code.name}: {error.details()}{hint}"
    hint = " (pass the job's --token-file)" if code is grpc.StatusCode.UNAUTHENTICATED else ""
    return f"tfelastic {command}: {code.name}: {error.details()}{hint}"


def _run_operator_command(args: argparse.Namespace) -> int:
    from tfelastic.daemon.rendezvous.client import drain_node, restart_job

    endpoint = Endpoint.parse(args.rendezvous, "--rendezvous")
    token = read_token(args.token_file) if args.token_file else None
    tls = _tls(args)
    _check_tls_files(tls)
    try:
        if args.command_name == "drain":
            detail = asyncio.run(drain_node(endpoint, token, tls, args.node, args.reason, args.force))
        else:
            detail = asyncio.run(restart_job(endpoint, token, tls, args.reason))
    except grpc.RpcError as e:
        print(_describe_rpc_error(args.command_name, endpoint, e), file=sys.stderr)
        return 1
    print(detail)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    slurm = SlurmStep.detect(os.environ, off=getattr(args, "no_slurm", False))
    if args.command_name == "run" and args.rendezvous is _UNSET and slurm is None:
        parser.error("the following arguments are required: --rendezvous (outside a SLURM job step)")
    try:
        if args.command_name == "agent":
            return _run_agent(load_toml(args.config, slurm.complete if slurm else None), slurm)
        if args.command_name == "run":
            return _run_agent(config_from_run_args(args, slurm), slurm)
        if args.command_name == "coordinator":
            return _run_coordinator(args)
        if args.command_name == "status":
            return _run_status(args)
        if args.command_name in ("drain", "restart"):
            return _run_operator_command(args)
        if args.command_name == "demo":
            from tfelastic.daemon.demo import run_demo

            return run_demo(nodes=args.nodes, faults=args.faults, as_json=args.json, workdir=args.workdir)
    except ConfigError as e:
        print(f"tfelastic: configuration error: {e}", file=sys.stderr)
        return EX_CONFIG
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command_name!r}")


if __name__ == "__main__":
    sys.exit(main())
