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


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("pass\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("pass\n")
    (tmp_path / "app.pyz").write_bytes(b"PK\x03\x04")
    (tmp_path / "train.pyc").write_bytes(b"\x00")
    return tmp_path


@pytest.mark.parametrize("command", [
    [PYTHON, "train.py"], [PYTHON, "train.py", "--epochs", "3"], [PYTHON, "-m", "pkg.train"],
    [PYTHON, "-m", "pkg.train", "-x"], [sys.executable, "train.py"],
])
def test_python_with_a_source_file_or_a_module_starts_warm(command: list[str], workdir: Path) -> None:
    assert interpreter_of(command, PATH, str(workdir)) == sys.executable


@pytest.mark.parametrize("command", [
    [PYTHON], [PYTHON, "-m"], [PYTHON, "-m", "-x"], [PYTHON, "-u", "train.py"], [PYTHON, "-c", "print(1)"],
    [PYTHON, "-X", "dev", "train.py"], ["bash", "train.sh"], ["torchrun", "train.py"], ["./train.py"],
    ["pythonic", "train.py"], [PYTHON, "app"], [PYTHON, "app.pyz"], [PYTHON, "train.pyc"], [PYTHON, "gone.py"],
])
def test_other_commands_start_cold(command: list[str], workdir: Path) -> None:
    """A directory, a zip archive or bytecode run by the interpreter, or a script that is not there (the cold
    start then says why), start cold."""
    assert interpreter_of(command, PATH, str(workdir)) is None


def test_a_relative_interpreter_is_found_in_the_working_directory(workdir: Path) -> None:
    (workdir / "venv" / "bin").mkdir(parents=True)
    (workdir / "venv" / "bin" / "python").symlink_to(sys.executable)
    assert interpreter_of(["venv/bin/python", "train.py"], PATH, str(workdir)) == str(workdir / "venv/bin/python")


def test_an_interpreter_not_on_the_path_starts_cold(workdir: Path) -> None:
    assert interpreter_of(["python3.99", "train.py"], str(workdir), str(workdir)) is None
    assert interpreter_of([str(workdir / "python"), "train.py"], PATH, str(workdir)) is None


def test_a_virtual_environments_link_is_not_resolved_to_the_base_interpreter(workdir: Path) -> None:
    """Python finds its environment from the path it was started as: the venv's bin/python, a link."""
    (workdir / "bin").mkdir()
    (workdir / "bin" / "python").symlink_to(sys.executable)
    assert interpreter_of(["python", "train.py"], str(workdir / "bin"), str(workdir)) == str(workdir / "bin/python")


def spec(env: dict[str, str], cwd: Path, command: tuple[str, ...] = (PYTHON, "train.py")) -> WorkerSpec:
    return WorkerSpec(command, {"PATH": PATH, **env}, str(cwd), "[rank 0]", 1.0)


GENERATION = {"TF_CONFIG": '{"cluster": {}}', "TFELASTIC_RANK": "1", "TFELASTIC_WORLD_SIZE": "2",
              "TFELASTIC_GENERATION": "7", "TFELASTIC_RESTART_COUNT": "3", "TFELASTIC_RESTORE_STEP": "120"}


def test_the_standby_gets_the_trainers_environment_less_the_generations_values() -> None:
    env = {**GENERATION, "TFELASTIC_BACKUP_DIR": "/b", "TFELASTIC_PROGRESS_SOCKET": "/s", "PYTHONPATH": "/site"}
    assert standby_env(env) == {"TFELASTIC_BACKUP_DIR": "/b", "TFELASTIC_PROGRESS_SOCKET": "/s",
                                "PYTHONPATH": "/site"}
    assert set(GENERATION) == GENERATION_KEYS


def test_a_new_generation_keeps_the_key_anything_else_changes_it(workdir: Path) -> None:
    base = {"TFELASTIC_BACKUP_DIR": "/b", "CUDA_VISIBLE_DEVICES": "0"}
    key = StandbyKey.of(spec({**base, **GENERATION}, workdir))
    assert key is not None
    assert StandbyKey.of(spec({**base, **GENERATION, "TFELASTIC_GENERATION": "8", "TFELASTIC_RANK": "0"},
                              workdir)) == key
    assert StandbyKey.of(spec({**base, "CUDA_VISIBLE_DEVICES": "1"}, workdir)) != key
    (workdir / "app" / "train.py").write_text("pass\n")
    assert StandbyKey.of(spec(base, workdir / "app")) != key
    assert StandbyKey.of(spec(base, workdir, command=(PYTHON, "-m", "train"))) != key
    assert StandbyKey.of(spec(base, workdir, command=("bash", "train.sh"))) is None


def test_an_interpreter_replaced_on_disk_changes_the_key(workdir: Path) -> None:
    interpreter = workdir / "python3"
    interpreter.write_text("#!/bin/sh\n")
    interpreter.chmod(0o755)
    before = StandbyKey.of(spec({}, workdir, command=(str(interpreter), "train.py")))
    os.utime(interpreter, (1_000_000, 1_000_000))
    after = StandbyKey.of(spec({}, workdir, command=(str(interpreter), "train.py")))
    assert before is not None and after is not None and before != after
