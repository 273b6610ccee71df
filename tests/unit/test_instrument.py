"""The automatic instrumentation: the agent's environment injection (daemon/worker/instrument.py), the injected
sitecustomize (trainer/instrument/sitedir), and the wrapped ``Model.fit`` (trainer/instrument), each run in a real
Python subprocess with the environment the agent would give it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.cli import build_parser, config_from_run_args
from tfelastic.daemon.config_file import load_toml
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.worker.instrument import instrumentation_env
from tfelastic.trainer.instrument import ENABLE_ENV, OFF_VALUES, SITE_DIR

# ------------------------------------------------------------------------------------- environment injection


def test_puts_the_site_dir_on_pythonpath() -> None:
    assert instrumentation_env({}, True) == {"PYTHONPATH": SITE_DIR}
    assert instrumentation_env({"PYTHONPATH": ""}, True) == {"PYTHONPATH": SITE_DIR}


@pytest.mark.parametrize("user_path", ["/opt/lib", "/a:/b", ":/a", "/a::/b"])
def test_keeps_the_users_pythonpath_verbatim_after_the_site_dir(user_path: str) -> None:
    # Empty entries mean the working directory: they must survive as they were.
    assert instrumentation_env({"PYTHONPATH": user_path}, True) == {"PYTHONPATH": f"{SITE_DIR}:{user_path}"}


def test_adds_nothing_when_the_site_dir_is_already_there() -> None:
    assert instrumentation_env({"PYTHONPATH": f"/a:{SITE_DIR}"}, True) == {}


def test_disabled_by_the_agent_setting_also_switches_off_an_inherited_site_dir() -> None:
    assert instrumentation_env({"PYTHONPATH": SITE_DIR}, False) == {ENABLE_ENV: "0"}


@pytest.mark.parametrize("value", [*sorted(OFF_VALUES), "OFF", " False "])
def test_disabled_by_the_environment(value: str) -> None:
    assert instrumentation_env({ENABLE_ENV: value}, True) == {}


def test_the_site_dir_holds_only_sitecustomize() -> None:
    # Everything in it shadows modules of the trainer's program: it must stay a single file.
    assert sorted(p.name for p in Path(SITE_DIR).iterdir() if p.name != "__pycache__") == ["sitecustomize.py"]


# ----------------------------------------------------------------------------------- the injected sitecustomize

PROBE = """
import sys
print("finder:", any(type(f).__name__ == "TfelasticFitFinder" for f in sys.meta_path))
print("tfelastic modules:", sorted(m for m in sys.modules if m.startswith("tfelastic")))
print("args:", sys.argv[1:])
sys.exit(int(sys.argv[1]))
"""
WHICH_SITE = "import sitecustomize, sys\nprint('sitecustomize:', sitecustomize.__file__)\n"


def run_python(code: str, env: Mapping[str, str], *args: str, executable: str = sys.executable,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([executable, "-c", code, *args], env=dict(env), capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def trainer_env(base: Mapping[str, str] | None = None, instrument: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", ENABLE_ENV)}
    env.update(base or {})
    env.update(instrumentation_env(env, instrument))
    return env


@pytest.fixture
def user_site(tmp_path: Path) -> Path:
    """A directory with a sitecustomize of the user's own, as a venv or the distribution would have."""
    site = tmp_path / "user-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nprint('user sitecustomize ran', flush=True)\n"
                                           "os.environ['USER_SITE_RAN'] = '1'\n")
    return site


def test_a_program_without_tensorflow_runs_unchanged() -> None:
    plain = run_python(PROBE, trainer_env(instrument=False), "3", "x y")
    instrumented = run_python(PROBE, trainer_env(), "3", "x y")
    assert plain.returncode == instrumented.returncode == 3
    assert instrumented.stderr == plain.stderr == ""
    # The only difference: the finder is installed. Nothing of tfelastic is imported at start-up (the editable
    # install's own finder excepted), so a program that never imports tf_keras pays nothing more.
    assert instrumented.stdout == plain.stdout.replace("finder: False", "finder: True"), instrumented.stdout
    assert "finder: True" in instrumented.stdout
    modules = next(line for line in instrumented.stdout.splitlines() if line.startswith("tfelastic modules:"))
    assert "tfelastic.trainer" not in modules


