"""Every command that reads a secret refuses a file that the group or others can read: exit 78, and one line
that names the option, the file, its mode and the chmod that fixes it. (tests/unit/test_config.py covers more
modes of read_token; tests/integration/test_cli_errors.py the world-readable token of `run`.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.quick]

LOOPBACK = "127.0.0.1:29400"


@pytest.mark.parametrize("mode", [0o640, 0o604], ids=["group-readable", "other-readable"])
@pytest.mark.parametrize(("args", "option"), [
    (["run", "--rendezvous", LOOPBACK, "--token-file", "{path}", "--", "true"], "--token-file"),
    (["coordinator", "--listen", LOOPBACK, "--token-file", "{path}"], "--token-file"),
    (["status", "--rendezvous", LOOPBACK, "--token-file", "{path}"], "--token-file"),
    (["run", "--rendezvous", LOOPBACK, "--metrics-token-file", "{path}", "--", "true"], "--metrics-token-file"),
], ids=["run", "coordinator", "status", "metrics-token"])
def test_a_secret_others_can_read_is_refused(tmp_path: Path, mode: int, args: list[str], option: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef\n")
    os.chmod(secret, mode)
    command = [sys.executable, "-m", "tfelastic.daemon", *(a.format(path=secret) for a in args)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 78, result.stderr
    assert result.stderr.splitlines() == [
        f"tfelastic: configuration error: {option}: {str(secret)!r} is readable by other users (mode {mode:o}); "
        f"run: chmod 600 {secret}"]
    assert "0123456789abcdef" not in result.stderr + result.stdout  # the secret itself is never printed
