"""The node-local checkpoint tier's option (``--local-checkpoint-dir``, ``node.local_checkpoint_dir``): its default,
'off', the checks of the path (exit 78, naming the option), and the preflight that turns an unwritable tier off
with a warning instead of failing."""

from __future__ import annotations

import logging
import os
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


def test_the_tier_is_on_by_default_under_dev_shm_one_directory_per_job_and_node(tmp_path: Path) -> None:
    for config in (BASE, run(), toml(tmp_path)):
        assert config.node.local_checkpoint_dir == snapshots.LOCAL_ROOT_DEFAULT == "/dev/shm/tfelastic"
        assert config.local_tier() == "/dev/shm/tfelastic/mnist/node-a"
        assert config.local_tier() == snapshots.local_store_root("/dev/shm/tfelastic", "mnist", "node-a")


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
                                  "directory, e.g. /dev/shm/tfelastic, or 'off' to turn the local tier off")


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
