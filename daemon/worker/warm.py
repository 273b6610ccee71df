"""Warm start: a standby interpreter per worker slot, so that a relaunch skips Python's and TensorFlow's start-up.

A trainer command that runs a Python interpreter with a script or a module and no interpreter options
(``python train.py``, ``python3 -m pkg.train``) starts warm: the agent keeps a :class:`Standby`, the keeper running
``daemon/worker/standby.py`` with the trainer's environment less :data:`GENERATION_KEYS`, and a matching launch
hands it ``argv``, the environment and the working directory. Everything else is a cold worker's (session, keeper,
PDEATHSIG, progress, output, exit codes). A standby is rebuilt when its :class:`StandbyKey` changes. Seen from
outside: a warm trainer's ``/proc/PID/environ`` is the standby's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from tfelastic.daemon.worker import standby
from tfelastic.daemon.worker.priority import workers_priority
from tfelastic.daemon.worker.process import WorkerProcess, WorkerSpec
from tfelastic.trainer.environment import (
    GENERATION_ENV,
    RANK_ENV,
    RESTART_COUNT_ENV,
    RESTORE_STEP_ENV,
    TF_CONFIG_ENV,
    WORLD_SIZE_ENV,
)

log = logging.getLogger("tfelastic.worker")

STANDBY_PATH = str(Path(standby.__file__).resolve())
GENERATION_KEYS = frozenset({TF_CONFIG_ENV, RANK_ENV, WORLD_SIZE_ENV, GENERATION_ENV, RESTART_COUNT_ENV,
                             RESTORE_STEP_ENV})
STANDBY_PREFIX = "[standby]"
TAKE_SECONDS = 30.0  # a ready standby answers its launch at once; this long at most (a machine under load)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


def interpreter_of(command: Sequence[str], path: str | None, cwd: str | None = None) -> str | None:
    """The interpreter a command runs, resolved on ``path`` (and a relative one in ``cwd``) as exec would, if
    the command can start warm: ``python[3[.X]] SCRIPT.py ARGS`` with SCRIPT.py a source file, or
    ``python[3[.X]] -m MODULE ARGS``, with no interpreter option. A directory, a zip archive or a .pyc given to
    the interpreter starts cold."""
    cwd = cwd or os.getcwd()
    if len(command) < 2 or not _PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    if command[1] == "-m":
        if len(command) < 3 or not command[2] or command[2].startswith("-"):
            return None
    elif command[1].startswith("-") or not _source_file(os.path.join(cwd, command[1])):
        return None
    found = os.path.join(cwd, command[0]) if "/" in command[0] else shutil.which(command[0], path=path)
    # Not resolved further: a virtual environment's python is a link to the base interpreter, and Python finds
    # its environment from the path it was started as.
    return os.path.abspath(found) if found and os.access(found, os.X_OK) else None


def _source_file(path: str) -> bool:
    return path.endswith(".py") and os.path.isfile(path)


@dataclass(frozen=True)
class StandbyKey:
    """What a standby was built for: a launch with another key starts cold, and the standby is rebuilt."""

    interpreter: str
    interpreter_mtime: float
    module: bool  # -m
    cwd: str
    env_digest: str

    @classmethod
    def of(cls, spec: WorkerSpec) -> StandbyKey | None:
        interpreter = interpreter_of(spec.command, spec.env.get("PATH"), spec.cwd)
        if interpreter is None:
            return None
        try:
            mtime = os.stat(interpreter).st_mtime
        except OSError:
            return None
        base = json.dumps(sorted(standby_env(spec.env).items())).encode()
        return cls(interpreter, mtime, spec.command[1] == "-m", os.path.abspath(spec.cwd or os.getcwd()),
                   hashlib.sha256(base).hexdigest())


@dataclass(frozen=True)
class StandbyPolicy:
    """When a node builds its standby: at each launch, at a lower CPU priority, where it has the cores to spare
    (its import takes one core for about ten seconds); else once the trainer is past its start-up."""

    at_launch: bool
    nice: int

    @classmethod
    def of_this_node(cls) -> StandbyPolicy:
        at_launch = len(os.sched_getaffinity(0)) >= AT_LAUNCH_CPUS
        return cls(at_launch, STANDBY_NICE if at_launch and _may_raise_priority_back() else 0)


AT_LAUNCH_CPUS = 4
STANDBY_NICE = 10


def _may_raise_priority_back() -> bool:
    """Whether a standby may go back to the workers' priority after lowering it (root, or RLIMIT_NICE)."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - workers_priority()


def standby_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in GENERATION_KEYS}


