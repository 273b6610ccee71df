"""TLS and mutual TLS on the rendezvous (Session) and status (GetStatus) endpoints, with certificates generated
by the openssl CLI (tests/certs.py): every kind of bad peer is refused during the handshake (UNAVAILABLE), and
nothing it sent reaches the coordinator."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.client import call_metadata, fetch_status, open_channel
from tfelastic.daemon.rendezvous.host import create_server
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

from tests.certs import Certificates, make_certificates
from tests.cluster import wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.quick]

TOKEN = "tls-test-token"
SPEC = api.JobSpec(job="tls", command_digest=b"\x07" * 32, min_nodes=1, max_nodes=3, max_restarts=3,
                   restart_window_seconds=60, stall_timeout_seconds=0, backup_dir="/shared/tls")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("pki"))


def join(node_id: str) -> pb.AgentMessage:
    spec = pb.JobSpec(job=SPEC.job, command_digest=SPEC.command_digest, min_nodes=SPEC.min_nodes,
                      max_nodes=SPEC.max_nodes, max_restarts=SPEC.max_restarts,
                      restart_window_seconds=SPEC.restart_window_seconds, stall_timeout_seconds=0,
                      backup_dir=SPEC.backup_dir, heartbeat_interval_seconds=0.5, node_timeout_seconds=2.0)
    return pb.AgentMessage(join=pb.Join(node_id=node_id, spec=spec, host="127.0.0.1", worker_port=2222,
                                        incarnation=node_id, last_rank=-1))


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str


async def open_session(endpoint: Endpoint, tls: TlsConfig | None, node_id: str) -> Outcome:
    """Sends a valid Join, and returns OK with the first message's kind, or the status the call ended with."""
    async with open_channel(endpoint, tls) as channel:
        call = pb_grpc.RendezvousStub(channel).Session(metadata=call_metadata(TOKEN))  # type: ignore[no-untyped-call]
        try:
            await call.write(join(node_id))
            async for message in call:
                return Outcome(grpc.StatusCode.OK, message.WhichOneof("kind"))
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code(), e.details() or "")
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call had already ended: its status says why
        return Outcome(await call.code(), await call.details())


async def hold_session(endpoint: Endpoint, tls: TlsConfig, node_id: str, joined: asyncio.Event) -> None:
    """A legitimate agent: joins, sets ``joined`` on the coordinator's answer, heartbeats until cancelled."""
    async with open_channel(endpoint, tls) as channel:
        call = pb_grpc.RendezvousStub(channel).Session(metadata=call_metadata(TOKEN))  # type: ignore[no-untyped-call]
        await call.write(join(node_id))

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(0.5)
                await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat()))

        beating = asyncio.create_task(heartbeat())
        try:
            async for _ in call:
                joined.set()
        finally:
            beating.cancel()


async def get_status(endpoint: Endpoint, tls: TlsConfig | None) -> Outcome:
    try:
        status = await fetch_status(endpoint, TOKEN, tls, timeout=10.0)
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code(), e.details() or "")
    return Outcome(grpc.StatusCode.OK, f"{len(status.nodes)} nodes")


@dataclass(frozen=True)
class Case:
    server: str  # "tls" or "mtls"; "expired" is TLS with an expired server certificate
    client: str  # see client_tls()
    # What the client sees: its own verification failed (OpenSSL's reason), or the coordinator hung up.
    details: str


def server_tls(certs: Certificates, kind: str) -> TlsConfig:
    if kind == "expired":
        return certs.server_tls(certs.expired_server, mutual=False)
    return certs.server_tls(mutual=kind == "mtls")


def client_tls(certs: Certificates, kind: str) -> TlsConfig | None:
    return {
        "good": certs.client_tls(certs.client),
        "server-auth-only": certs.client_tls(),
        "wrong-ca": certs.client_tls(certs.client, trust=certs.other_ca),
        "foreign-cert": certs.client_tls(certs.other_client),
        "expired-cert": certs.client_tls(certs.expired_client),
        "no-cert": certs.client_tls(),
        "plain-text": None,
    }[kind]


REFUSED = [
    Case("tls", "wrong-ca", "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"),
    Case("mtls", "wrong-ca", "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"),
    Case("mtls", "foreign-cert", "Socket closed"),
    Case("expired", "server-auth-only", "CERTIFICATE_VERIFY_FAILED: certificate has expired"),
    Case("mtls", "expired-cert", "Socket closed"),
    Case("tls", "plain-text", "Socket closed"),
    Case("mtls", "plain-text", "Socket closed"),
    Case("mtls", "no-cert", "Socket closed"),
]


def run_against(certs: Certificates, case: Case) -> tuple[Outcome, Outcome, Outcome, list[str], list[str]]:
    """A coordinator with one legitimate member, then the bad client's Session and GetStatus; returns both
    outcomes, a legitimate status call after them, and the coordinator's nodes before and after."""

    async def scenario() -> tuple[Outcome, Outcome, Outcome, list[str], list[str]]:
        coordinator = await create_server("127.0.0.1:0", api.RendezvousSettings(), token=TOKEN,
                                          tls=server_tls(certs, case.server), spec=SPEC)
        endpoint = Endpoint("127.0.0.1", coordinator.port)
        good = certs.client_tls(certs.client) if case.server != "expired" else None
        try:
            if good is not None:  # a member over a good connection: the coordinator works, and it stays alone
                joined = asyncio.Event()
                member = asyncio.create_task(hold_session(endpoint, good, "member", joined))
                await asyncio.wait_for(joined.wait(), 20)
            before = nodes(coordinator.status())
            bad = client_tls(certs, case.client)
            session = await open_session(endpoint, bad, "intruder")
            status = await get_status(endpoint, bad)
            after = nodes(coordinator.status())
            control = await get_status(endpoint, good) if good is not None else Outcome(grpc.StatusCode.OK, "")
            if good is not None:
                member.cancel()
            return session, status, control, before, after
        finally:
            await coordinator.close()

    return asyncio.run(scenario())


