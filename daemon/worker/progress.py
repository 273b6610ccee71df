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


class ProgressListener:
    def __init__(self, on_message: Callable[[ProgressMessage], None], runtime_dir: str | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="tfelastic-", dir=runtime_dir)  # mkdtemp makes it 0700
        self.path = os.path.join(self._dir, "progress.sock")
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
