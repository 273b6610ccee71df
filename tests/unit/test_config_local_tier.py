"""The node-local checkpoint tier's option (``--local-checkpoint-dir``, ``node.local_checkpoint_dir``): its default,
'off', the checks of the path (exit 78, naming the option), and the preflight that turns an unwritable tier off
with a warning instead of failing."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tfelastic.daemon.cli import build_parser, config_from_run_args, main
from tfelastic.daemon.config import AgentConfig, from_values, validate
from tfelastic.daemon.config_file import load_toml
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.preflight import local_tier_or_off
from tfelastic.trainer import snapshots

BASE = from_values({"command": ("python", "train.py"), "rendezvous": Endpoint("127.0.0.1", 29400),
                    "node_id": "node-a", "job": "mnist"})


def run(*flags: str) -> AgentConfig:
    args = build_parser().parse_args(["run", "--rendezvous", "127.0.0.1:29400", "--job", "mnist", "--node-id",
                                      "node-a", *flags, "--", "python"])
    return config_from_run_args(args, None)


def toml(tmp_path: Path, line: str = "") -> AgentConfig:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nname = "mnist"\ncommand = ["python"]\n[node]\nid = "node-a"\n' + line +
                    '\n[rendezvous]\nendpoint = "127.0.0.1:29400"\n')
    return load_toml(str(path))


USER_ROOT = f"/dev/shm/tfelastic-{os.geteuid()}"  # the default root: one per user


def test_the_tier_is_on_by_default_under_dev_shm_one_directory_per_user_job_and_node(tmp_path: Path) -> None:
    for config in (BASE, run(), toml(tmp_path)):
        assert config.node.local_checkpoint_dir == snapshots.LOCAL_ROOT_DEFAULT == USER_ROOT
        assert config.local_tier() == f"{USER_ROOT}/mnist/node-a"
        assert config.local_tier() == snapshots.local_store_root(USER_ROOT, "mnist", "node-a")


def test_a_root_of_its_own(tmp_path: Path) -> None:
    assert run("--local-checkpoint-dir", "/mnt/nvme/tfe").local_tier() == "/mnt/nvme/tfe/mnist/node-a"
    config = toml(tmp_path, 'local_checkpoint_dir = "/mnt/nvme/tfe"')
    assert config.node.local_checkpoint_dir == "/mnt/nvme/tfe"
    assert config.local_tier() == "/mnt/nvme/tfe/mnist/node-a"


@pytest.mark.parametrize("off", ["off", ""])
def test_off_or_empty_turns_the_tier_off(tmp_path: Path, off: str) -> None:
    for config in (run("--local-checkpoint-dir", off), toml(tmp_path, f'local_checkpoint_dir = "{off}"'),
                   validate(BASE.replace(local_checkpoint_dir=off))):
        assert config.local_tier() is None
    assert run("--local-checkpoint-dir", off).node.local_checkpoint_dir == ""  # 'off' is stored as ""


def test_a_relative_path_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError) as excinfo:
        run("--local-checkpoint-dir", "shm/tfe")
    assert str(excinfo.value) == ("--local-checkpoint-dir: 'shm/tfe' is a relative path; give an absolute "
                                  f"directory, e.g. {USER_ROOT}, or 'off' to turn the local tier off")


def test_a_relative_path_in_a_file_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        toml(tmp_path, 'local_checkpoint_dir = "tfe"')
    assert str(excinfo.value).startswith(f"{tmp_path / 'job.toml'}: node.local_checkpoint_dir: 'tfe' is a relative "
                                         "path")


@pytest.mark.parametrize(("line", "message"), [
    ("local_checkpoint_dir = 5", "node.local_checkpoint_dir: 5 must be a str"),
    ("local_checkpoint_dir = false", "node.local_checkpoint_dir: False must be a str"),
])
def test_a_value_that_is_not_a_path_in_a_file_names_the_key(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        toml(tmp_path, line)


def test_an_oversized_path_is_refused() -> None:
    with pytest.raises(ConfigError, match="--local-checkpoint-dir: a path of 4098 characters must have at most 4096"):
        validate(BASE.replace(local_checkpoint_dir="/" + "d" * 4097))


def test_a_bad_flag_exits_78(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--rendezvous", "127.0.0.1:29400", "--local-checkpoint-dir", "rel", "--", "python"]) == 78
    assert "--local-checkpoint-dir: 'rel' is a relative path" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- preflight


def test_a_writable_root_keeps_the_tier_and_creates_the_nodes_directory(tmp_path: Path) -> None:
    config = BASE.replace(local_checkpoint_dir=str(tmp_path / "shm"))
    assert local_tier_or_off(config) is config
    tier = tmp_path / "shm" / "mnist" / "node-a"
    assert tier.is_dir() and os.listdir(tier) == []  # the probe file is gone
    assert tier.stat().st_mode & 0o777 == 0o700  # the model's weights: not for other users of /dev/shm


def test_an_unwritable_root_turns_the_tier_off_with_a_warning(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "shm").write_text("a file where the root should be")  # fails as a missing /dev/shm would
    config = BASE.replace(local_checkpoint_dir=str(tmp_path / "shm"))
    with caplog.at_level(logging.WARNING, "tfelastic"):
        checked = local_tier_or_off(config)
    assert checked.local_tier() is None and checked.node.local_checkpoint_dir == ""
    assert checked.replace(local_checkpoint_dir=config.node.local_checkpoint_dir) == config  # nothing else changes
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"--local-checkpoint-dir: cannot write {tmp_path}/shm/mnist/node-a" in record.getMessage()
    assert "the node-local snapshot tier is off for this run" in record.getMessage()


def test_a_tier_that_is_off_is_not_checked(tmp_path: Path) -> None:
    config = BASE.replace(local_checkpoint_dir="")
    assert local_tier_or_off(config) is config


NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="building another user's directories needs root")


def tier_levels(root: Path) -> list[Path]:
    return [root, root / "mnist", root / "mnist" / "node-a"]


def off_with_warning(config: AgentConfig, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.WARNING, "tfelastic"):
        checked = local_tier_or_off(config)
    assert checked.local_tier() is None and checked.node.local_checkpoint_dir == ""
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "another user could read or replace the snapshots there, so the node-local snapshot tier is off for " \
           "this run; remove it, or give a root of this user's own" in record.getMessage()
    return record.getMessage()


@needs_root
@pytest.mark.parametrize("theirs", [0, 1, 2, 3], ids=["root-job-and-node", "job-and-node", "node", "root-only"])
def test_a_tier_another_user_made_is_refused_and_left_as_it_is(tmp_path: Path, theirs: int,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The hostile layout: another user (nobody) made levels of ROOT/JOB/NODE, mode 0777. Taking them over
    (chmod 0700, then snapshots) would leave the owner free to chmod them back, read the weights and swap the
    directory."""
    levels = tier_levels(tmp_path / "shm")
    levels[-1].mkdir(parents=True)
    hostile = levels[:1] if theirs == 3 else levels[theirs:]
    for level in hostile:
        os.chown(level, NOBODY, NOBODY)
        level.chmod(0o777)
    message = off_with_warning(BASE.replace(local_checkpoint_dir=str(levels[0])), caplog)
    first = hostile[0]
    assert message.startswith(f"--local-checkpoint-dir: {first} is owned by nobody (uid {NOBODY}), not by this "
                              "user (root (uid 0))"), message
    for level in hostile:
        status = level.stat()
        assert (status.st_uid, status.st_mode & 0o777) == (NOBODY, 0o777)  # not taken over
    assert os.listdir(levels[-1]) == []  # nothing written there


