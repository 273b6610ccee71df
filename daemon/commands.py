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
from tfelastic.daemon.aio import first_of, stacks
from tfelastic.daemon.config import AgentConfig, CoordinatorConfig, OperatorConfig, RendezvousConfig
from tfelastic.daemon.coordinator_setup import CoordinatorSetup
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.client import EtcdCredentials
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.exit_guard import exit_within
from tfelastic.daemon.metrics.build import register_build_info
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
from tfelastic.daemon.rendezvous.api import JobState
from tfelastic.daemon.sdnotify import Notifier, journal_handler, run_notifying, watchdog_pinging
from tfelastic.daemon.slurm import SlurmStep
from tfelastic.daemon.version import describe
from tfelastic.daemon.worker.priority import lead_workers

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


def _warn_if_etcd_is_open(rdzv: RendezvousConfig) -> None:
    """Agents send the token to whatever address etcd names: who can write to etcd can collect it."""
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
    etcd = etcd_credentials(config.rendezvous)
    scrape_token = metrics_token(config.metrics)
    check_agent(config)
    notifier = Notifier()  # first: the trainer must not inherit $NOTIFY_SOCKET
    setup_logging(config.node.log_level, f"{config.job.name}/{config.node.id}")  # journald: job and node
    logging.getLogger("tfelastic").info("%s: agent of job %s on node %s", describe(), config.job.name, config.node.id)
    config = local_tier_or_off(config)  # it warns: after the logging is set up
    lead_workers()  # before gRPC starts its threads
    _open_files()
    _warn_if_clear_text(listen, config.rendezvous.tls)
    _warn_if_etcd_is_open(config.rendezvous)
    if slurm is not None:
        logging.getLogger("tfelastic").info("%s", slurm.note)
    agent = Agent(config, token, metrics_token=scrape_token, etcd=etcd)
    agent.hooks.exit_decided = lambda code, seconds: exit_within(seconds + EXIT_TEARDOWN_SECONDS, code, "exiting")
    return asyncio.run(_with_grpc_held(run_notifying(agent, notifier,
                                                     f"joining the rendezvous at {config.rendezvous.endpoint}")))


async def _with_grpc_held(main: Coroutine[Any, Any, int]) -> int:
    """One reference to gRPC's asyncio state for the whole life of the process, taken on the loop's thread: gRPC
    shuts its completion queue down whenever its last channel or server goes (a thread of its own joined, from
    whichever thread dropped that reference), which can hang (grpc/grpc#22365, #40989); an agent drops and makes
    channels all along. The operating system reclaims it at exit."""
    grpc.aio.init_grpc_aio()  # type: ignore[attr-defined]  # exported by grpc.aio, absent from its stubs
    return await main


def run_coordinator(config: CoordinatorConfig) -> int:
    """A standalone coordinator: the job's only one, or with an etcd rendezvous a head-node candidate that wins over
    the agents."""
    from tfelastic.daemon.metrics.http import serve_metrics

    rdzv, metrics, listen = config.rendezvous, config.metrics, config.listen
    notifier = Notifier()  # under systemd (tfelastic-coordinator@.service): READY=1 once it serves
    token = token_for(listen, rdzv.token_file)
    etcd = etcd_credentials(rdzv)
    scrape_token = metrics_token(metrics)
    check_metrics_listen(metrics)
    check_tls_files(rdzv.tls)
    check_etcd_files(rdzv)
    setup_logging(config.log_level, "coordinator")
    _open_files()
    _warn_if_clear_text(listen, rdzv.tls)
    _warn_if_etcd_is_open(rdzv)
    logging.getLogger("tfelastic").info("%s: coordinator of job %s", describe(), config.job)
    registry = CollectorRegistry()
    register_build_info(registry, "coordinator")
    server = None
    if metrics.port is not None:
        server = serve_metrics(registry, metrics.address, metrics.port, scrape_token)
        logging.getLogger("tfelastic.coordinator").info("metrics on http://%s/metrics",
                                                        host_port(metrics.address, server.port))
    setup = CoordinatorSetup.of(config.name, rdzv, config.failure_stop_grace, token)
    try:
        if rdzv.etcd is not None:
            return asyncio.run(_serve_elected(config, setup, rdzv.etcd, etcd or EtcdCredentials(), registry,
                                              notifier, lingers=server is not None))
        return asyncio.run(_serve_alone(config, setup, registry, notifier, lingers=server is not None))
    finally:
        notifier.close()
        if server is not None:
            server.close()


