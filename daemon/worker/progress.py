"""The agent's end of the progress channel: a Unix datagram socket in a private (0700) directory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable

from tfelastic.trainer.progress import MAX_DATAGRAM, ProgressMessage, decode

log = logging.getLogger("tfelastic.progress")


SOCKET_NAME = "progress.sock"
SUN_PATH_MAX = 107  # sockaddr_un's sun_path: 108 bytes with the terminating NUL
SHORT_RUNTIME_DIR = "/tmp"


def private_dir(runtime_dir: str | None) -> str:
    """A new 0700 directory (mkdtemp's mode) for the socket: under ``runtime_dir`` (default: $TMPDIR), or under
    /tmp where that would make the socket's path longer than a Unix socket's may be (a deep $TMPDIR)."""
    directory = tempfile.mkdtemp(prefix="tfelastic-", dir=runtime_dir)
    if len(os.fsencode(os.path.join(directory, SOCKET_NAME))) <= SUN_PATH_MAX:
        return directory
    os.rmdir(directory)
    short = tempfile.mkdtemp(prefix="tfelastic-", dir=SHORT_RUNTIME_DIR)
    log.warning("the progress socket's directory %s would make its path longer than the %d bytes a Unix socket's "
                "may have: it is %s instead (set a shorter TMPDIR to keep it there)", directory, SUN_PATH_MAX, short)
    return short


class ProgressListener:
    def __init__(self, on_message: Callable[[ProgressMessage], None], runtime_dir: str | None = None) -> None:
        self._dir = private_dir(runtime_dir)
        self.path = os.path.join(self._dir, SOCKET_NAME)
        # The trainer's step mark (trainer/progress.py), made anew by the agent before each launch.
        self.step_file = os.path.join(self._dir, "step")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.setblocking(False)
        self._on_message = on_message
        self._malformed = 0

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._drain)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _drain(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            try:
                message = decode(data)
            except ValueError as e:
                self._malformed += 1
                if self._malformed <= 3:
                    log.warning("ignored a malformed progress report: %s", e)
                continue
            self._on_message(message)
