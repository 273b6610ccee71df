"""Real etcd clusters for tests: Debian's etcd-server (3.4), installed by tests/run.sh, started as N members on
loopback ports (or one member in each network-namespace host), each with its data in the test's folder.

Waits are conditions with a deadline; every member is killed when the cluster stops.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.etcd.client import EtcdClient, EtcdCredentials, EtcdError
from tfelastic.daemon.etcd.election import Election, LeaderInfo
from tfelastic.daemon.etcd.url import EtcdTarget, parse_etcd_url

from tests.cluster import wait_for
from tests.ports import free_ports

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


def require_etcd() -> None:
    if not Path(ETCD).exists():
        pytest.skip("needs etcd (Debian: apt-get install etcd-server etcd-client; tests/run.sh installs it)")


@dataclass
class Member:
    name: str
    host: str
    client_port: int
    peer_port: int
    data: Path
    log: Path
    netns: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    scheme: str = "http"


@dataclass
class EtcdCluster:
    tmp: Path
    size: int = 3
    hosts: list[str] = field(default_factory=list)  # one per member; default all 127.0.0.1
    netns: list[str] = field(default_factory=list)  # one per member, or none
    tls: tuple[str, str, str] | None = None  # (ca, cert, key) for client connections: etcds://
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        require_etcd()
        hosts = self.hosts or ["127.0.0.1"] * self.size
        for i, host in enumerate(hosts):
            ports = free_ports(2, host) if not self.netns else [2379, 2380]
            member = Member(f"m{i}", host, ports[0], ports[1], self.tmp / f"etcd-m{i}", self.tmp / f"etcd-m{i}.log",
                            self.netns[i] if self.netns else "")
            if self.tls:
                member.scheme = "https"
            self.members.append(member)

    @property
    def url(self) -> str:
        scheme = "etcds" if self.tls else "etcd"
        return f"{scheme}://" + ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    @property
    def target(self) -> EtcdTarget:
        return EtcdTarget(tuple(Endpoint(m.host, m.client_port) for m in self.members), tls=bool(self.tls))

    def start(self) -> EtcdCluster:
        for member in self.members:
            self._launch(member, "new")
        self.wait_healthy()
        return self

    def _launch(self, member: Member, state: str) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        command = [ETCD, "--name", member.name, "--data-dir", str(member.data),
                   "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
                   "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                   "--initial-cluster", initial, "--initial-cluster-state", state,
                   "--initial-cluster-token", f"tfelastic-test-{id(self)}", "--logger", "zap"]
        if self.tls:
            ca, cert, key = self.tls
            command += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
        if member.netns:
            command = ["ip", "netns", "exec", member.netns, *command]
        with open(member.log, "ab") as log:
            member.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def client(self, credentials: EtcdCredentials | None = None, timeout: float | None = None) -> EtcdClient:
        """A client of every member; `timeout` (default: the daemon's) bounds each call to one member."""
        if timeout is None:
            return EtcdClient(self.target, credentials or self._credentials())
        return EtcdClient(self.target, credentials or self._credentials(), timeout=timeout)

    def healthy(self, members: list[Member] | None = None) -> bool:
        """Every given member (default: all) answers a linearizable read."""
        async def read(member: Member) -> bool:
            client = EtcdClient(EtcdTarget((Endpoint(member.host, member.client_port),), bool(self.tls)),
                                self._credentials(), timeout=3.0)  # a fresh channel each time: room to connect
            try:
                await client.get(b"health")
                return True
            except EtcdError:
                return False
            finally:
                await client.close()

        return all(asyncio.run(read(m)) for m in (members or self.members))

    def _credentials(self) -> EtcdCredentials:
        if not self.tls:
            return EtcdCredentials()
        ca, cert, key = self.tls
        return EtcdCredentials(ca=ca, cert=cert, key=key)

    def wait_healthy(self, timeout: float = 90.0) -> None:
        """Until every running member answers. The bound is for a broken start, not a measure: under load a
        3-member start passed 30 s once (every other test keeps the cores busy meanwhile)."""
        running = [m for m in self.members if m.proc is not None and m.proc.poll() is None]
        try:
            wait_for(lambda: self.healthy(running), timeout, "the etcd cluster to answer", interval=0.2)
        except AssertionError as e:
            tails = "\n".join(f"{m.name}: {m.log.read_text(errors='replace')[-1500:]}" for m in self.members
                              if m.log.exists())
            raise AssertionError(f"{e}\n{tails}") from None

    def kill(self, index: int, sig: signal.Signals = signal.SIGKILL) -> None:
        member = self.members[index]
        assert member.proc is not None
        member.proc.send_signal(sig)
        if sig is signal.SIGKILL:
            member.proc.wait(10)

    def restart(self, index: int) -> None:
        self._launch(self.members[index], "existing")

    def etcdctl(self, *args: str, user: str = "") -> subprocess.CompletedProcess[str]:
        endpoints = ",".join(m.client_url for m in self.members)
        command = [ETCDCTL, "--endpoints", endpoints, *(["--user", user] if user else []), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=30,
                              env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})

    def stop(self) -> None:
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.kill()
                member.proc.wait(10)

    def watchers(self) -> int:
        """Watches open on the members now, as etcd counts them."""
        total = 0.0
        for member in self.members:
            with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=5) as response:
                text = response.read().decode()
            total += sum(float(line.split()[1]) for line in text.splitlines()
                         if line.startswith("etcd_debugging_mvcc_watcher_total "))
        return int(total)

    async def until_watched(self, more_than: int) -> None:
        """Until a watch beyond ``more_than`` is open: a candidate waits on the leader key."""
        while self.watchers() <= more_than:
            await asyncio.sleep(0.02)

    def logs(self) -> str:
        return "\n".join(f"===== {m.name}\n{m.log.read_text(errors='replace')[-3000:]}" for m in self.members
                         if m.log.exists())


def leader_of(url: str, job: str = "default") -> LeaderInfo | None:
    """Who etcd says coordinates ``job`` now (None: nobody, or etcd does not answer)."""
    async def read() -> LeaderInfo | None:
        client = EtcdClient(parse_etcd_url(url))
        try:
            return await Election(client, job, 2).leader(serializable=True)
        except EtcdError:
            return None
        finally:
            await client.close()

    return asyncio.run(read())
