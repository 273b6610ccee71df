"""The wheel is what a node without a checkout installs: it must carry the code, the generated gRPC stubs,
the license, the metadata, and the systemd and monitoring assets, byte for byte the repository's files."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.packaged_files import ROOT, shipped_files

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What a build must not see: local environments, earlier builds (setuptools reuses build/lib), caches.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                                    ".hypothesis")


def _normalized(requirement: str) -> tuple[str, tuple[str, ...], str]:
    """name, sorted specifiers, marker: the same requirement as pyproject.toml and METADATA each write it."""
    text, _, marker = re.sub(r"\s", "", requirement).replace("'", '"').partition(";")
    name = re.match(r"[A-Za-z0-9_.-]+", text)
    assert name is not None, requirement
    return name.group(0).lower(), tuple(sorted(text[name.end():].split(","))), marker


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source") / "tfelastic"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(source)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    (path,) = out.glob("tfelastic-*.whl")
    path.with_suffix(".log").write_text(build.stdout + build.stderr)  # the build's own output, for its checks
    return path


@pytest.mark.integration
def test_the_build_warns_of_nothing_in_our_configuration(wheel: Path) -> None:
    """setuptools' warnings about the project's own configuration (a folder shipped as package data that Python
    can import, a deprecated key) print on every install: there must be none."""
    log = wheel.with_suffix(".log").read_text()
    warnings = [line.strip() for line in log.splitlines()
                if re.search(r"(BuildBackend|SetuptoolsDeprecation|Setuptools)Warning", line)]
    assert not warnings, "\n".join(warnings)


@pytest.mark.integration
def test_wheel_carries_the_assets_the_code_and_the_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for name in shipped_files():
            member = f"tfelastic/share/{name}"
            assert member in names, f"the wheel lacks {name} (package-data in pyproject.toml)"
            assert archive.read(member) == (ROOT / name).read_bytes(), name
        install_script = archive.getinfo("tfelastic/share/systemd/install.sh")
        assert (install_script.external_attr >> 16) & stat.S_IXUSR, "install.sh lost its executable bit"
        for module in ("tfelastic/daemon/cli.py", "tfelastic/daemon/assets.py", "tfelastic/daemon/py.typed",
                       "tfelastic/daemon/rpc/rendezvous_pb2.py", "tfelastic/daemon/rpc/rendezvous_pb2.pyi",
                       "tfelastic/daemon/etcd/rpc/rpc_pb2_grpc.py", "tfelastic/trainer/py.typed",
                       "tfelastic/trainer/instrument/sitedir/sitecustomize.py"):
            assert module in names, module
        assert {n.split("/")[0] for n in names} == {"tfelastic", wheel.name.split("-py3")[0] + ".dist-info"}, \
            "the wheel carries more than the package (tests, benchmarks, docs?)"
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        assert archive.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    classifiers = metadata.get_all("Classifier", [])
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert "Programming Language :: Python :: 3.10" in classifiers
    requires = [r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r]
    assert sorted(map(_normalized, requires)) == sorted(map(_normalized, PROJECT["dependencies"]))
    assert "tfelastic = tfelastic.daemon.cli:main" in entry_points


@pytest.mark.integration
def test_installed_wheel_finds_its_assets_outside_any_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    probe = ("import sys; from tfelastic.daemon.assets import packaged; "
             "[print(packaged(name)) for name in sys.argv[1:]]")
    names = shipped_files()
    found = subprocess.run([python, "-I", "-c", probe, *names], cwd=tmp_path, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    for name, location in zip(names, found.stdout.split(), strict=True):
        path = Path(location)
        assert path.is_relative_to(venv), f"{name} was found at {path}, not in the installed wheel"
        assert path.read_bytes() == (ROOT / name).read_bytes(), name
    assert (venv / "lib").exists()
    installed_script = next(Path(p) for p in found.stdout.split() if p.endswith("install.sh"))
    assert installed_script.stat().st_mode & stat.S_IXUSR


@pytest.mark.integration
def test_tfelastic_install_from_the_wheel_needs_no_checkout(wheel: Path, tmp_path: Path) -> None:
    """`tfelastic install` of an installed wheel stages the units and the job file from the wheel's own copies.
    The wheel's dependencies come from the test's environment (a .pth file), tfelastic itself from the wheel."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    root = tmp_path / "root"
    done = subprocess.run([str(venv / "bin" / "tfelastic"), "install", "mnist", "--destdir", str(root)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    unit = (root / "etc/systemd/system/tfelastic@.service").read_text()
    assert f"ExecStart={venv}/bin/tfelastic agent --config /etc/tfelastic/%i.toml" in unit  # this environment's
    assert (root / "etc/systemd/system/tfelastic-coordinator@.service").exists()
    assert 'name = "mnist"' in (root / "etc/tfelastic/mnist.toml").read_text()
    where = subprocess.run([str(python), "-I", "-c", "import tfelastic.daemon; print(tfelastic.daemon.__file__)"],
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where  # the wheel's code ran, not the checkout's
