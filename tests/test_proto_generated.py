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

from tests.environments import ROOT, cap, floor, venv_with

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
    assert _version(floor("grpcio")) == _version(grpc_version.group(1))


def test_generated_code_does_not_refuse_protobuf_4() -> None:
    """Code from protobuf >= 5.27's generator refuses every older runtime; TensorFlow 2.16-2.19 need protobuf 4.x."""
    for name in GENERATED:
        assert "ValidateProtobufRuntimeVersion" not in (ROOT / "daemon" / name).read_text(), \
            f"daemon/{name} refuses protobuf runtimes older than its generator: see proto/generate.sh"
    assert _version(floor("protobuf")) < (5,)


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
        requirements = [f"{name}=={floor(name)}" for name in GRPC_PACKAGES]
    else:
        requirements = [f"{name}<{cap(name)}" if cap(name) else name for name in GRPC_PACKAGES]
    python = venv_with(tmp_path, requirements)
    versions = _versions_in(python)
    if edge == "floors":
        assert versions == {name: floor(name) for name in GRPC_PACKAGES}
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