def test_an_existing_sitecustomize_still_runs(user_site: Path) -> None:
    result = run_python(WHICH_SITE + PROBE, trainer_env({"PYTHONPATH": str(user_site)}), "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("user sitecustomize ran\n"), result.stdout
    assert "finder: True" in result.stdout
    # ``import sitecustomize`` still gives the environment's own module.
    assert f"sitecustomize: {user_site / 'sitecustomize.py'}" in result.stdout
    # And what it did to the process is there.
    env_check = run_python("import os; print(os.environ.get('USER_SITE_RAN'))",
                           trainer_env({"PYTHONPATH": str(user_site)}))
    assert env_check.stdout.splitlines() == ["user sitecustomize ran", "1"]


def test_an_existing_sitecustomize_that_fails_is_reported_by_python_as_before(user_site: Path) -> None:
    (user_site / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
    env = trainer_env({"PYTHONPATH": str(user_site)})
    result = run_python("print('main ran')", env)
    without = run_python("print('main ran')", trainer_env({"PYTHONPATH": str(user_site)}, instrument=False))
    assert result.returncode == without.returncode == 0
    assert result.stdout == without.stdout == "main ran\n"
    assert "Error in sitecustomize" in without.stderr and "broken site" in without.stderr
    assert result.stderr == without.stderr


@pytest.mark.parametrize("value", [*sorted(OFF_VALUES), "OFF"])
def test_switched_off_in_the_trainers_environment_it_only_chains(user_site: Path, value: str) -> None:
    # The agent injected the directory, then the trainer (or a wrapper script) set TFELASTIC_INSTRUMENT.
    env = trainer_env({"PYTHONPATH": str(user_site)})
    env[ENABLE_ENV] = value
    result = run_python(PROBE, env, "0")
    assert result.returncode == 0, result.stderr
    assert "finder: False" in result.stdout
    assert "user sitecustomize ran" in result.stdout


def test_without_tfelastic_in_the_interpreter_it_warns_once_and_fit_is_untouched(tmp_path: Path) -> None:
    """A trainer run by an interpreter that lacks tfelastic: the module is found, cannot be instrumented, and
    the script goes on. tf_keras is replaced by a stand-in here, since that interpreter has no TensorFlow."""
    base = getattr(sys, "_base_executable", sys.executable)
    if run_python("import tfelastic", {}, executable=base).returncode == 0:
        pytest.skip("the base interpreter can import tfelastic")
    package = tmp_path / "fake" / "tf_keras" / "src" / "engine"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "training.py").write_text("class Model:\n    def fit(self, callbacks=None):\n        return callbacks\n")
    code = ("from tf_keras.src.engine import training\nfrom tf_keras.src.engine import training as again\n"
            "print(training.Model().fit(callbacks=['mine']))\n")
    env = trainer_env({"PYTHONPATH": str(tmp_path / "fake")})
    result = run_python(code, env, executable=base)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "['mine']\n"
    assert result.stderr.count("tfelastic: automatic progress reporting is off") == 1, result.stderr
    assert "tfelastic" in result.stderr and "ModuleNotFoundError" in result.stderr


# ----------------------------------------------------------------------------------------- model.fit, for real

FITS = """
import inspect, sys
import numpy as np
import tensorflow as tf
from tf_keras.src.engine import training
from tfelastic.trainer.callbacks import ProgressCallback

x, y = np.zeros((8, 4), np.float32), np.zeros((8, 1), np.float32)  # batch_size 4: 2 steps per fit
model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(4,))])
model.compile("sgd", "mse")
model.fit(x, y, batch_size=4, verbose=0)                                  # steps 1-2: instrumented
model.fit(x, y, batch_size=4, verbose=0, callbacks=[ProgressCallback()])  # steps 3-4: the script's own only
mine = [tf.keras.callbacks.History()]
model.fit(x, y, 4, 1, 0, mine)                                            # steps 5-6: callbacks positional
model.fit(x, y, batch_size=4, verbose=0, callbacks=tf.keras.callbacks.CallbackList([], model=model))  # 7-8: as given
print("user list untouched:", len(mine) == 1)
print("loader:", type(training.__loader__).__name__, type(training.__spec__.loader).__name__)
print("finder left:", any(type(f).__name__ == "TfelasticFitFinder" for f in sys.meta_path))
print("source:", "def fit(" in inspect.getsource(training.Model.fit))
"""


class ProgressListener:
    """The agent's end of the progress socket, read in a thread while the trainer runs, as the agent reads it:
    a Unix datagram socket queues at most net.unix.max_dgram_qlen datagrams (10 on some hosts), and the
    trainer's non-blocking send drops what does not fit, so reading only after the trainer exited loses reports."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.05)
        self._messages: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._read, name="progress-listener", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                self._messages.append(json.loads(self._sock.recv(65536)))
            except TimeoutError:
                if self._done.is_set():  # the trainer exited and the queue is empty
                    return

    def received(self) -> list[dict[str, Any]]:
        """Every report, once the trainer has exited."""
        self._done.set()
        self._reader.join()
        return self._messages

    def close(self) -> None:
        self._done.set()
        self._reader.join()
        self._sock.close()


@pytest.fixture
def progress_socket(tmp_path: Path) -> Iterator[ProgressListener]:
    listener = ProgressListener(str(tmp_path / "progress.sock"))
    yield listener
    listener.close()


@pytest.mark.tensorflow
def test_fit_reports_progress_once_per_fit_without_doubling_the_scripts_own(
        progress_socket: ProgressListener) -> None:
    env = trainer_env({"TFELASTIC_PROGRESS_SOCKET": progress_socket.path, "TFELASTIC_GENERATION": "5",
                       "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"})
    result = run_python(FITS, env)
    assert result.returncode == 0, result.stderr
    assert "tfelastic:" not in result.stderr
    assert result.stdout.splitlines() == ["user list untouched: True", "loader: SourceFileLoader SourceFileLoader",
                                          "finder left: False", "source: True"]
    messages = progress_socket.received()
    assert {m["g"] for m in messages} == {5}
    # One "done" per ProgressCallback that ran: one per fit, none for the CallbackList given as is.
    assert Counter(m["step"] for m in messages if m.get("done")) == {2: 1, 4: 1, 6: 1}, messages
    assert {m["step"] for m in messages} >= {0, 2, 4, 6}  # each fit reports its start (force) and its end


SAVES = """
import numpy as np
import tensorflow as tf

x, y = np.zeros((24, 4), np.float32), np.zeros((24, 1), np.float32)  # batch_size 4: 6 steps per epoch
model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(4,))])
model.compile("sgd", "mse")
savers = [tf.keras.callbacks.BackupAndRestore("backup", save_freq=2),
          tf.keras.callbacks.ModelCheckpoint("mc/ckpt", save_weights_only=True, save_freq=3)]
