"""Checks that depend on this machine, run before anything starts: the trainer command exists, the files named
can be read, the ports are free, the backup directory can be written, the secrets are readable by us alone.

Each failure is a :class:`ConfigError` naming the option, so the process exits 78 with one line and no traceback.
One check only warns: a local checkpoint tier that cannot be written, or whose directories are not this user's own,
turns the fast tier off for the run (:func:`local_tier_or_off`).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import ssl
import tempfile

from tfelastic.daemon.config import AgentConfig, MetricsConfig, RendezvousConfig
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.etcd.client import EtcdCredentials
from tfelastic.daemon.etcd.url import EtcdTarget
from tfelastic.daemon.netutil import is_local_address, port_taken, route_address
from tfelastic.daemon.secret_file import read_secret, read_token
from tfelastic.trainer import snapshots


def raise_open_files_limit() -> tuple[int, int]:
    """Raises the soft limit on open files to the hard one (a shell's `ulimit -n` is often 1024: a coordinator
    holds an fd per connection, and /metrics and the worker need their own). Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        with open("/proc/sys/fs/nr_open") as f:  # the kernel's own ceiling for the soft limit
            target = int(f.read())
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logging.getLogger("tfelastic").warning("cannot raise the open files limit from %d to %d: %s", soft,
                                                   target, e)
            return soft, soft
        return soft, target
    return soft, soft


def token_for(endpoint: Endpoint, token_file: str, option: str = "--token-file", where: str = "") -> str | None:
    """Reads the token; a non-loopback endpoint without one is refused (``where``: how to name it, if not as
    the endpoint the user gave)."""
    if token_file:
        return read_token(token_file, option)
    if not endpoint.is_loopback():
        where = where or str(endpoint)
        raise ConfigError(f"{option}: {where} is not a loopback address, so a shared token is required; "
                          "create one with 'openssl rand -hex 32 > token && chmod 600 token' and pass "
                          f"{option} token")
    return None


def coordinator_listen(config: AgentConfig) -> Endpoint:
    """Where this agent's coordinator listens: the rendezvous endpoint, or with etcd, this node's address (the
    route to etcd unless --advertise-address) and --coordinator-port."""
    rdzv = config.rendezvous
    if isinstance(rdzv.endpoint, Endpoint):
        return rdzv.endpoint
    return Endpoint(config.node.advertise_address or route_address(rdzv.route_host), rdzv.coordinator_port)


def etcd_credentials(rdzv: RendezvousConfig) -> EtcdCredentials | None:
    """What this process presents to etcd: TLS files, and USER:PASSWORD from --etcd-password-file (a secret: a
    file only its owner may read, like the token)."""
    if rdzv.etcd is None:
        return None
    user = password = ""
    if rdzv.etcd_password_file:
        secret = read_secret(rdzv.etcd_password_file, "--etcd-password-file", words=False)
        user, sep, password = secret.partition(":")
        if not sep or not user or not password:
            raise ConfigError(f"--etcd-password-file: {rdzv.etcd_password_file!r} must hold USER:PASSWORD on one "
                              "line (etcd's own user, as etcdctl --user takes it)")
    return EtcdCredentials(rdzv.etcd_ca, rdzv.etcd_cert, rdzv.etcd_key, user, password)


def check_etcd_files(rdzv: RendezvousConfig) -> None:
    """The TLS files for etcd can be read and are what they claim: otherwise gRPC fails only at the first
    connection, with "Failed to create security handshaker" and no word of which file."""
    _check_readable(("--etcd-ca", rdzv.etcd_ca), ("--etcd-cert", rdzv.etcd_cert), ("--etcd-key", rdzv.etcd_key))
    if rdzv.etcd_ca:
        _check_certificates("--etcd-ca", rdzv.etcd_ca)
    if rdzv.etcd_cert:
        _check_certificates("--etcd-cert", rdzv.etcd_cert)
        _check_key_pair(("--etcd-cert", rdzv.etcd_cert), ("--etcd-key", rdzv.etcd_key))


def _check_certificates(option: str, path: str) -> None:
    """``path`` holds PEM certificates that OpenSSL can read."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise ConfigError(f"{option}: {path!r} holds no PEM certificate, or one that cannot be read (OpenSSL: "
                          f"{e.reason or e.strerror or e}); give a PEM file ('-----BEGIN CERTIFICATE-----')") \
            from None
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path!r}: {e.strerror or e}") from None


def _check_key_pair(cert: tuple[str, str], key: tuple[str, str]) -> None:
    """``key`` is the unencrypted PEM private key of ``cert``, as gRPC needs it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert[1], key[1], password=lambda: b"")  # an encrypted key fails, never prompts
    except ssl.SSLError as e:
        raise ConfigError(f"{key[0]}: {key[1]!r} is not the private key of {cert[0]} {cert[1]!r}, or not an "
                          f"unencrypted PEM key (OpenSSL: {e.reason or e.strerror or e})") from None
    except OSError as e:
        raise ConfigError(f"{key[0]}: cannot read {key[1]!r}: {e.strerror or e}") from None


