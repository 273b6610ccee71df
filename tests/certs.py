"""Test certificates made with the openssl CLI: no Python crypto dependency.

A :class:`Pki` is one private CA that signs leaf certificates. ``openssl ca`` (not ``openssl x509 -req``) signs
them because it takes explicit validity dates (``-startdate``/``-enddate``) on every OpenSSL from 1.1 on; that
is how an already expired certificate is made without faking the clock. Keys are P-256: fast to generate.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tfelastic.daemon.endpoint import TlsConfig

_CA_CONFIG = """\
[ca]
default_ca = test_ca
[test_ca]
database = {db}/index.txt
new_certs_dir = {db}
rand_serial = yes
default_md = sha256
policy = any_name
copy_extensions = none
unique_subject = no
[any_name]
commonName = supplied
[leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
"""

# Long past, so the certificate is expired whatever the machine's clock says (2020-01-01 to 2020-01-02).
EXPIRED = ("20200101000000Z", "20200102000000Z")


def openssl(cwd: Path, *args: str) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str


@dataclass(frozen=True)
class Pki:
    """A CA in ``folder``: ``ca.pem`` and ``ca.key``, and the leaves it signed."""

    folder: Path

    @property
    def ca(self) -> str:
        return str(self.folder / "ca.pem")

    @classmethod
    def create(cls, folder: Path, name: str) -> Pki:
        folder.mkdir(parents=True)
        (folder / "db").mkdir()
        (folder / "db" / "index.txt").write_text("")
        (folder / "ca.cnf").write_text(_CA_CONFIG.format(db=folder / "db"))
        openssl(folder, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-days", "3", "-subj", f"/CN={name}", "-keyout", "ca.key", "-out", "ca.pem")
        return cls(folder)

    def leaf(self, name: str, validity: tuple[str, str] | None = None) -> Leaf:
        """A certificate for ``name`` (SAN 127.0.0.1 and localhost, server and client use), valid for 2 days
        from now, or between the two ``YYYYMMDDHHMMSSZ`` dates of ``validity``."""
        key, csr, cert = (str(self.folder / f"{name}.{ext}") for ext in ("key", "csr", "pem"))
        openssl(self.folder, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-subj", f"/CN={name}", "-keyout", key, "-out", csr)
        dates = ["-startdate", validity[0], "-enddate", validity[1]] if validity else ["-days", "2"]
        openssl(self.folder, "ca", "-batch", "-notext", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key",
                "-extensions", "leaf", "-in", csr, "-out", cert, *dates)
        return Leaf(cert, key)


@dataclass(frozen=True)
class Certificates:
    """Everything the TLS tests need: a trusted CA and an unrelated one, each with server and client leaves."""

    ca: Pki
    other_ca: Pki
    server: Leaf
    client: Leaf
    expired_server: Leaf
    expired_client: Leaf
    other_server: Leaf  # signed by other_ca
    other_client: Leaf  # signed by other_ca

    def server_tls(self, leaf: Leaf | None = None, *, mutual: bool) -> TlsConfig:
        """A coordinator's settings; ``mutual``: require client certificates signed by the trusted CA."""
        leaf = leaf or self.server
        return TlsConfig(cert=leaf.cert, key=leaf.key, ca=self.ca.ca if mutual else "")

    def client_tls(self, leaf: Leaf | None = None, *, trust: Pki | None = None) -> TlsConfig:
        """An agent's settings: trust ``trust`` (default: the right CA), present ``leaf`` if given."""
        return TlsConfig(cert=leaf.cert if leaf else "", key=leaf.key if leaf else "", ca=(trust or self.ca).ca)


def make_certificates(folder: Path) -> Certificates:
    ca = Pki.create(folder / "ca", "tfelastic-test-ca")
    other = Pki.create(folder / "other-ca", "unrelated-ca")
    return Certificates(
        ca=ca, other_ca=other,
        server=ca.leaf("server"), client=ca.leaf("client"),
        expired_server=ca.leaf("expired-server", EXPIRED), expired_client=ca.leaf("expired-client", EXPIRED),
        other_server=other.leaf("server"), other_client=other.leaf("client"),
    )