model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=savers)
"""


@pytest.mark.tensorflow
def test_an_unmodified_scripts_own_savers_are_announced_before_they_save(
        progress_socket: ProgressListener, tmp_path: Path) -> None:
    env = trainer_env({"TFELASTIC_PROGRESS_SOCKET": progress_socket.path, "TFELASTIC_GENERATION": "1",
                       "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"})
    result = run_python(SAVES, env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    messages = progress_socket.received()
    # BackupAndRestore saves at steps 2, 4, 6, 8, 10, 12; ModelCheckpoint at 3, 6, 9, 12 (one report per batch
    # where either saves). The start of fit is a setup phase; each epoch ends on a save here, which covers it.
    assert [m["step"] for m in messages if m.get("ph") == "save"] == [2, 3, 4, 6, 8, 9, 10, 12], messages
    # The script's BackupAndRestore found nothing to restore (reported), then fit starts: both at step 0.
    assert [(m["step"], m.get("rt")) for m in messages if m.get("ph") == "setup"] == [(0, "none"), (0, None)], messages



# ------------------------------------------------------------------------------------------------- the setting


def write_job(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\ncommand = ["python", "train.py"]\n{extra}\n[rendezvous]\nendpoint = "127.0.0.1:29400"\n')
    return str(path)


def test_on_by_default_and_off_with_the_flag() -> None:
    parser = build_parser()
    base = ["run", "--rendezvous", "127.0.0.1:29400"]
    trainer = ["--", "python", "t.py"]
    assert config_from_run_args(parser.parse_args([*base, *trainer])).job.instrument is True
    assert config_from_run_args(parser.parse_args([*base, "--no-instrument", *trainer])).job.instrument is False


def test_job_file_key(tmp_path: Path) -> None:
    assert load_toml(write_job(tmp_path, "")).job.instrument is True
    assert load_toml(write_job(tmp_path, "instrument = false")).job.instrument is False


def test_job_file_key_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"job\.instrument: 'no' must be true or false"):
        load_toml(write_job(tmp_path, 'instrument = "no"'))