class Standby:
    """One standby interpreter, from its start to the launch that makes it the worker (or its retirement)."""

    def __init__(self, key: StandbyKey, worker: WorkerProcess, launch_fd: int, ready_fd: int) -> None:
        self.key = key
        self.worker = worker
        self._launch_fd, self._ready_fd = launch_fd, ready_fd
        self._started = time.monotonic()
        self.ready_after: float | None = None  # seconds from its start to TensorFlow imported
        self._taken: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # it read a launch
        self._launch_prefix: str | None = None
        asyncio.get_running_loop().add_reader(ready_fd, self._on_signal)

    @classmethod
    async def start(cls, key: StandbyKey, spec: WorkerSpec, nice: int = 0) -> Standby:
        """``nice``: how much lower the standby's CPU priority is until its launch."""
        launch_read, launch_write = os.pipe()
        ready_read, ready_write = os.pipe()
        env = {**standby_env(spec.env), standby.FD_ENV: f"{launch_read},{ready_write}"}
        if nice:
            env[standby.NICE_ENV] = str(nice)
        standby_spec = WorkerSpec((key.interpreter, STANDBY_PATH), env, spec.cwd, STANDBY_PREFIX,
                                  spec.orphan_grace_seconds)
        try:
            worker = await WorkerProcess.start(standby_spec, pass_fds=(launch_read, ready_write))
        except BaseException:
            os.close(launch_write)
            os.close(ready_read)
            raise
        finally:
            os.close(launch_read)
            os.close(ready_write)
        return cls(key, worker, launch_write, ready_read)

    def _on_signal(self) -> None:
        """What the standby says on its second pipe: R (TensorFlow imported), L (it read its launch), or end of
        file (it died)."""
        try:
            said = os.read(self._ready_fd, 16)
        except OSError:
            said = b""
        if b"R" in said:
            self.ready_after = time.monotonic() - self._started
            log.info("standby interpreter %d ready in %.1fs (%.0f MB resident)", self.worker.pid,
                     self.ready_after, self.memory_bytes() / 2**20)
        if b"L" in said or not said:
            if b"L" in said and self._launch_prefix is not None:
                self.worker.begin(self._launch_prefix)  # before its first line can be read
            if not self._taken.done():
                self._taken.set_result(bool(said))
            self._close_ready()

    def _close_ready(self) -> None:
        if self._ready_fd >= 0:
            asyncio.get_running_loop().remove_reader(self._ready_fd)
            os.close(self._ready_fd)
            self._ready_fd = -1

    def alive(self) -> bool:
        return not self.worker.has_exited()

    def memory_bytes(self) -> int:
        """The standby interpreter's resident memory (the keeper's is small and not counted)."""
        with contextlib.suppress(psutil.Error):
            pid = self.worker.trainer_pid()
            if pid != self.worker.pid:
                return int(psutil.Process(pid).memory_info().rss)
        return 0

    async def activate(self, spec: WorkerSpec) -> WorkerProcess:
        """Hands the standby the launch: from now on it is ``spec``'s worker. Raises OSError if it died before it
        read the launch: a standby killed a moment before still holds its pipe while the kernel tears down its
        memory, so only its answer tells. The write waits in a thread: a standby still importing reads only when
        it is done, and a large environment fills the pipe."""
        message = json.dumps({"argv": list(spec.command), "env": dict(spec.env),
                              "cwd": os.path.abspath(spec.cwd or os.getcwd())}).encode()
        self._launch_prefix = spec.log_prefix
        # The thread owns the fd from here: cancelled, this coroutine must not close a number the thread may
        # still write to, and that the process may have reused (a gRPC socket) by then.
        fd, self._launch_fd = self._launch_fd, -1
        try:
            await asyncio.to_thread(_write_all_and_close, fd, message)
        except OSError as e:  # its end of the pipe is closed already (EPIPE): it died after the liveness check
            await self.retire()
            raise OSError(f"the standby interpreter {self.worker.pid} did not take the launch ({e.strerror})") from e
        try:
            taken = await asyncio.wait_for(asyncio.shield(self._taken), TAKE_SECONDS)
        except asyncio.TimeoutError:
            taken = False
        if not taken:
            await self.retire()  # it may still read the launch late: gone before anything starts cold
            raise OSError(f"the standby interpreter {self.worker.pid} did not take the launch")
        return self.worker

    async def retire(self) -> None:
        """Ends a standby that will not be used: end of file on its pipe, then the worker's stop."""
        self._close_ready()
        if self._launch_fd >= 0:
            os.close(self._launch_fd)
            self._launch_fd = -1
        await self.worker.stop(1.0)


def _write_all_and_close(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)
