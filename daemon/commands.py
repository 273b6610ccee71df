"""What each ``tfelastic`` subcommand does once its configuration is parsed and valid (:mod:`tfelastic.daemon.cli`
parses). Every check that depends on the machine runs first (:mod:`tfelastic.daemon.preflight`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from tfelastic.daemon.config import AgentConfig
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.netutil import host_port
from tfelastic.daemon.preflight import (
    check_agent,
    check_metrics_listen,
    check_tls_files,
    metrics_token,
    raise_open_files_limit,
    token_for,
)
from tfelastic.daemon.sdnotify import Notifier, journal_handler, run_notifying
from tfelastic.daemon.slurm import SlurmStep


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


def run_agent(config: AgentConfig, slurm: SlurmStep | None = None) -> int:
    from tfelastic.daemon.agent.agent import Agent

    token = token_for(config.rendezvous.endpoint, config.rendezvous.token_file)
    scrape_token = metrics_token(config)
    check_agent(config)
    notifier = Notifier()  # first: the trainer must not inherit $NOTIFY_SOCKET
    setup_logging(config.node.log_level, f"{config.job.name}/{config.node.id}")  # journald: job and node
    _open_files()
    _warn_if_clear_text(config.rendezvous.endpoint, config.rendezvous.tls)
    if slurm is not None:
        logging.getLogger("tfelastic").info("%s", slurm.note)
    agent = Agent(config, token, metrics_token=scrape_token)
    return asyncio.run(run_notifying(agent, notifier, f"joining the rendezvous at {config.rendezvous.endpoint}"))


def run_coordinator(config: AgentConfig) -> int:
    """A standalone coordinator on ``config.rendezvous.endpoint`` (``--listen``), with the timing, security and
    metrics settings of ``config``."""
    from tfelastic.daemon.metrics.http import serve_metrics
    from tfelastic.daemon.rendezvous.bind import BindError
    from tfelastic.daemon.rendezvous.host import create_server

    rdzv, metrics = config.rendezvous, config.metrics
    token = token_for(rdzv.endpoint, rdzv.token_file)
    scrape_token = metrics_token(config)
    check_metrics_listen(config)
    check_tls_files(rdzv.tls)
    setup_logging(config.node.log_level, "coordinator")
    _open_files()
    _warn_if_clear_text(rdzv.endpoint, rdzv.tls)
    log = logging.getLogger("tfelastic.coordinator")

    async def serve() -> int:
        try:
            host = await create_server(str(rdzv.endpoint), config.rendezvous_settings(), token=token, tls=rdzv.tls,
                                       heartbeat_interval=rdzv.heartbeat_interval)
        except BindError as e:
            raise ConfigError(f"--listen: {e}") from None
        log.info("listening on %s", host_port(rdzv.endpoint.host, host.port))
        server = None
        if metrics.port is not None:
            registry = CollectorRegistry()
            host.register_metrics(registry)
            server = serve_metrics(registry, metrics.address, metrics.port, scrape_token)
            log.info("metrics on http://%s/metrics", host_port(metrics.address, server.port))
        verdict = await host.wait_finished()
        failed = verdict is not None and verdict.value == "failed"
        if server is not None and failed:  # let Prometheus scrape the verdict
            await host.wait_agents_gone()
            await asyncio.sleep(metrics.linger)
        await host.close()
        if server is not None:
            server.close()
        return ExitCode.FAILED if failed else ExitCode.SUCCEEDED

    return asyncio.run(serve())


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
