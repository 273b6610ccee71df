"""sd_notify against a real datagram socket, as systemd's $NOTIFY_SOCKET is one."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tfelastic.daemon.rendezvous.server import RendezvousServicer
from tfelastic.daemon.sdnotify import JournalFormatter, Notifier, stderr_is_journal, watchdog_loop

from tests.fakes import FakeClock
from tests.unit.test_rendezvous_state import running


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.setblocking(False)
    yield sock, path
    sock.close()


def received(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


def test_ready_status_and_watchdog_reach_the_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    notifier.status("joining the rendezvous at\nhead:29400")
    notifier.watchdog(extend_start_by=2.5)  # before READY: also moves TimeoutStartSec= out
    notifier.ready()
    notifier.ready()  # once only
    notifier.watchdog(extend_start_by=2.5)
    notifier.stopping("bye")
    assert received(sock) == ["STATUS=joining the rendezvous at head:29400", "WATCHDOG=1\nEXTEND_TIMEOUT_USEC=2500000",
                              "READY=1", "WATCHDOG=1", "STOPPING=1\nSTATUS=bye"]
    notifier.close()


def test_abstract_namespace_address() -> None:
    name = f"tfelastic-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.setblocking(False)
    try:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert received(sock) == ["READY=1"]
    finally:
        sock.close()


def test_the_variables_are_taken_out_of_the_environment(listener: tuple[socket.socket, str]) -> None:
    """The trainer inherits the agent's environment and must not talk to systemd."""
    env = {"NOTIFY_SOCKET": listener[1], "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
    notifier = Notifier(env)
    assert env == {"PATH": "/bin"}
    assert notifier.watchdog_seconds == 4.0


@pytest.mark.parametrize(("usec", "pid", "expected"), [
    ("4000000", "", 4.0),  # WATCHDOG_PID is optional
    ("4000000", "1", None),  # meant for another process
    ("0", "", None),
    ("soon", "", None),
    ("", "", None),
])
def test_watchdog_interval(usec: str, pid: str, expected: float | None) -> None:
    assert Notifier({"WATCHDOG_USEC": usec, "WATCHDOG_PID": pid}).watchdog_seconds == expected


def test_without_systemd_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.notify("READY=1")
    notifier.ready()
    notifier.watchdog()


def test_a_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert not notifier.notify("WATCHDOG=1")
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled  # a form this module does not speak


def test_watchdog_pings_only_while_the_control_loop_is_healthy(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "40000"})
    notifier.ready()
    answers = iter([True, False, True])
    ages: list[float] = []
    tasks: list[asyncio.Task[None]] = []

    def healthy(max_age: float) -> bool:
        ages.append(max_age)
        if len(ages) == 3:
            tasks[0].cancel()  # takes effect at the loop's next await, after this round's ping
        return next(answers)

    async def main() -> None:
        tasks.append(asyncio.create_task(watchdog_loop(notifier, healthy)))
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]

    asyncio.run(main())
    assert received(sock) == ["READY=1", "WATCHDOG=1", "WATCHDOG=1"]  # none for the unhealthy round
    assert ages == [0.02, 0.02, 0.02]  # half the interval


def test_a_coordinator_is_healthy_while_its_ticker_turns() -> None:
    """The standalone coordinator's watchdog asks whether its ticker (node timeouts, heartbeats) turned lately; a
    ticker stopped on purpose (a hand-over, the end of the job) is no fault."""
    async def scenario() -> None:
        clock = FakeClock()
        servicer = RendezvousServicer(running(clock, ["a", "b"], max_nodes=2), clock, 0.5)
        servicer.start()
        try:
            await asyncio.sleep(0)  # its first turn
            assert servicer.ticked_within(15.0)
            clock.now += 16.0  # time passes, the ticker does not turn
            assert not servicer.ticked_within(15.0)
            servicer._timers_changed.set()  # it wakes and turns
            for _ in range(3):
                await asyncio.sleep(0)
            assert servicer.ticked_within(15.0)
            servicer.stop_deciding()
            clock.now += 100.0
            assert servicer.ticked_within(15.0)
        finally:
            await servicer.stop()

    asyncio.run(scenario())


def test_watchdog_loop_returns_without_a_watchdog(listener: tuple[socket.socket, str]) -> None:
    asyncio.run(watchdog_loop(Notifier({"NOTIFY_SOCKET": listener[1]}), lambda _: True))
    assert received(listener[0]) == []


def test_journal_detection_compares_device_and_inode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with (tmp_path / "stderr").open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setattr(sys, "stderr", stream)
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert stderr_is_journal()
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")  # stderr was redirected elsewhere
        assert not stderr_is_journal()
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not stderr_is_journal()


def test_journal_lines_carry_their_priority() -> None:
    record = logging.LogRecord("tfelastic.agent", logging.WARNING, __file__, 1, "two\nlines", None, None)
    assert JournalFormatter("%(levelname)s %(message)s").format(record) == "<4>WARNING two\n<4>lines"
