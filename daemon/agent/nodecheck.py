"""The node check an agent runs before its node joins a generation (its first Join, and when the coordinator asks):
a failure quarantines the node with the check's message, so a bad node shows as "n2: backup dir ... is not
writable", not as a generation that dies.

Each part bounded in time: the backup directory written, fsynced and removed, with ``min_free_bytes`` free; the GPUs
through NVML (no new XID, no uncorrectable ECC error, no retirement or remapping pending); with TensorFlow and GPUs,
a small matmul on each GPU in a subprocess (:mod:`tfelastic.daemon.agent.gpu_matmul`), so a wedged driver costs a
timeout, not the agent. The coordinator adds a probe of the node's trainer port (server.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("tfelastic.agent")

MIN_FREE_BYTES = 1 << 30  # the default: below 1 GiB free a checkpoint of a mid-sized model does not fit
MATMUL_TIMEOUT_SECONDS = 120.0  # importing TensorFlow and initializing every GPU takes tens of seconds
NO_TENSORFLOW = "no GPU matmul: TensorFlow is not installed in the agent's Python, so nothing was computed on the " \
    "GPUs (only their NVML health was checked)"


@dataclass(frozen=True)
class NodeCheck:
    """``gpu_problems``: the GPU collector's health check (NVML). ``matmul_devices``: the device type the
    matmul runs on ("GPU"), or "" to skip it; by default it runs when TensorFlow is installed and NVML sees
    GPUs."""

    backup_dir: str
    node_id: str
    min_free_bytes: int = MIN_FREE_BYTES
    gpu_problems: Callable[[], list[str]] = field(default=lambda: [])
    gpu_count: Callable[[], int] = field(default=lambda: 0)
    matmul_devices: str | None = None  # None: "GPU" if TensorFlow is installed and GPUs are present
    python: str = sys.executable

    def run(self) -> str:
        """Every check in turn; the failures joined, or "" if the node is fit. Blocks: call it off the loop."""
        started = time.monotonic()
        problems = self.backup_dir_problems() + self.gpu_problems() + self.matmul_problems()
        log.info("node check %s in %.2fs", "failed" if problems else "passed", time.monotonic() - started)
        return "; ".join(problems)

    def backup_dir_problems(self) -> list[str]:
        path = self.backup_dir
        if not path:
            return []
        probe = os.path.join(path, f".tfelastic-check-{self.node_id}-{uuid.uuid4().hex}")
        try:
            os.makedirs(path, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"tfelastic node check\n")
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(probe)
            stat = os.statvfs(path)
        except OSError as e:
            return [f"backup dir {path} is not writable: {e.strerror or e}"]
        free = stat.f_bavail * stat.f_frsize
        if free < self.min_free_bytes:
            return [f"backup dir {path} has {free / 2**20:.0f} MiB free, less than the "
                    f"{self.min_free_bytes / 2**20:.0f} MiB a checkpoint needs"]
        return []

    def matmul_skipped(self) -> str:
        """Why the check computes nothing on the GPUs it sees ("" when it does, or when it sees none)."""
        if self.matmul_devices is None and self.gpu_count() > 0 and importlib.util.find_spec("tensorflow") is None:
            return NO_TENSORFLOW
        return ""

    def matmul_problems(self) -> list[str]:
        devices = self.matmul_devices
        if devices is None:
            skipped = self.matmul_skipped()
            if skipped:
                log.info("node check: %s", skipped)
            devices = "GPU" if self.gpu_count() > 0 and not skipped else ""
        if not devices:
            return []
        command = [self.python, "-m", "tfelastic.daemon.agent.gpu_matmul", devices]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=MATMUL_TIMEOUT_SECONDS,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return [f"a small matmul on each {devices} did not finish within {MATMUL_TIMEOUT_SECONDS:g}s"]
        except OSError as e:
            return [f"cannot run the {devices} matmul check: {e}"]
        if done.returncode != 0:
            # Its own verdict is the last line on stdout; a crash leaves only stderr (TensorFlow logs there too).
            last = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:] or \
                [f"exit code {done.returncode}"]
            return [f"the {devices} matmul check failed: {last[0][:300]}"]
        return []


class PortListener:
    """Listens on the worker port for the coordinator's probe, between a checked Join and its answer. It never
    accepts: the kernel completes the probe's handshake, and closing drops it, before the trainer binds."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = None

    def open(self, port: int) -> str:
        """Listens; returns what keeps it from listening ("" if nothing): the trainer would not bind either."""
        self.close()
        try:
            self._socket = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:  # no IPv6 here (a network namespace without it): IPv4 alone
            try:
                self._socket = socket.create_server(("0.0.0.0", port))
            except OSError as e:
                return f"cannot listen on the worker port {port}: {e.strerror or e} (another process holds it? " \
                       "free it, or choose another --worker-port)"
        return ""

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
