"""Which trainer commands start warm, and what a standby is built for (daemon/worker/warm.py): no processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from tfelastic.daemon.worker.process import WorkerSpec
from tfelastic.daemon.worker.warm import GENERATION_KEYS, StandbyKey, interpreter_of, standby_env

PATH = os.path.dirname(sys.executable)
PYTHON = os.path.basename(sys.executable)


@pytest.mark.parametrize("command", [
    [PYTHON, "train.py"], [PYTHON, "train.py", "--epochs", "3"], [PYTHON, "-m", "pkg.train"],
    [PYTHON, "-m", "pkg.train", "-x"], [sys.executable, "train.py"],
])
def test_python_with_a_script_or_a_module_starts_warm(command: list[str]) -> None:
    assert interpreter_of(command, PATH) == sys.executable


@pytest.mark.parametrize("command", [
    [PYTHON], [PYTHON, "-m"], [PYTHON, "-m", "-x"], [PYTHON, "-u", "train.py"], [PYTHON, "-c", "print(1)"],
    [PYTHON, "-X", "dev", "train.py"], ["bash", "train.sh"], ["torchrun", "train.py"], ["./train.py"],
    ["pythonic", "train.py"],
])
def test_other_commands_start_cold(command: list[str]) -> None:
    assert interpreter_of(command, PATH) is None


def test_an_interpreter_not_on_the_path_starts_cold(tmp_path: Path) -> None:
    assert interpreter_of(["python3.99", "train.py"], str(tmp_path)) is None
    assert interpreter_of([str(tmp_path / "python"), "train.py"], PATH) is None


def test_a_virtual_environments_link_is_not_resolved_to_the_base_interpreter(tmp_path: Path) -> None:
    """Python finds its environment from the path it was started as: the venv's bin/python, a link."""
    (tmp_path / "python").symlink_to(sys.executable)
    assert interpreter_of(["python", "train.py"], str(tmp_path)) == str(tmp_path / "python")


def spec(env: dict[str, str], command: tuple[str, ...] = (PYTHON, "train.py"), cwd: str = "/tmp") -> WorkerSpec:
    return WorkerSpec(command, {"PATH": PATH, **env}, cwd, "[rank 0]", 1.0)


GENERATION = {"TF_CONFIG": '{"cluster": {}}', "TFELASTIC_RANK": "1", "TFELASTIC_WORLD_SIZE": "2",
              "TFELASTIC_GENERATION": "7", "TFELASTIC_RESTART_COUNT": "3"}


def test_the_standby_gets_the_trainers_environment_less_the_generations_values() -> None:
    env = {**GENERATION, "TFELASTIC_BACKUP_DIR": "/b", "TFELASTIC_PROGRESS_SOCKET": "/s", "PYTHONPATH": "/site"}
    assert standby_env(env) == {"TFELASTIC_BACKUP_DIR": "/b", "TFELASTIC_PROGRESS_SOCKET": "/s",
                                "PYTHONPATH": "/site"}
    assert set(GENERATION) == GENERATION_KEYS


def test_a_new_generation_keeps_the_key_anything_else_changes_it() -> None:
    base = {"TFELASTIC_BACKUP_DIR": "/b", "CUDA_VISIBLE_DEVICES": "0"}
    key = StandbyKey.of(spec({**base, **GENERATION}))
    assert key is not None
    assert StandbyKey.of(spec({**base, **GENERATION, "TFELASTIC_GENERATION": "8", "TFELASTIC_RANK": "0"})) == key
    assert StandbyKey.of(spec({**base, "CUDA_VISIBLE_DEVICES": "1"})) != key
    assert StandbyKey.of(spec(base, cwd="/var")) != key
    assert StandbyKey.of(spec(base, command=(PYTHON, "-m", "train"))) != key
    assert StandbyKey.of(spec(base, command=("bash", "train.sh"))) is None


def test_an_interpreter_replaced_on_disk_changes_the_key(tmp_path: Path) -> None:
    interpreter = tmp_path / "python3"
    interpreter.write_text("#!/bin/sh\n")
    interpreter.chmod(0o755)
    before = StandbyKey.of(spec({}, command=(str(interpreter), "train.py")))
    os.utime(interpreter, (1_000_000, 1_000_000))
    after = StandbyKey.of(spec({}, command=(str(interpreter), "train.py")))
    assert before is not None and after is not None and before != after
