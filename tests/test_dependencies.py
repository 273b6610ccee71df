"""Every TensorFlow minor version that the trainer extras admit can be installed beside tfelastic's own
requirements: pip resolves them, one minor version at a time, without installing anything.

The supported range lives in one place, the `trainer` extra in pyproject.toml (`tensorflow>=2.A,<2.B`); this
test reads it. It needs PyPI (or the configured index). pip resolves from the wheels' metadata: from the
index's PEP 658 files where it serves them, otherwise through HTTP range requests (`fast-deps`), so TensorFlow's
wheels are not downloaded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.environments import PROJECT, name_of, supported_tensorflow_minors

# Distributions that must all come at the pinned minor version: two TensorFlows of different versions in one
# environment overwrite each other's files.
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tf-keras")


def requirements_of(extra: str) -> list[str]:
    """tfelastic[extra]'s requirements, with the extras that name tfelastic itself expanded."""
    expanded = list(PROJECT["dependencies"])
    for requirement in PROJECT["optional-dependencies"][extra]:
        own = re.fullmatch(r"tfelastic\[([\w-]+)\]", requirement)
        expanded += requirements_of(own.group(1))[len(PROJECT["dependencies"]):] if own else [requirement]
    return expanded


def resolve(requirements: list[str]) -> tuple[dict[str, str] | None, str]:
    """What pip would install for `requirements` into an empty environment, or None and pip's complaint."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--only-binary=:all:", "--report", "-", *requirements]
    result = subprocess.run([*command[:4], "--use-feature=fast-deps", *command[4:]], capture_output=True, text=True)
    if result.returncode != 0 and "fast-deps" in result.stderr:  # a pip that no longer has the feature
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return None, result.stderr
    report = json.loads(result.stdout)
    return {name_of(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}, \
        result.stderr


def test_the_supported_range_is_read_from_the_trainer_extra() -> None:
    assert supported_tensorflow_minors()[0] == "2.16"
    assert requirements_of("trainer-cpu") == requirements_of("trainer")


@pytest.mark.integration
@pytest.mark.parametrize("extra", ["trainer", "trainer-cpu"])
def test_every_supported_tensorflow_resolves_with_our_requirements(extra: str) -> None:
    minors = supported_tensorflow_minors()
    with ThreadPoolExecutor(max_workers=len(minors)) as pool:
        outcomes = dict(zip(minors, pool.map(lambda minor: resolve([*requirements_of(extra),
                                                                     f"tensorflow=={minor}.*"]), minors), strict=True))
    failures = {minor: complaint for minor, (installed, complaint) in outcomes.items() if installed is None}
    assert not failures, f"cannot be installed beside tfelastic[{extra}]:\n" + "\n".join(
        f"tensorflow=={minor}.*:\n{complaint[-1500:]}" for minor, complaint in failures.items())
    for minor, (installed, _) in outcomes.items():
        assert installed is not None
        assert "tf-keras" in installed, f"tensorflow=={minor}.* without tf-keras: {installed}"
        for name in TENSORFLOW_DISTRIBUTIONS:
            assert installed.get(name, f"{minor}.0").startswith(f"{minor}."), \
                f"tensorflow=={minor}.* brought {name} {installed[name]}: two TensorFlow versions in one environment"


@pytest.mark.integration
def test_the_report_extra_brings_tensorboard_without_tensorflow() -> None:
    installed, complaint = resolve(requirements_of("report"))
    assert installed is not None, complaint[-1500:]
    assert "tensorboard" in installed
    assert not {name for name in installed if name.startswith(("tensorflow", "tf-", "keras"))}, installed
