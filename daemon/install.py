"""``tfelastic install JOB``: what a node needs to run a job under systemd, from the files this installation of
tfelastic carries (a wheel needs no checkout): the ``tfelastic@.service`` and ``tfelastic-coordinator@.service``
units, the ``tfelastic`` system user, ``/etc/tfelastic/`` with ``example.toml``, and the job's own file,
``/etc/tfelastic/JOB.toml``, made from the example.

The units and the user come from the packaged ``systemd/install.sh``, so the command and the script never differ.
Like the script it is idempotent: the units are replaced (they are ours), a job file that exists is never
touched.
"""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from tfelastic.daemon.assets import packaged
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.rendezvous.bounds import job_name_problem

EXAMPLE_NAME = 'name = "example"'
EXAMPLE_BACKUP = 'backup_dir = "/shared/ckpt/example"'


def default_prefix() -> Path:
    """The environment this tfelastic runs from: the units run its ``bin/tfelastic``."""
    return Path(sysconfig.get_path("scripts")).parent


def run_install(job: str, *, prefix: str, destdir: str, uid: int | None, make_user: bool) -> int:
    problem = job_name_problem(job)
    if problem is not None:
        raise ConfigError(f"JOB: {problem.text}")
    root = Path(prefix) if prefix else default_prefix()
    if not destdir and not (root / "bin" / "tfelastic").exists():
        raise ConfigError(f"--prefix: {root}/bin/tfelastic does not exist; give the environment tfelastic is "
                          "installed in (python3 -m venv DIR && DIR/bin/pip install tfelastic)")
    command = ["bash", str(packaged("systemd/install.sh")), "--prefix", str(root)]
    command += [*(["--destdir", destdir] if destdir else []), *(["--uid", str(uid)] if uid is not None else []),
                *([] if make_user else ["--no-user"])]
    if subprocess.run(command, check=False).returncode != 0:
        return ExitCode.FAILED  # install.sh said why
    _write_job_file(Path(destdir or "/") / "etc" / "tfelastic" / f"{job}.toml", job, staged=bool(destdir))
    return ExitCode.SUCCEEDED


def _write_job_file(target: Path, job: str, *, staged: bool) -> None:
    if target.is_symlink():
        raise ConfigError(f"{target} is a symbolic link; remove it (check where it points) and run again")
    if target.exists():
        print(f"kept {target} (exists)")
        return
    text = packaged("systemd/example.toml").read_text()
    assert EXAMPLE_NAME in text and EXAMPLE_BACKUP in text, "example.toml changed: update tfelastic install"
    text = text.replace(EXAMPLE_NAME, f'name = "{job}"').replace(EXAMPLE_BACKUP, f'backup_dir = "/shared/ckpt/{job}"')
    # A fresh name, created exclusively (mode 600): a file planted at a name we could guess is never followed.
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    partial = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        partial.chmod(0o640)  # it may name secrets' paths: root and the agent's group only
        if not staged and _group_exists("tfelastic"):
            shutil.chown(partial, group="tfelastic")
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    print(f"installed {target}: set job.command, the node range, rendezvous.endpoint and backup_dir, then "
          f"systemctl enable --now tfelastic@{job}")


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True