def metrics_token(metrics: MetricsConfig) -> str | None:
    file = metrics.token_file
    return read_token(file, "--metrics-token-file") if file else None


def check_agent(config: AgentConfig) -> None:
    """Everything an agent needs of this machine."""
    job = config.job
    workdir = job.workdir or "."
    if not os.path.isdir(workdir):
        raise ConfigError(f"--workdir: {workdir!r} is not a directory")
    program = job.command[0]
    found = (os.access(os.path.join(workdir, program), os.X_OK) if "/" in program
             else shutil.which(program, path=dict(job.env).get("PATH", os.environ.get("PATH"))))
    if not found:
        raise ConfigError(f"trainer command: {program!r} was not found or is not executable; "
                          "give a program on PATH or a path to an executable")
    tls = config.rendezvous.tls
    check_tls_files(tls)
    check_etcd_files(config.rendezvous)
    endpoint = config.rendezvous.endpoint
    may_coordinate = isinstance(endpoint, EtcdTarget) or is_local_address(endpoint.host)
    if may_coordinate and tls.enabled and not tls.cert:
        why = "every agent of an etcd job may be elected coordinator" if isinstance(endpoint, EtcdTarget) else \
            f"this node owns {endpoint} and may host the coordinator"
        raise ConfigError(f"--tls-cert/--tls-key: {why}, which needs a certificate and key to serve TLS")
    address = config.node.advertise_address
    if address and not is_local_address(address):
        raise ConfigError(f"--advertise-address: {address!r} is not an address of this machine")
    check_metrics_listen(config.metrics)
    check_backup_dir(config)


def check_backup_dir(config: AgentConfig) -> None:
    """The trainer must be able to write its checkpoints; under systemd's ProtectSystem=strict a backup_dir
    outside ReadWritePaths= would otherwise fail only at the first save, as a worker failure."""
    path = existing = config.resolved_backup_dir()  # absolute
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--backup-dir: {path!r} cannot be written by this user ({existing} is read-only "
                          "or not writable); fix its permissions, or under systemd add it to ReadWritePaths= "
                          "(docs/operations.md)")


def local_tier_or_off(config: AgentConfig) -> AgentConfig:
    """The configuration to run with: unchanged when the local checkpoint tier can be created and written and each
    of its levels (ROOT/JOB/NODE) is this user's own directory, mode 0700 (snapshots hold the model's weights, and
    /dev/shm is open to every user); else with the fast tier off and a WARNING. Not a failure: the tier only makes
    recovery faster (the trainers still checkpoint to the backup dir), and /dev/shm may be missing or read-only in
    a container."""
    tier = config.local_tier()  # ROOT/JOB/NODE: the trainer writes there
    if tier is None:
        return config
    try:
        snapshots.make_private_dirs(config.node.local_checkpoint_dir, tier)
        with tempfile.NamedTemporaryFile(dir=tier, prefix=".tfelastic-check-"):
            pass
    except snapshots.UnsafeTierError as e:
        logging.getLogger("tfelastic").warning(
            "--local-checkpoint-dir: %s: another user could read or replace the snapshots there, so the "
            "node-local snapshot tier is off for this run; remove it, or give a root of this user's own", e)
        return config.replace(local_checkpoint_dir="")
    except OSError as e:
        logging.getLogger("tfelastic").warning(
            "--local-checkpoint-dir: cannot write %s (%s): the node-local snapshot tier is off for this run; "
            "trainers checkpoint to the backup dir only", tier, e.strerror or e)
        return config.replace(local_checkpoint_dir="")
    return config


def check_metrics_listen(metrics: MetricsConfig) -> None:
    if metrics.port and port_taken(metrics.address, metrics.port):
        raise ConfigError(f"--metrics-port: {metrics.address}:{metrics.port} is in use; give each agent on this "
                          "host its own port (0 picks a free one)")


def check_tls_files(tls: TlsConfig) -> None:
    _check_readable(("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca))


def _check_readable(*files: tuple[str, str]) -> None:
    """Each (option, path) given is a file this process can read."""
    for option, path in files:
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{option}: cannot read {path!r}")
