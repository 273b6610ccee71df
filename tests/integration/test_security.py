"""Authentication: the shared token (constant-time, UNAUTHENTICATED on mismatch, nothing changes) and TLS."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from tfelastic.daemon.auth import bearer
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.client import fetch_status, open_channel
from tfelastic.daemon.rendezvous.host import create_server
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

from tests.cluster import COUNTER
from tests.conftest import ClusterFactory
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.quick]


def write_token(path: Path, secret: str) -> str:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def job_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """What a refused agent or request must not change: the job's state and restarts, and its nodes."""
    return {
        "state": doc["state"],
        "generation": doc["generation"],
        "restarts_total": doc["restarts_total"],
        "restarts_by_reason": doc["restarts_by_reason"],
        "nodes": sorted((n["node_id"], n["state"]) for n in doc["nodes"]),
    }


def test_wrong_token_is_refused_and_changes_nothing(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    good = write_token(tmp_path / "token", "s3cret-good")
    bad = write_token(tmp_path / "bad-token", "s3cret-bad")
    cluster = make_cluster([sys.executable, COUNTER], nodes="2", token="s3cret-good",
                           extra_args=["--token-file", good])
    cluster.start("a")
    before = job_summary(cluster.wait_status(lambda d: [n["node_id"] for n in d["nodes"]] == ["a"], 20,
                                             'agent "a" to join'))
    intruder = cluster.start("intruder", extra=["--token-file", bad])
    assert intruder.wait(30) == 78
    assert "the coordinator refused this agent: missing or wrong token" in intruder.log()
    assert "s3cret" not in intruder.log() and "s3cret" not in cluster.agents[0].log()  # secrets are never logged

    async def raw_join(metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
        async with open_channel(cluster.endpoint) as channel:
            call = pb_grpc.RendezvousStub(channel).Session(metadata=metadata)  # type: ignore[no-untyped-call]
            # A refusal ends the call before it reads anything. Wait for that first: a write that races the end
            # of the call fails in gRPC's client core with INTERNAL ("Internal error from Core"), and the
            # refusal's own status is lost (seen in 4 of 120 calls).
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(asyncio.shield(call.code()), 5.0)
            try:  # not refused at once: it waits for our Join
                await call.write(pb.AgentMessage(join=pb.Join(node_id="raw", spec=pb.JobSpec(job="default"))))
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    assert asyncio.run(raw_join(())) is grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(raw_join(bearer("s3cret-goo"))) is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(fetch_status(cluster.endpoint, "wrong"))
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    after = cluster.status()
    assert after is not None
    assert job_summary(after) == before  # nobody was added, and nothing restarted or moved on

    status = subprocess.run([sys.executable, "-m", "tfelastic.daemon", "status", "--rendezvous",
                             str(cluster.endpoint), "--token-file", bad], capture_output=True, text=True, timeout=60)
    assert status.returncode == 1
    assert "UNAUTHENTICATED" in status.stderr and "--token-file" in status.stderr


def _make_certs(d: Path) -> TlsConfig:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tfelastic-test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
            "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", "server.pem")
    return TlsConfig(cert=str(d / "server.pem"), key=str(d / "server.key"), ca=str(d / "ca.pem"))


def test_tls_coordinator_serves_tls_clients_and_refuses_plain_text(tmp_path: Path) -> None:
    server_tls = _make_certs(tmp_path)
    server_only = TlsConfig(cert=server_tls.cert, key=server_tls.key)  # server auth only
    client_tls = TlsConfig(ca=server_tls.ca)
    port = free_port()

    async def scenario() -> None:
        coordinator = await create_server(f"127.0.0.1:{port}", api.RendezvousSettings(), token="t", tls=server_only)
        try:
            endpoint = Endpoint("127.0.0.1", port)
            status = await fetch_status(endpoint, "t", client_tls)
            assert status.state is api.JobState.WAITING
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await fetch_status(endpoint, "t", None, timeout=2.0)
            assert plain.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            await coordinator.close()

    asyncio.run(scenario())


def test_health_service_serves_without_a_token(tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def scenario() -> list[int]:
        coordinator = await create_server("127.0.0.1:0", api.RendezvousSettings(), token="secret")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return [(await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
                        for name in ("", "tfelastic.v1.Rendezvous")]
        finally:
            await coordinator.close()

    assert asyncio.run(scenario()) == [health_pb2.HealthCheckResponse.SERVING] * 2