def nodes(snapshot: api.ClusterStatus) -> list[str]:
    return [n.node_id for n in snapshot.nodes]


@pytest.mark.parametrize("case", REFUSED, ids=[f"{c.server}-server-{c.client}-client" for c in REFUSED])
def test_bad_peers_are_refused_on_both_endpoints_and_change_nothing(certs: Certificates, case: Case) -> None:
    session, status, control, before, after = run_against(certs, case)
    for outcome in (session, status):
        assert outcome.code is grpc.StatusCode.UNAVAILABLE, outcome
        assert case.details in outcome.details, outcome
    # The member is there before and after, and the intruder never joined. (An expired server certificate
    # keeps good clients out too, so that coordinator has no member.)
    assert before == after == ([] if case.server == "expired" else ["member"])
    assert control.code is grpc.StatusCode.OK, control  # and the coordinator still serves good clients


@pytest.mark.parametrize(("server", "client"), [("tls", "server-auth-only"), ("tls", "good"), ("mtls", "good")])
def test_good_peers_get_in(certs: Certificates, server: str, client: str) -> None:
    """The control: the same coordinators let the right clients join and read the status."""

    async def scenario() -> tuple[Outcome, Outcome]:
        coordinator = await create_server("127.0.0.1:0", api.RendezvousSettings(), token=TOKEN,
                                          tls=server_tls(certs, server), spec=SPEC)
        endpoint = Endpoint("127.0.0.1", coordinator.port)
        try:
            return (await open_session(endpoint, client_tls(certs, client), "newcomer"),
                    await get_status(endpoint, client_tls(certs, client)))
        finally:
            await coordinator.close()

    session, status = asyncio.run(scenario())
    assert session == Outcome(grpc.StatusCode.OK, "waiting")  # joined: the coordinator answered the Join
    assert status.code is grpc.StatusCode.OK


# ----------------------------------------------------------------------------------------- the real CLI


def tfelastic(*args: str) -> list[str]:
    return [sys.executable, "-m", "tfelastic.daemon", *args]


@pytest.fixture
def mtls_coordinator(certs: Certificates, tmp_path: Path) -> Iterator[Endpoint]:
    """A real `tfelastic coordinator` process serving mutual TLS."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    endpoint = Endpoint("127.0.0.1", free_port())
    tls = certs.server_tls(mutual=True)
    log = open(tmp_path / "coordinator.log", "wb")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(tfelastic("coordinator", "--listen", str(endpoint), "--token-file", str(token),
                                      "--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca,
                                      "--metrics-port", "off"), stdout=log, stderr=subprocess.STDOUT)
    try:
        good = certs.client_tls(certs.client)
        wait_for(lambda: asyncio.run(get_status(endpoint, good)).code is grpc.StatusCode.OK, 30, "the coordinator")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def run_agent(endpoint: Endpoint, tmp_path: Path, tls: TlsConfig) -> subprocess.CompletedProcess[str]:
    token = tmp_path / "token"
    args = ["run", "--rendezvous", str(endpoint), "--node-id", "agent-1", "--token-file", str(token),
            "--join-timeout", "3", "--metrics-port", "off", "--backup-dir", str(tmp_path / "backup")]
    for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca)):
        if path:
            args += [flag, path]
    return subprocess.run(tfelastic(*args, "--", "true"), capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, check=False)


@pytest.mark.parametrize(("client", "message"), [
    ("wrong-ca", "this node cannot verify the coordinator's certificate (CERTIFICATE_VERIFY_FAILED: unable to "
                 "get local issuer certificate): check that --tls-ca holds the CA that signed it"),
    ("expired-cert", "the coordinator closed the connection during the TLS handshake: it probably refused this "
                     "node's certificate"),
])
def test_agent_with_bad_tls_exits_78_naming_the_problem(certs: Certificates, mtls_coordinator: Endpoint,
                                                         tmp_path: Path, client: str, message: str) -> None:
    tls = client_tls(certs, client)
    assert tls is not None
    result = run_agent(mtls_coordinator, tmp_path, tls)
    assert result.returncode == 78, result.stderr
    assert f"TLS problem with the coordinator: {message}" in result.stderr  # at once, not only at the end
    assert f"giving up after 3s of failed TLS handshakes with the coordinator: {message}" in result.stderr
    assert "Traceback" not in result.stderr


def test_agent_with_good_certificates_runs_the_job(certs: Certificates, mtls_coordinator: Endpoint,
                                                    tmp_path: Path) -> None:
    """The control for the test above: the same coordinator and agent command with the right certificate."""
    result = run_agent(mtls_coordinator, tmp_path, certs.client_tls(certs.client))
    assert result.returncode == 0, result.stderr
    assert "job succeeded" in result.stderr


def test_status_cli_names_the_tls_problem(certs: Certificates, mtls_coordinator: Endpoint, tmp_path: Path) -> None:
    result = subprocess.run(tfelastic("status", "--rendezvous", str(mtls_coordinator), "--token-file",
                                      str(tmp_path / "token"), "--tls-ca", certs.other_ca.ca),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr
    assert "this node cannot verify the coordinator's certificate" in result.stderr
