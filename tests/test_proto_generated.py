"""The generated gRPC code is committed; it must match proto/ exactly and the declared dependency floors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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


def _floor(requirement_prefix: str) -> tuple[int, ...]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(rf"{requirement_prefix}\s*>=", d))
    return tuple(int(p) for p in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))  # type: ignore[union-attr]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "proto" / "generate.sh"), str(tmp_path)], check=True, env=env)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (ROOT / "daemon" / name).read_text(), \
            f"daemon/{name} drifted from proto/: run proto/generate.sh and commit the result"


def test_declared_floors_are_those_of_the_generated_code() -> None:
    pb2 = (RPC / "rendezvous_pb2.py").read_text()
    protobuf = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
                         r"\s*(\d+),", pb2)
    assert protobuf is not None
    assert _floor("protobuf") == tuple(int(g) for g in protobuf.groups())
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (RPC / "rendezvous_pb2_grpc.py").read_text())
    assert grpc_version is not None
    assert _floor("grpcio") == tuple(int(p) for p in grpc_version.group(1).split("."))


@pytest.mark.integration
def test_generated_code_imports_on_the_declared_floors(tmp_path: Path) -> None:
    """Installs exactly the floor versions beside the generated code and imports it there."""
    protobuf = ".".join(map(str, _floor("protobuf")))
    grpcio = ".".join(map(str, _floor("grpcio")))
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:", "--target", str(target),
         f"protobuf=={protobuf}", f"grpcio=={grpcio}"], capture_output=True, text=True)
    if install.returncode != 0 and "No matching distribution" in install.stderr:
        pytest.skip(f"the floor versions cannot be downloaded here: {install.stderr.strip()[-300:]}")
    assert install.returncode == 0, install.stderr
    package = tmp_path / "pkg" / "tfelastic" / "daemon"
    shutil.copytree(RPC, package / "rpc")
    shutil.copytree(ROOT / "daemon" / "etcd" / "rpc", package / "etcd" / "rpc")
    (package / "__init__.py").write_text("")
    (package / "etcd" / "__init__.py").write_text("")
    probe = ("import google.protobuf, grpc; from tfelastic.daemon.rpc import rendezvous_pb2, rendezvous_pb2_grpc; "
             "from tfelastic.daemon.etcd.rpc import kv_pb2, rpc_pb2, rpc_pb2_grpc; "
             "print(google.protobuf.__version__, grpc.__version__)")
    paths = [str(target), str(tmp_path / "pkg")]
    result = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {paths!r}; {probe}"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [protobuf, grpcio]
