"""pyproject.toml's requirements, and virtual environments built from them, for the tests that run tfelastic on
other versions of its dependencies than the test command's own environment: the edges of the declared protobuf
and grpcio range (test_proto_generated.py), every supported TensorFlow (test_dependencies.py), the lowest one
run for real (test_tensorflow_floor.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def name_of(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert found is not None, requirement
    return re.sub(r"[-_.]+", "-", found.group(0)).lower()


def requirement(name: str) -> str:
    """The runtime requirement on ``name``, as declared."""
    return next(str(d) for d in PROJECT["dependencies"] if name_of(d) == name)


def floor(name: str) -> str:
    match = re.search(r">=\s*([\d.]+)", requirement(name))
    assert match is not None, f"pyproject.toml declares no floor for {name}"
    return match.group(1)


def cap(name: str) -> str:
    match = re.search(r"<\s*([\d.]+)", requirement(name))
    return match.group(1) if match else ""


def supported_tensorflow_minors() -> list[str]:
    """The minor versions `2.A` .. `2.(B-1)` of the trainer extra's `tensorflow>=2.A,<2.B`."""
    declared = next(r for r in PROJECT["optional-dependencies"]["trainer"] if re.match(r"tensorflow\s*>=", r))
    match = re.fullmatch(r"tensorflow\s*>=\s*2\.(\d+)\s*,\s*<\s*2\.(\d+)", declared)
    assert match is not None, f"expected tensorflow>=2.A,<2.B in the trainer extra, found {declared!r}"
    return [f"2.{minor}" for minor in range(int(match.group(1)), int(match.group(2)))]


def venv_with(folder: Path, requirements: list[str]) -> Path:
    """A virtual environment in ``folder`` with ``requirements``, the other runtime dependencies as declared and
    the test tools, that imports tfelastic from this checkout. Returns its python."""
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    given = {name_of(r) for r in requirements}
    others = [d for d in PROJECT["dependencies"] if name_of(d) not in given]
    test_tools = [d for d in PROJECT["optional-dependencies"]["dev"]
                  if name_of(d) in ("pytest", "pytest-timeout", "hypothesis")]
    # --no-compile: the install would byte-compile every module of TensorFlow's wheel; a test imports a fraction
    # of them, compiled as they are imported.
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--only-binary=:all:", "--no-compile",
                              *requirements, *others, *test_tools], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    # The installed layout (tfelastic.daemon, tfelastic.trainer) as links into the checkout, as tests/lint.sh does.
    tree = folder / "tree" / "tfelastic"
    tree.mkdir(parents=True)
    (tree / "daemon").symlink_to(ROOT / "daemon")
    (tree / "trainer").symlink_to(ROOT / "trainer")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "tfelastic-checkout.pth").write_text(f"{tree.parent}\n")
    return python
