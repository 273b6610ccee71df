"""`tfelastic install JOB` in a scratch root, the --help examples and the shell completion: what an operator
meets before the first job runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import ROOT

pytestmark = pytest.mark.integration

TFELASTIC = [sys.executable, "-m", "tfelastic.daemon"]
SUBCOMMANDS = ("agent", "run", "coordinator", "status", "drain", "readmit", "report", "restart", "demo", "install",
               "completion")


def tfelastic(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TFELASTIC, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_install_stages_the_units_and_a_job_file_that_the_agent_reads(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = tfelastic("install", "mnist", "--destdir", str(root), "--prefix", "/opt/tfe", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    units = root / "etc" / "systemd" / "system"
    agent_unit, head_unit = (units / "tfelastic@.service").read_text(), (units / "tfelastic-coordinator@.service")
    assert "ExecStart=/opt/tfe/bin/tfelastic agent --config /etc/tfelastic/%i.toml" in agent_unit
    assert "ExecStart=/opt/tfe/bin/tfelastic coordinator --config /etc/tfelastic/%i.toml" in head_unit.read_text()
    job_file = root / "etc" / "tfelastic" / "mnist.toml"
    assert job_file.stat().st_mode & 0o777 == 0o640
    from tfelastic.daemon.cli import config_from_file

    config = config_from_file(str(job_file), environ={})
    assert (config.job.name, config.job.backup_dir) == ("mnist", "/shared/ckpt/mnist")
    job_file.write_text(job_file.read_text() + "# the operator's edit\n")
    again = tfelastic("install", "mnist", "--destdir", str(root), "--prefix", "/opt/tfe", cwd=tmp_path)
    assert again.returncode == 0 and f"kept {job_file} (exists)" in again.stdout, again
    assert job_file.read_text().endswith("# the operator's edit\n")


def test_install_never_follows_a_symlink_planted_where_others_may_write(tmp_path: Path) -> None:
    """The temporary names were predictable (.JOB.toml.new, .tfelastic@.service.new): a link planted there made a
    root installer overwrite and re-mode the link's target. Now fresh names are made exclusively, and a target
    that is a link, or a directory others may write, is refused."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    units, conf = root / "etc" / "systemd" / "system", root / "etc" / "tfelastic"
    units.mkdir(parents=True)
    conf.mkdir(mode=0o750)
    for planted in (units / ".tfelastic@.service.new", conf / ".mnist.toml.new"):
        planted.symlink_to(victim)
    result = tfelastic("install", "mnist", "--destdir", str(root), "--prefix", "/opt/tfe", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o600
    assert (conf / "mnist.toml").is_file() and not (conf / "mnist.toml").is_symlink()

    (conf / "other.toml").symlink_to(victim)
    refused = tfelastic("install", "other", "--destdir", str(root), "--prefix", "/opt/tfe", cwd=tmp_path)
    assert refused.returncode == 78 and f"{conf / 'other.toml'} is a symbolic link" in refused.stderr, refused
    conf.chmod(0o777)
    refused = tfelastic("install", "third", "--destdir", str(root), "--prefix", "/opt/tfe", cwd=tmp_path)
    assert refused.returncode == 1 and f"{conf} is writable by users other than its owner (mode 777)" in \
        refused.stderr, refused
    assert not (conf / "third.toml").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["install", "two words"], "JOB: 'two words' must be non-empty letters, digits"),
    (["install", "mnist", "--prefix", "/nonexistent"], "--prefix: /nonexistent/bin/tfelastic does not exist"),
])
def test_install_refuses_what_would_make_a_broken_unit(args: list[str], message: str, tmp_path: Path) -> None:
    result = tfelastic(*args, cwd=tmp_path)
    assert result.returncode == 78 and message in result.stderr, result
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_help_ends_with_examples_of_itself(command: str, tmp_path: Path) -> None:
    result = tfelastic(command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    examples = result.stdout.split("\nexamples:\n", 1)[1]
    assert f"tfelastic {command}" in examples and "TFELASTIC_<OPTION>" in examples


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(("words", "expected"), [
    (["tfelastic", "sta"], ["status"]),
    (["tfelastic", "status", "--wa"], ["--watch"]),
    (["tfelastic", "drain", "gpu-03", "--for"], ["--force"]),
    (["tfelastic", "run", "--token-file", str(ROOT / "pyproject.to")], [str(ROOT / "pyproject.toml")]),
])
def test_bash_completion_knows_the_subcommands_and_their_flags(words: list[str], expected: list[str],
                                                                tmp_path: Path) -> None:
    completion = tfelastic("completion", "bash", cwd=tmp_path)
    assert completion.returncode == 0, completion.stderr
    (tmp_path / "completion.sh").write_text(completion.stdout)
    probe = (f'source {tmp_path / "completion.sh"}; COMP_WORDS=({" ".join(words)}); COMP_CWORD={len(words) - 1}; '
             '_tfelastic; printf "%s\\n" "${COMPREPLY[@]}"')
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected
