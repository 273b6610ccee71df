"""The lowest TensorFlow that the trainer extra names, run for real. The test command's own environment has the
highest (the whole suite runs on it); this test builds a virtual environment with the lowest minor version's
tensorflow, tf-keras and tensorboard, and runs there the suite's TensorFlow tests of the trainer library, of an
unmodified script under the instrumentation, and of jobs recovering under real agents (FLOOR_TESTS).

It needs the package index (TensorFlow's wheel is about 600 MB; pip's cache keeps it between runs).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.environments import ROOT, requirement, supported_tensorflow_minors, venv_with

FLOOR_TESTS = ("tests/unit/test_instrument.py", "tests/integration/test_examples.py",
               "tests/integration/test_unmodified_script.py", "tests/integration/test_tensorflow.py")
TENSORFLOW_PACKAGES = ("tensorflow", "tf-keras", "tensorboard")


@pytest.mark.integration
@pytest.mark.tensorflow
@pytest.mark.timeout(2400)  # the install of a 600 MB wheel and four test files: about 7 minutes on 2 cores
def test_the_lowest_supported_tensorflow_runs_the_tensorflow_tests(tmp_path: Path) -> None:
    lowest = supported_tensorflow_minors()[0]
    grpc = [requirement(name) for name in ("protobuf", "grpcio", "grpcio-health-checking")]
    python = venv_with(tmp_path, [*(f"{name}=={lowest}.*" for name in TENSORFLOW_PACKAGES), *grpc])
    probe = subprocess.run([str(python), "-c", "import tensorflow as tf, tf_keras; print(tf.__version__, "
                            "tf_keras.__version__)"], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert all(v.startswith(f"{lowest}.") for v in probe.stdout.split()), probe.stdout
    # A short base: the agents' unix sockets live under it, and their paths may not exceed 107 bytes.
    with tempfile.TemporaryDirectory(prefix="tfe-") as basetemp:
        tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                                basetemp, *FLOOR_TESTS], cwd=ROOT, capture_output=True, text=True)
    assert tests.returncode == 0, f"on TensorFlow {probe.stdout}:\n{tests.stdout[-6000:]}\n{tests.stderr[-2000:]}"
    assert re.search(r"\d+ passed", tests.stdout.splitlines()[-1]), tests.stdout[-2000:]
