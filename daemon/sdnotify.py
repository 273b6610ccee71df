"""systemd integration: sd_notify(3) over ``$NOTIFY_SOCKET``, the watchdog, and journald detection. Plain socket
code, no libsystemd; every call is a no-op outside systemd.

What the agent tells systemd (``Type=notify``): ``READY=1`` once the coordinator took its Join (so a successful
``systemctl start`` means a valid config, an accepted token and job); ``STATUS=`` what it does; ``WATCHDOG=1``
every quarter of ``WatchdogSec=`` while its control loop is healthy, with ``EXTEND_TIMEOUT_USEC`` before READY
(a healthy agent waiting for its coordinator outlives ``TimeoutStartSec=``, a wedged one does not). Never
``STOPPING=1``: an agent that ends on its own may still serve a coordinator until the job ends, which
``TimeoutStopSec=`` would cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tfelastic.sdnotify")

_ENV_NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _socket_address(text: str) -> str | bytes | None:
    """The address of ``$NOTIFY_SOCKET``: a path, or ``@name`` for Linux's abstract namespace."""
    if text.startswith("@"):
        return b"\0" + text[1:].encode()
    if text.startswith("/"):
        return text
    return None  # vsock: and other forms that newer systemd versions use are not supported


class Notifier:
    """Sends sd_notify messages. Reads (and removes, like ``sd_notify(unset_environment=1)``) the variables
    from ``environ``, so that the trainer, which inherits the agent's environment, never talks to systemd."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        values = {name: env.pop(name, "") for name in _ENV_NAMES}
        self._address = _socket_address(values["NOTIFY_SOCKET"]) if values["NOTIFY_SOCKET"] else None
        if values["NOTIFY_SOCKET"] and self._address is None:
            log.warning("NOTIFY_SOCKET=%r is not a path or an abstract address; not notifying systemd",
                        values["NOTIFY_SOCKET"])
        self.watchdog_seconds = _watchdog_seconds(values["WATCHDOG_USEC"], values["WATCHDOG_PID"])
        self._sock: socket.socket | None = None
        self._ready = False
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Sends one datagram of ``KEY=VALUE`` lines; True if it was sent. Never raises: systemd going away
        must not take the agent (and its worker) down."""
        if self._address is None:
            return False
        payload = "\n".join(a.replace("\n", " ") for a in assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self._address)
        except OSError as e:
            if not self._failed:  # once, not on every ping
                log.warning("cannot notify systemd at %r: %s", self._address, e)
            self._failed = True
            return False
        return True

    def ready(self, status: str = "") -> None:
        """READY=1, once: systemd ignores later ones, but they would be noise in a trace."""
        if self._ready:
            return
        self._ready = True
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def stopping(self, status: str = "") -> None:
        self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self, extend_start_by: float | None = None) -> None:
        """WATCHDOG=1; before READY also EXTEND_TIMEOUT_USEC, which moves TimeoutStartSec= out."""
        extra = [] if extend_start_by is None or self._ready else [f"EXTEND_TIMEOUT_USEC={int(extend_start_by * 1e6)}"]
        self.notify("WATCHDOG=1", *extra)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_seconds(usec: str, pid: str) -> float | None:
    """The watchdog interval systemd asked for, if it is meant for this process (``$WATCHDOG_PID``)."""
    if not usec:
        return None
    try:
        seconds = int(usec) / 1e6
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r / WATCHDOG_PID=%r: not numbers", usec, pid)
        return None
    return seconds if seconds > 0 else None


async def watchdog_loop(notifier: Notifier, healthy: Callable[[float], bool]) -> None:
    """Pings systemd's watchdog every quarter interval while ``healthy(max_age)`` holds.

    It runs on the daemon's event loop, so a blocked loop stops it, and ``healthy`` checks that the control loop
    itself still turns (the agent's tick, the coordinator's ticker, at most ``max_age``, half the interval, old). A
    wedged daemon therefore stops pinging, and systemd kills and restarts it one interval later.
    """
    interval = notifier.watchdog_seconds
    if interval is None or not notifier.enabled:
        return
    period, max_age = interval / 4, interval / 2
    unhealthy = False
    while True:
        if healthy(max_age):
            notifier.watchdog(extend_start_by=interval)
            if unhealthy:
                log.warning("the control loop is ticking again; watchdog pings resumed")
            unhealthy = False
        elif not unhealthy:
            unhealthy = True
            log.error("the control loop has not ticked for over %gs; no watchdog ping, systemd will restart "
                      "this daemon if it does not recover within %gs", max_age, interval)
        await asyncio.sleep(period)


def stderr_is_journal() -> bool:
    """Whether stderr is connected to journald (``$JOURNAL_STREAM`` names its device and inode)."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    with contextlib.suppress(OSError, ValueError):
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    return False


@dataclass
class ServiceHooks:
    """How the agent tells the service manager what it does: its status lines (STATUS=), that the coordinator has
    taken it in (READY=1), and that its exit code is decided with what is left bounded by the seconds given (the
    daemon arms its exit guard then: exit_guard.py)."""

    status: Callable[[str], None] = lambda text: None
    ready: Callable[[], None] = lambda: None
    exit_decided: Callable[[int, float], object] = lambda code, seconds: None


class Supervised(Protocol):
    """What :func:`run_notifying` needs of the agent (daemon/agent/agent.py)."""

    hooks: ServiceHooks

    def control_loop_healthy(self, max_age: float) -> bool: ...

    async def run(self) -> int: ...


async def run_notifying(agent: Supervised, notifier: Notifier, first_status: str) -> int:
    """Runs the agent with its systemd hooks: STATUS= from its status lines, READY=1 once the coordinator has
    taken it in, and the watchdog task on the agent's own loop."""
    previous = agent.hooks.status

    def on_status(text: str) -> None:
        previous(text)
        notifier.status(text)

    agent.hooks.status = on_status
    agent.hooks.ready = notifier.ready
    notifier.status(first_status)
    try:
        async with watchdog_pinging(notifier, agent.control_loop_healthy):
            return await agent.run()
    finally:
        notifier.close()


@contextlib.asynccontextmanager
async def watchdog_pinging(notifier: Notifier, healthy: Callable[[float], bool]) -> AsyncIterator[None]:
    """The watchdog task (:func:`watchdog_loop`) on the running loop while the block runs, for the agent and the
    standalone coordinator alike."""
    if notifier.watchdog_seconds is not None:
        faulthandler.enable(all_threads=True)  # a watchdog kill (SIGABRT) leaves every thread's stack in the log
    pinger = asyncio.create_task(watchdog_loop(notifier, healthy))
    try:
        yield
    finally:
        pinger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pinger


_PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    """Puts the syslog priority before every line (``<4>...``), which journald stores as PRIORITY=, so that
    ``journalctl -p warning`` works; journald adds the time stamp itself."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITIES.get(record.levelno, 6)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


def journal_handler(fmt: str) -> logging.Handler | None:
    """A stderr handler in journald's format if stderr is the journal, else None."""
    if not stderr_is_journal():
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter(fmt))
    return handler
