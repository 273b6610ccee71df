"""Which program holds the rendezvous port (daemon/agent/hosting.py): one of ours by its arguments, never by a
path that mentions the name (a checkout in /tmp/tfelastic-clone made every foreign program look like ours)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from tfelastic.daemon.agent.hosting import Listener, listener_of


@pytest.mark.parametrize(("argv", "ours"), [
    (("/opt/venv/bin/python", "-m", "tfelastic.daemon", "run", "--nodes", "2"), True),
    (("/opt/venv/bin/tfelastic", "agent", "--config", "/etc/tfelastic/job.toml"), True),
    (("/usr/bin/python3", "/opt/venv/bin/tfelastic", "coordinator"), True),
    (("/tmp/tfelastic-clone/.venv/bin/python", "-c", "import http.server"), False),
    (("/srv/tfelastic/bin/python", "-m", "http.server", "29400"), False),
    (("nginx", "-c", "/etc/tfelastic/nginx.conf"), False),
    ((), False),
])
def test_a_listener_is_ours_by_its_arguments(argv: tuple[str, ...], ours: bool) -> None:
    assert Listener(7, argv).is_tfelastic() is ours


def test_the_listener_of_a_port_is_found_and_named() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        found = listener_of(port)
    assert found is not None and found.pid == os.getpid(), found  # this test's own listener
    assert str(found).startswith(f"pid {os.getpid()} (") and not found.is_tfelastic()


def test_a_foreign_listener_under_a_path_named_after_us_is_not_ours() -> None:
    script = "import socket, sys, time; s = socket.create_server(('127.0.0.1', 0)); print(s.getsockname()[1], " \
             "flush=True); time.sleep(60)"
    foreign = subprocess.Popen([sys.executable, "-c", script, "/tmp/tfelastic-clone"], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert foreign.stdout is not None
        port = int(foreign.stdout.readline())
        found = listener_of(port)
        assert found is not None and found.pid == foreign.pid and not found.is_tfelastic(), found
    finally:
        foreign.kill()
        foreign.wait()
