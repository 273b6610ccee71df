"""What each ``tfelastic`` subcommand does once its configuration is parsed and valid (:mod:`tfelastic.daemon.cli`
parses). Every check that depends on the machine runs first (:mod:`tfelastic.daemon.preflight`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.client import EtcdCredentials
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.exit_guard import exit_within
from tfelastic.daemon.netutil import host_port
from tfelastic.daemon.preflight import (
    check_agent,
    check_etcd_files,
    check_metrics_listen,
    check_tls_files,
    coordinator_listen,
    etcd_credentials,
    local_tier_or_off,
    metrics_token,
    raise_open_files_limit,
    token_for,
)
from tfelastic.daemon.rendezvous.api import CoordinatorInfo, JobState
from tfelastic.daemon.sdnotify import Notifier, journal_handler, run_notifying
from tfelastic.daemon.slurm import SlurmStep

# After an agent's own wind-down: asyncio's teardown (cancelled tasks, its thread pool) and the interpreter's.
EXIT_TEARDOWN_SECONDS = 10.0


def setup_logging(level: str, node: str = "") -> None:
    tag = f"tfelastic[{node}]" if node else "tfelastic"
    journal = journal_handler(f"%(levelname)s {tag} %(name)s: %(message)s")  # journald stamps the time itself
    if journal is not None:
        logging.basicConfig(level=level.upper(), handlers=[journal])
        return
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s.%(msecs)03d %(levelname)s {tag} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _open_files() -> None:
    before, after = raise_open_files_limit()
    if after != before:
        logging.getLogger("tfelastic").info("open files limit raised from %d to %d (the hard limit)", before, after)


def _warn_if_clear_text(endpoint: Endpoint, tls: TlsConfig) -> None:
    if not endpoint.is_loopback() and not tls.enabled:
        logging.getLogger("tfelastic").warning(
            "%s is not loopback and TLS is off: the token and all rendezvous traffic cross the network in clear "
            "text; use --tls-cert/--tls-key/--tls-ca on untrusted networks", endpoint)


def _warn_if_etcd_is_open(config: AgentConfig) -> None:
    """Agents send the token to whatever address etcd names: who can write to etcd can collect it."""
    rdzv = config.rendezvous
    if rdzv.etcd is not None and not rdzv.etcd_password_file and not rdzv.etcd_cert:
        logging.getLogger("tfelastic").warning(
            "etcd at %s is used without authentication (no --etcd-password-file, no client certificate): anyone "
            "who can write to it can name a coordinator and receive this job's token; turn etcd's "
            "authentication on (docs/operations.md)", rdzv.etcd)


def run_agent(config: AgentConfig, slurm: SlurmStep | None = None) -> int:
    from tfelastic.daemon.agent.agent import Agent

    listen = coordinator_listen(config)
    # With etcd, the listener is this node's address and a port picked per term: name the address alone.
    elected_port = config.rendezvous.etcd is not None and listen.port == 0
    token = token_for(listen, config.rendezvous.token_file, where=listen.host if elected_port else "")
    etcd = etcd_credentials(config)
    scrape_token = metrics_token(config)
    check_agent(config)
    notifier = Notifier()  # first: the trainer must not inherit $NOTIFY_SOCKET
    setup_logging(config.node.log_level, f"{config.job.name}/{config.node.id}")  # journald: job and node
    config = local_tier_or_off(config)  # it warns: after the logging is set up
    _open_files()
    _warn_if_clear_text(listen, config.rendezvous.tls)
    _warn_if_etcd_is_open(config)
    if slurm is not None:
        logging.getLogger("tfelastic").info("%s", slurm.note)
    agent = Agent(config, token, metrics_token=scrape_token, etcd=etcd)
    agent.on_exit_decided = lambda code, seconds: exit_within(seconds + EXIT_TEARDOWN_SECONDS, code, "exiting")
    return asyncio.run(_with_grpc_held(run_notifying(agent, notifier,
                                                     f"joining the rendezvous at {config.rendezvous.endpoint}")))


async def _with_grpc_held(main: Coroutine[Any, Any, int]) -> int:
    """One reference to gRPC's asyncio state for the whole life of the process, taken on the loop's thread: gRPC
    shuts its completion queue down whenever its last channel or server goes (a thread of its own joined, from
    whichever thread dropped that reference), which can hang (grpc/grpc#22365, #40989); an agent drops and makes
    channels all along. The operating system reclaims it at exit."""
    grpc.aio.init_grpc_aio()  # type: ignore[attr-defined]  # exported by grpc.aio, absent from its stubs
    return await main


def run_coordinator(config: AgentConfig, listen: Endpoint) -> int:
    """A standalone coordinator on ``listen`` with the timing, security and metrics settings of ``config``: the
    job's only one, or with an etcd rendezvous a head-node candidate that wins over the agents."""
    from tfelastic.daemon.metrics.http import serve_metrics

    rdzv, metrics = config.rendezvous, config.metrics
    token = token_for(listen, rdzv.token_file)
    etcd = etcd_credentials(config)
    scrape_token = metrics_token(config)
    check_metrics_listen(config)
    check_tls_files(rdzv.tls)
    check_etcd_files(config)
    setup_logging(config.node.log_level, "coordinator")
    _open_files()
    _warn_if_clear_text(listen, rdzv.tls)
    _warn_if_etcd_is_open(config)
    registry = CollectorRegistry()
    server = None
    if metrics.port is not None:
        server = serve_metrics(registry, metrics.address, metrics.port, scrape_token)
        logging.getLogger("tfelastic.coordinator").info("metrics on http://%s/metrics",
                                                        host_port(metrics.address, server.port))
    try:
        if rdzv.etcd is not None:
            return asyncio.run(_serve_elected(config, rdzv.etcd, etcd or EtcdCredentials(), listen, token, registry))
        return asyncio.run(_serve_alone(config, listen, token, registry, lingers=server is not None))
    finally:
        if server is not None:
            server.close()


async def _serve_alone(config: AgentConfig, listen: Endpoint, token: str | None, registry: CollectorRegistry,
                       lingers: bool) -> int:
    from tfelastic.daemon.rendezvous.bind import BindError
    from tfelastic.daemon.rendezvous.host import create_server

    rdzv = config.rendezvous
    try:
        host = await create_server(str(listen), config.rendezvous_settings(), token=token, tls=rdzv.tls,
                                   heartbeat_interval=rdzv.heartbeat_interval,
                                   info=CoordinatorInfo(config.node.id, str(listen), time.time()))
    except BindError as e:
        raise ConfigError(f"--listen: {e}") from None
    logging.getLogger("tfelastic.coordinator").info("listening on %s", host_port(listen.host, host.port))
    host.register_metrics(registry)
    failed = await host.wait_finished() is JobState.FAILED
    if lingers:  # let Prometheus scrape the verdict: the alerts tell a finished job from a dead daemon by it
        await host.wait_agents_gone()
        await asyncio.sleep(config.metrics.linger)
    await host.close()
    return ExitCode.FAILED if failed else ExitCode.SUCCEEDED


async def _serve_elected(config: AgentConfig, target: EtcdTarget, credentials: EtcdCredentials, listen: Endpoint,
                         token: str | None, registry: CollectorRegistry) -> int:
    """Campaigns until the job ends (it then exits 0 or 1 as the job did) or SIGTERM (0)."""
    from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdClient
    from tfelastic.daemon.etcd.coordinator import Candidate, ElectedCoordinator
    from tfelastic.daemon.etcd.election import Election
    from tfelastic.daemon.etcd.metrics import EtcdMetrics

    rdzv = config.rendezvous
    metrics = EtcdMetrics(registry)
    client = EtcdClient(target, credentials, metrics)
    election = Election(client, config.job.name, rdzv.lease_ttl, metrics)
    try:
        await election.leader()  # wrong credentials: exit 78 now, not after join_timeout
    except EtcdAuthError as e:
        raise ConfigError(f"--etcd-password-file: {e}") from None
    candidate = ElectedCoordinator(election, Candidate(config.node.id, listen, True, config.rendezvous_settings(),
                                                       rdzv.heartbeat_interval, config.node.failure_stop_grace, token,
                                                       rdzv.tls), registry, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    logging.getLogger("tfelastic.coordinator").info("a candidate for job %s's coordinator on %s (etcd %s)",
                                                    config.job.name, listen, target)
    try:
        await candidate.run(stop)
        recorded = await election.recorded_state() if candidate.finished.is_set() else None
    finally:
        await client.close()
    return ExitCode.FAILED if recorded is not None and recorded.state is JobState.FAILED else ExitCode.SUCCEEDED


def find_coordinator(config: AgentConfig) -> Endpoint:
    """The address etcd publishes for the job's coordinator (``tfelastic status``, ``drain`` and ``restart`` with an
    etcd rendezvous)."""
    from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdClient, EtcdError
    from tfelastic.daemon.etcd.election import Election

    target = config.rendezvous.etcd
    assert target is not None

    async def read() -> Endpoint:
        client = EtcdClient(target, etcd_credentials(config))
        try:
            # Any member's view: `status` must also work, and say why, while etcd has no quorum.
            leader = await Election(client, config.job.name, config.rendezvous.lease_ttl).leader(serializable=True)
        except EtcdAuthError as e:
            raise ConfigError(f"--etcd-password-file: {e}") from None
        except EtcdError as e:
            raise OperatorError(f"etcd at {target} does not answer: {e}") from None
        finally:
            await client.close()
        if leader is None:
            raise OperatorError(f"no coordinator leads job {config.job.name!r} in etcd at {target} (is the job "
                                "running? --job names it)")
        return Endpoint.parse(leader.address, "the coordinator's address in etcd")

    return asyncio.run(read())


class OperatorError(Exception):
    """An operator command cannot reach its job: exit 1 with the message."""


def run_status(endpoint: Endpoint, token: str | None, tls: TlsConfig, *, as_json: bool, watch: float | None) -> int:
    from tfelastic.daemon.rendezvous.client import fetch_status
    from tfelastic.daemon.status import render_table, status_to_json

    check_tls_files(tls)
    while True:
        try:
            doc = status_to_json(asyncio.run(fetch_status(endpoint, token, tls)), time.monotonic())
        except grpc.RpcError as e:
            print(describe_rpc_error("status", endpoint, e, tls=tls.enabled), file=sys.stderr)
            return ExitCode.FAILED
        text = json.dumps(doc, indent=2) if as_json else render_table(doc)
        if not _print(f"\033[2J\033[H{text}" if watch is not None else text):
            return ExitCode.SUCCEEDED  # whoever read it has had enough (`| head`, `| true`)
        if watch is None:
            return ExitCode.SUCCEEDED
        time.sleep(watch)


def _print(text: str) -> bool:
    """Prints ``text``; False when nobody reads our output any more (a closed pipe)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return False
    return True


def run_operator(name: str, endpoint: Endpoint, tls: TlsConfig, call: Callable[[], Coroutine[Any, Any, str]]) -> int:
    """``tfelastic drain`` or ``restart``: one authenticated call; prints what the coordinator did."""
    check_tls_files(tls)
    try:
        detail = asyncio.run(call())
    except grpc.RpcError as e:
        print(describe_rpc_error(name, endpoint, e), file=sys.stderr)
        return ExitCode.FAILED
    _print(detail)
    return ExitCode.SUCCEEDED


def describe_rpc_error(command: str, endpoint: Endpoint, error: grpc.RpcError, *, tls: bool = False) -> str:
    from tfelastic.daemon.rendezvous.handshake import handshake_problem

    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        problem = handshake_problem(error.details() or "", tls)
        hint = f" (TLS: {problem})" if problem else ""
        return f"tfelastic {command}: no cluster reachable at {endpoint}: {code.name}: {error.details()}{hint}"
    hint = " (pass the job's --token-file)" if code is grpc.StatusCode.UNAUTHENTICATED else ""
    return f"tfelastic {command}: {code.name}: {error.details()}{hint}"