async def _serve_alone(config: CoordinatorConfig, setup: CoordinatorSetup, registry: CollectorRegistry,
                       notifier: Notifier, *, lingers: bool) -> int:
    from tfelastic.daemon.coordinator_setup import start_coordinator
    from tfelastic.daemon.rendezvous.bind import BindError
    from tfelastic.daemon.rendezvous.host import CoordinatorHost

    host: CoordinatorHost | None = None

    def healthy(max_age: float) -> bool:  # before it serves, that the watchdog's task runs shows the loop turns
        return host is None or host.healthy(max_age)

    _user_signals_logged()
    async with watchdog_pinging(notifier, healthy):
        try:
            host = await start_coordinator(setup, str(config.listen), registry)
        except BindError as e:
            raise ConfigError(f"--listen: {e}") from None
        listening = f"listening on {host_port(config.listen.host, host.port)}"
        logging.getLogger("tfelastic.coordinator").info("%s", listening)
        notifier.ready(f"job {config.job}: {listening}")
        stop = _stop_signalled()  # before the verdict: an orderly stop; after it, the end of the linger
        await first_of(host.wait_finished(), stop.wait())
        if not host.finished.is_set():
            logging.getLogger("tfelastic.coordinator").warning(
                "stopped by a signal before job %s ended: its agents keep their trainers and wait for a coordinator "
                "at this address; one started again re-forms the job from their joins", config.job)
            notifier.stopping(f"job {config.job}: coordinator stopped")
            await host.close()
            return ExitCode.SUCCEEDED
        failed = host.status().state is JobState.FAILED
        notifier.stopping(f"job {config.job} {'failed' if failed else 'succeeded'}")
        if lingers:  # let Prometheus scrape the verdict: the alerts tell a finished job from a dead daemon by it
            await first_of(host.wait_agents_gone(), stop.wait())
            if not stop.is_set():
                await first_of(stop.wait(), timeout=config.metrics.linger)
        await host.close()
    return ExitCode.FAILED if failed else ExitCode.SUCCEEDED


async def _serve_elected(config: CoordinatorConfig, setup: CoordinatorSetup, target: EtcdTarget,
                         credentials: EtcdCredentials, registry: CollectorRegistry, notifier: Notifier, *,
                         lingers: bool) -> int:
    """Campaigns until the job ends (it then exits 0 or 1 as the job did, once its metrics lingered) or a signal to
    stop (0): SIGTERM, SIGINT, SIGHUP or SIGQUIT, as for an agent."""
    from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdUnavailable
    from tfelastic.daemon.etcd.coordinator import Candidate, candidate_for
    from tfelastic.daemon.etcd.election import BadJobState
    from tfelastic.daemon.etcd.reach import EtcdTlsError, first_contact

    head_node = Candidate(setup, config.listen, head_node=True, linger=config.metrics.linger if lingers else 0.0)
    candidate = candidate_for(config.job, head_node, target=target, credentials=credentials,
                              lease_ttl=config.rendezvous.lease_ttl, registry=registry)
    election = candidate.election
    _user_signals_logged()
    async with watchdog_pinging(notifier, candidate.healthy):
        try:  # wrong credentials or TLS settings: exit 78 now, not after join_timeout
            await first_contact(election.client, election.leader, config.rendezvous.join_timeout)
        except EtcdAuthError as e:
            raise ConfigError(f"--etcd-password-file: {e}") from None
        except EtcdTlsError as e:
            raise ConfigError(str(e)) from None
        except EtcdUnavailable as e:
            raise OperatorError(str(e)) from None
        stop = _stop_signalled()
        logging.getLogger("tfelastic.coordinator").info("a candidate for job %s's coordinator on %s (etcd %s)",
                                                        config.job, config.listen, target)
        notifier.ready(f"job {config.job}: a candidate for its coordinator on {config.listen}")
        try:
            await candidate.run(stop)
            recorded = await election.recorded_state() if candidate.finished.is_set() else None
        except BadJobState as e:
            logging.getLogger("tfelastic.coordinator").error("%s", e)
            return ExitCode.CONFIG
        finally:
            await election.client.close()
    return ExitCode.FAILED if recorded is not None and recorded.state is JobState.FAILED else ExitCode.SUCCEEDED


def _stop_signalled() -> asyncio.Event:
    """Set by SIGTERM, SIGINT, SIGHUP or SIGQUIT from now on, as for an agent: the coordinator ends cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _user_signals_logged() -> None:
    """From now on SIGUSR1 logs where every task and thread of the coordinator waits, SIGUSR2 only that it runs:
    neither ends it, as their default action would."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        loop.add_signal_handler(sig, _log_where_it_waits, sig)


def _log_where_it_waits(signum: int) -> None:
    log = logging.getLogger("tfelastic.coordinator")
    if signum == signal.SIGUSR1:
        log.info("SIGUSR1: where the coordinator waits:\n%s", stacks())
    else:
        log.info("%s: the coordinator runs; SIGUSR1 logs where it waits, SIGTERM stops it",
                 signal.Signals(signum).name)


