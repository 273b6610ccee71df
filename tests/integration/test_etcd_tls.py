"""TLS settings for etcd that cannot work end a process in seconds, exit 78, with the real cause: a CA file that
is not PEM, a key that is not the certificate's, etcds:// against an etcd that serves plain text (and the
reverse), a client certificate that etcd requires and did not get, etcd's certificate from another CA. Real etcd
3.4 with and without TLS, real agents, a real standalone coordinator and `tfelastic status`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tfelastic.daemon.exit_codes import ExitCode

from tests.certs import Certificates, make_certificates
from tests.cluster import COUNTER
from tests.etcd import EtcdCluster

pytestmark = pytest.mark.integration

SECONDS = 15.0  # the whole process, start-up included: the retry window is TLS_GIVE_UP_SECONDS (3 s)


@dataclass
class Etcds:
    certs: Certificates
    plain: EtcdCluster
    mutual: EtcdCluster  # TLS, client certificates required

    def url(self, cluster: EtcdCluster, scheme: str = "etcds") -> str:
        member = cluster.members[0]
        return f"{scheme}://{member.host}:{member.client_port}"


@pytest.fixture(scope="module")
def etcds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcds]:
    folder = tmp_path_factory.mktemp("etcd-tls")
    certs = make_certificates(folder / "pki")
    (folder / "plain").mkdir()
    (folder / "mutual").mkdir()
    plain = EtcdCluster(folder / "plain", size=1).start()
    try:
        mutual = EtcdCluster(folder / "mutual", size=1, tls=(certs.ca.ca, certs.server.cert, certs.server.key))
        mutual.start()
    except BaseException:
        plain.stop()
        raise
    yield Etcds(certs, plain, mutual)
    plain.stop()
    mutual.stop()


def tfelastic(tmp_path: Path, *args: str) -> tuple[int, str, float]:
    """Runs a tfelastic command to its end: exit code, output, seconds."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tfelastic.daemon", *args], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def agent(tmp_path: Path, url: str, *etcd_flags: str) -> tuple[int, str, float]:
    return tfelastic(tmp_path, "run", "--nodes", "1", "--rendezvous", url, "--node-id", "a", "--metrics-port",
                     "off", "--backup-dir", str(tmp_path / "backup"), "--join-timeout", "60", *etcd_flags, "--",
                     sys.executable, COUNTER)


def test_a_ca_file_that_is_not_pem_is_refused_before_anything_starts(tmp_path: Path, etcds: Etcds) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all!!\n-----END CERTIFICATE-----\n")
    c = etcds.certs
    code, output, seconds = agent(tmp_path, etcds.url(etcds.mutual), "--etcd-ca", str(garbage), "--etcd-cert",
                                  c.client.cert, "--etcd-key", c.client.key)
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert f"--etcd-ca: {str(garbage)!r} holds no PEM certificate" in output, output


def test_a_key_that_is_not_the_certificates_is_refused_before_anything_starts(tmp_path: Path,
                                                                             etcds: Etcds) -> None:
    c = etcds.certs
    code, output, seconds = agent(tmp_path, etcds.url(etcds.mutual), "--etcd-ca", c.ca.ca, "--etcd-cert",
                                  c.client.cert, "--etcd-key", c.server.key)
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert f"--etcd-key: {c.server.key!r} is not the private key of --etcd-cert" in output, output


def test_etcds_against_a_plain_text_etcd_says_so_and_blames_no_certificate(tmp_path: Path, etcds: Etcds) -> None:
    code, output, seconds = agent(tmp_path, etcds.url(etcds.plain), "--etcd-ca", etcds.certs.ca.ca)
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert "it serves plain text there; write etcd:// instead of etcds://" in output, output
    assert "certificate" not in output.split("fails:")[-1].split("\n")[0], output


def test_plain_text_against_an_etcd_that_wants_tls_says_so(tmp_path: Path, etcds: Etcds) -> None:
    code, output, seconds = agent(tmp_path, etcds.url(etcds.mutual, "etcd"))
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert "it requires TLS; write etcds:// and pass --etcd-ca" in output, output


def test_a_missing_client_certificate_is_named(tmp_path: Path, etcds: Etcds) -> None:
    code, output, seconds = agent(tmp_path, etcds.url(etcds.mutual), "--etcd-ca", etcds.certs.ca.ca)
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert "etcd requires a client certificate" in output and "pass --etcd-cert and --etcd-key" in output, output


def test_etcds_certificate_from_another_ca_is_named_with_the_etcd_option(tmp_path: Path, etcds: Etcds) -> None:
    c = etcds.certs
    code, output, seconds = agent(tmp_path, etcds.url(etcds.mutual), "--etcd-ca", c.other_ca.ca, "--etcd-cert",
                                  c.client.cert, "--etcd-key", c.client.key)
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert f"cannot verify etcd's certificate (CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate) " \
           f"with --etcd-ca {c.other_ca.ca}" in output, output
    assert "--tls-ca" not in output and "coordinator's certificate" not in output, output


def test_a_standalone_coordinator_and_status_say_the_same(tmp_path: Path, etcds: Etcds) -> None:
    url = etcds.url(etcds.plain)
    code, output, seconds = tfelastic(tmp_path, "coordinator", "--listen", "127.0.0.1:0", "--rendezvous", url,
                                      "--etcd-ca", etcds.certs.ca.ca, "--metrics-port", "off")
    assert code == ExitCode.CONFIG and seconds < SECONDS, (seconds, output)
    assert "it serves plain text there" in output and "Traceback" not in output, output
    code, output, _ = tfelastic(tmp_path, "status", "--rendezvous", url, "--etcd-ca", etcds.certs.ca.ca)
    assert code == ExitCode.CONFIG and "it serves plain text there" in output, output
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    code, output, _ = tfelastic(tmp_path, "status", "--rendezvous", url, "--etcd-ca", str(garbage))
    assert code == ExitCode.CONFIG and "--etcd-ca" in output and "holds no PEM certificate" in output, output
