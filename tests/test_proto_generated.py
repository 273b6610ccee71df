"""The generated gRPC code is committed; it must match proto/ exactly and run on the whole declared range of
protobuf and grpcio: from the floors in pyproject.toml to the newest releases below the caps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RPC = ROOT / "daemon" / "rpc"
GENERATED = ("rpc/rendezvous_pb2.py", "rpc/rendezvous_pb2.pyi", "rpc/rendezvous_pb2_grpc.py",
             "etcd/rpc/kv_pb2.py", "etcd/rpc/kv_pb2.pyi", "etcd/rpc/rpc_pb2.py", "etcd/rpc/rpc_pb2.pyi",
             "etcd/rpc/rpc_pb2_grpc.py")
# What the generated code and the gRPC layer around it depend on; their floors are checked by running
# GRPC_TESTS on exactly those versions.
GRPC_PACKAGES = ("protobuf", "grpcio", "grpcio-health-checking")
# The suite's tests of the gRPC layer: tfelastic's protocol and health service in process, real agents over
# real gRPC, and etcd's API (skipped without an etcd binary).
GRPC_TESTS = ("tests/unit/test_handshake_failures.py", "tests/integration/test_limits.py",
              "tests/integration/test_control_plane.py::test_worker_exit_restarts_the_whole_set_and_resumes",
              "tests/integration/test_control_plane.py::test_standalone_coordinator_and_agents_from_job_files",
              "tests/integration/test_etcd_client.py")


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _requirement(name: str) -> str:
    dependencies = _project()["dependencies"]
    assert isinstance(dependencies, list)
    return next(str(d) for d in dependencies if re.match(rf"{re.escape(name)}\s*[<>=!~]", d))


def _floor(name: str) -> str:
    match = re.search(r">=\s*([\d.]+)", _requirement(name))
    assert match is not None, f"pyproject.toml declares no floor for {name}"
    return match.group(1)


def _cap(name: str) -> str:
    match = re.search(r"<\s*([\d.]+)", _requirement(name))
    return match.group(1) if match else ""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "proto" / "generate.sh"), str(tmp_path)], check=True, env=env)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (ROOT / "daemon" / name).read_text(), \
            f"daemon/{name} drifted from proto/: run proto/generate.sh and commit the result"


def test_declared_grpcio_floor_is_that_of_the_generated_code() -> None:
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (RPC / "rendezvous_pb2_grpc.py").read_text())
    assert grpc_version is not None
    assert _version(_floor("grpcio")) == _version(grpc_version.group(1))


def test_generated_code_does_not_refuse_protobuf_4() -> None:
    """Code from protobuf >= 5.27's generator refuses every older runtime; TensorFlow 2.16-2.19 need protobuf 4.x."""
    for name in GENERATED:
        assert "ValidateProtobufRuntimeVersion" not in (ROOT / "daemon" / name).read_text(), \
            f"daemon/{name} refuses protobuf runtimes older than its generator: see proto/generate.sh"
    assert _version(_floor("protobuf")) < (5,)


def _venv_with(tmp_path: Path, requirements: list[str]) -> Path:
    """A virtual environment with `requirements`, the other runtime dependencies and the test tools, that
    imports tfelastic from this checkout."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    dependencies = _project()["dependencies"]
    extras = _project()["optional-dependencies"]
    assert isinstance(dependencies, list) and isinstance(extras, dict)
    others = [d for d in dependencies if not any(re.match(rf"{re.escape(n)}\s*[<>=!~]", d) for n in GRPC_PACKAGES)]
    test_tools = [d for d in extras["dev"] if re.match(r"(pytest|pytest-timeout|hypothesis)\s*[<>=]", d)]
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--only-binary=:all:",
                              *requirements, *others, *test_tools], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    # The installed layout (tfelastic.daemon, tfelastic.trainer) as links into the checkout, as tests/lint.sh does.
    tree = tmp_path / "tree" / "tfelastic"
    tree.mkdir(parents=True)
    (tree / "daemon").symlink_to(ROOT / "daemon")
    (tree / "trainer").symlink_to(ROOT / "trainer")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "tfelastic-checkout.pth").write_text(f"{tree.parent}\n")
    return python


def _versions_in(python: Path) -> dict[str, str]:
    probe = ("import importlib.metadata as m, json; "
             f"print(json.dumps({{n: m.version(n) for n in {GRPC_PACKAGES!r}}}))")
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True).stdout
    versions: dict[str, str] = json.loads(out)
    return versions


@pytest.mark.integration
@pytest.mark.parametrize("edge", ["floors", "newest"])
def test_grpc_layer_runs_on_the_edges_of_the_declared_range(edge: str, tmp_path: Path) -> None:
    """Runs GRPC_TESTS in a virtual environment with exactly the declared floors of protobuf, grpcio and
    grpcio-health-checking, and in one with the newest releases that the caps admit."""
    if edge == "floors":
        requirements = [f"{name}=={_floor(name)}" for name in GRPC_PACKAGES]
    else:
        requirements = [f"{name}<{_cap(name)}" if _cap(name) else name for name in GRPC_PACKAGES]
    python = _venv_with(tmp_path, requirements)
    versions = _versions_in(python)
    if edge == "floors":
        assert versions == {name: _floor(name) for name in GRPC_PACKAGES}
    # Warnings are errors: the generated code warns when grpcio is older than its generator.
    result = subprocess.run([str(python), "-W", "error::RuntimeWarning", "-c",
                             "from tfelastic.daemon.rpc import rendezvous_pb2, rendezvous_pb2_grpc; "
                             "from tfelastic.daemon.etcd.rpc import kv_pb2, rpc_pb2, rpc_pb2_grpc"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # A short base: the agents' unix sockets live under it, and their paths may not exceed 107 bytes.
    with tempfile.TemporaryDirectory(prefix="tfe-") as basetemp:
        tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                                basetemp, *GRPC_TESTS], cwd=ROOT, capture_output=True, text=True)
    assert tests.returncode == 0, f"on {versions}:\n{tests.stdout[-6000:]}\n{tests.stderr[-2000:]}"
    assert re.search(r"\d+ passed", tests.stdout.splitlines()[-1]), tests.stdout[-2000:]