def find_coordinator(config: OperatorConfig) -> Endpoint:
    """The address etcd publishes for the job's coordinator (``tfelastic status``, ``drain`` and ``restart`` with an
    etcd rendezvous)."""
    from tfelastic.daemon.etcd.client import EtcdAuthError, EtcdClient, EtcdError
    from tfelastic.daemon.etcd.election import Election
    from tfelastic.daemon.etcd.reach import tls_problem

    target = config.rendezvous.etcd
    assert target is not None
    check_etcd_files(config.rendezvous)

    async def read() -> Endpoint:
        client = EtcdClient(target, etcd_credentials(config.rendezvous))
        try:
            # Any member's view: `status` must also work, and say why, while etcd has no quorum.
            leader = await Election(client, config.job, config.rendezvous.lease_ttl).leader(serializable=True)
        except EtcdAuthError as e:
            raise ConfigError(f"--etcd-password-file: {e}") from None
        except EtcdError as e:
            problem = tls_problem(str(e), target, client.credentials)
            if problem is not None:
                raise ConfigError(f"TLS with etcd at {target} fails: {problem}") from None
            raise OperatorError(f"etcd at {target} does not answer: {e}") from None
        finally:
            await client.close()
        if leader is None:
            raise OperatorError(f"no coordinator leads job {config.job!r} in etcd at {target} (is the job "
                                "running? --job names it)")
        return Endpoint.parse(leader.address, "the coordinator's address in etcd")

    return asyncio.run(read())


class OperatorError(Exception):
    """An operator command cannot reach its job: exit 1 with the message."""


def run_status(config: OperatorConfig, token: str | None, *, as_json: bool, watch: float | None) -> int:
    """One status, or with ``watch`` one every so many seconds until interrupted. A status that cannot be read is
    an error message (with ``--json``, a JSON object with ``error``); while watching, the coordinator is looked
    for again at each refresh, so that a watch rides through its failover."""
    from tfelastic.daemon.status import render_table, terminal_safe

    check_tls_files(config.rendezvous.tls)
    unreachable_since: float | None = None
    while True:
        doc, error = _status_or_error(config, token)
        if error is not None:
            unreachable_since = unreachable_since or time.monotonic()
            if watch is not None:
                error += f" (for {time.monotonic() - unreachable_since:.0f}s; retrying every {watch:g}s)"
            doc = {"error": error, "job": config.job, "rendezvous": str(config.rendezvous.endpoint)}
        else:
            unreachable_since = None
        text = json.dumps(doc, indent=2, allow_nan=False) if as_json else \
            terminal_safe(f"tfelastic status: {error}" if error else render_table(doc))
        if error is not None and watch is None and not as_json:
            print(text, file=sys.stderr)
            return ExitCode.FAILED
        if not _print(f"\033[2J\033[H{text}" if watch is not None else text):
            return ExitCode.SUCCEEDED  # whoever read it has had enough (`| head`, `| true`)
        if watch is None:
            return ExitCode.FAILED if error else ExitCode.SUCCEEDED
        time.sleep(watch)


def _status_or_error(config: OperatorConfig, token: str | None) -> tuple[dict[str, Any], str | None]:
    from tfelastic.daemon.rendezvous.client import fetch_status
    from tfelastic.daemon.status import status_to_json

    rdzv = config.rendezvous
    try:
        endpoint = rdzv.endpoint if isinstance(rdzv.endpoint, Endpoint) else find_coordinator(config)
    except OperatorError as e:
        return {}, str(e)
    try:
        return status_to_json(asyncio.run(fetch_status(endpoint, token, rdzv.tls)), time.monotonic()), None
    except grpc.RpcError as e:
        return {}, describe_rpc_error(endpoint, e, tls=rdzv.tls.enabled)


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
    from tfelastic.daemon.status import terminal_safe

    check_tls_files(tls)
    try:
        detail = asyncio.run(call())
    except grpc.RpcError as e:
        print(f"tfelastic {name}: {describe_rpc_error(endpoint, e)}", file=sys.stderr)
        return ExitCode.FAILED
    if not detail:  # every tfelastic coordinator says what it did
        print(f"tfelastic {name}: the server at {endpoint} answered with an empty reply, which no tfelastic "
              "coordinator sends: is it the job's coordinator (--rendezvous)? Nothing was done", file=sys.stderr)
        return ExitCode.FAILED
    _print(terminal_safe(detail))
    return ExitCode.SUCCEEDED


def describe_rpc_error(endpoint: Endpoint, error: grpc.RpcError, *, tls: bool = False) -> str:
    """What a failed call to the coordinator means, for the operator (the caller says which command it was)."""
    from tfelastic.daemon.rendezvous.handshake import handshake_problem

    code, details = error.code(), error.details() or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        problem = handshake_problem(details, tls)
        grpc_said = f" [{code.name}: {details[:300]}]"
        if problem:
            return f"cannot talk to the coordinator at {endpoint}: TLS: {problem}{grpc_said}"
        if "refused" in details.lower():
            return (f"nothing listens at {endpoint}: no tfelastic coordinator runs there (is the "
                    f"job running, and is {endpoint} its rendezvous address?){grpc_said}")
        return (f"no answer from {endpoint} (a host that is down, a firewall, or a "
                f"coordinator too busy to answer){grpc_said}")
    # tfelastic's coordinator names the option itself; another server's refusal may not.
    named = "--token-file" in details
    hint = " (pass the job's --token-file)" if code is grpc.StatusCode.UNAUTHENTICATED and not named else ""
    return f"{code.name}: {details}{hint}"