@pytest.mark.parametrize("link", [1, 2], ids=["job", "node"])
def test_a_level_that_is_a_symbolic_link_is_refused(tmp_path: Path, link: int,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A link, even to a directory of this user's, could be pointed elsewhere by whoever made it."""
    levels = tier_levels(tmp_path / "shm")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "node-a").mkdir(parents=True, mode=0o755)
    levels[link - 1].mkdir(parents=True, exist_ok=True)
    levels[link].symlink_to(elsewhere if link == 1 else elsewhere / "node-a")
    message = off_with_warning(BASE.replace(local_checkpoint_dir=str(levels[0])), caplog)
    assert message.startswith(f"--local-checkpoint-dir: {levels[link]} is a symbolic link:"), message
    assert ((elsewhere / "node-a").stat().st_mode & 0o777, os.listdir(elsewhere / "node-a")) == (0o755, [])


def test_every_level_of_the_users_own_tier_is_made_0700(tmp_path: Path) -> None:
    levels = tier_levels(tmp_path / "shm")
    levels[1].mkdir(parents=True)
    for level in levels[:2]:
        level.chmod(0o777)  # this user's, left open by an older run: closed, not refused
    config = BASE.replace(local_checkpoint_dir=str(levels[0]))
    assert local_tier_or_off(config) is config
    assert [level.stat().st_mode & 0o777 for level in levels] == [0o700, 0o700, 0o700]


@needs_root
def test_another_users_default_root_does_not_turn_this_users_tier_off(tmp_path: Path) -> None:
    """The first user's /dev/shm/tfelastic (0755) turned the tier off for every other user on the host: the
    default root is one per user. The agent here runs as nobody (its effective user: the interpreter lives in
    root's home) while root's /dev/shm/tfelastic exists."""
    shared_root = Path("/dev/shm/tfelastic")  # where every user's tier used to be
    made = not shared_root.exists()
    shared_root.mkdir(mode=0o755, exist_ok=True)
    job = f"test-{os.getpid()}-{tmp_path.name}"[:60]
    script = f"""
import json, os
from tfelastic.daemon.config import from_values
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.preflight import local_tier_or_off
from tfelastic.trainer import snapshots
os.setgroups([])
os.setegid({NOBODY})
os.seteuid({NOBODY})
config = from_values({{"command": ("python",), "rendezvous": Endpoint("127.0.0.1", 29400), "node_id": "node-a",
                       "job": {job!r}, "local_checkpoint_dir": snapshots.default_local_root()}})
print(json.dumps(local_tier_or_off(config).local_tier()))
"""
    try:
        result = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        tier = json.loads(result.stdout)
        assert tier == f"/dev/shm/tfelastic-{NOBODY}/{job}/node-a", result.stderr
        status = Path(tier).stat()
        assert (status.st_uid, status.st_mode & 0o777) == (NOBODY, 0o700)
    finally:
        shutil.rmtree(f"/dev/shm/tfelastic-{NOBODY}/{job}", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(f"/dev/shm/tfelastic-{NOBODY}")
        if made:
            shared_root.rmdir()
