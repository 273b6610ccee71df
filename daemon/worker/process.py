"""One worker: the trainer command run under the keeper, in a session of its own.

``stop`` is the only way a worker ends on purpose: SIGTERM to the whole process group, a grace period, then
SIGKILL of every process of the tree, repeated until none is left; the grace ends early once the trainer has
announced its exit code with its state saved (:meth:`WorkerProcess.end_soon`). It returns only once every process
is confirmed gone, so the next generation never meets a stale one. A stopped (SIGSTOP) process is deliberately not
continued: it is a hung worker, and letting it run again would let the old collective make progress.

``pids`` names every process of the worker seen in its life (the keeper, the trainer, what the stop found): a
killed process may hold its GPU memory for a while after it is gone, and the agent waits for NVML to list none of
them before the next generation starts (agent/node.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
from tfelastic.daemon.worker import keeper
from tfelastic.daemon.worker.oom import OomCount
from tfelastic.daemon.worker.priority import workers_priority

log = logging.getLogger("tfelastic.worker")

KEEPER_PATH = str(Path(keeper.__file__).resolve())
TAIL_LINES = 40  # the last lines of output kept, to say why a trainer failed (worker/output.py)
STACKS_QUIET = 0.15  # a stack dump is whole once the trainer has printed nothing for this long...
STACKS_LIMIT = 2.0  # ... or this long after it was asked: a hang's report waits no longer for it
# A peer of this worker's trainer failed: the trainer aborts its pending collectives and saves the step it holds
# (trainer/peer_failure.py, which reads the number from PEER_FAILED_SIGNAL_ENV). Sent only to a trainer that said
# it listens: SIGUSR1's default action ends a process.
PEER_FAILED_SIGNAL = signal.SIGUSR1
PEER_FAILED_SIGNAL_ENV = "TFELASTIC_PEER_FAILED_SIGNAL"


@dataclass(frozen=True)
class WorkerSpec:
    command: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None
    log_prefix: str
    orphan_grace_seconds: float  # how long the keeper waits between SIGTERM and SIGKILL if the agent dies


class WorkerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, spec: WorkerSpec) -> None:
        self._proc = proc
        self.log_prefix = spec.log_prefix
        self.pid = proc.pid  # the keeper: session leader, so also the process group id
        self.exited_before_stop = False  # set by stop(): it had ended by itself before it was signalled
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # its last lines of output
        self._captures: list[list[str]] = []  # output being collected in full (dump_stacks)
        self._seen = {self.pid}
        self._oom = OomCount.of(self.pid)  # its cgroup's OOM kills so far (a standby reads it again at begin)
        self._output = asyncio.create_task(self._forward_output())
        self._end_soon = asyncio.Event()  # end_soon() was called: the grace ends ``_end_within`` seconds later
        self._end_within = 0.0
        self._kept_until = 0.0  # extend_stop(): the grace lasts until then at least (time.monotonic())

    @classmethod
    async def start(cls, spec: WorkerSpec, pass_fds: Sequence[int] = ()) -> WorkerProcess:
        env = dict(spec.env)
        env[keeper.GRACE_ENV] = str(spec.orphan_grace_seconds)
        env[keeper.AGENT_PID_ENV] = str(os.getpid())
        env[keeper.PRIORITY_ENV] = str(workers_priority())
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", KEEPER_PATH, *spec.command,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=env, cwd=spec.cwd, start_new_session=True, pass_fds=tuple(pass_fds),
        )
        return cls(proc, spec)

    def begin(self, log_prefix: str) -> None:
        """A warm standby became the trainer: its output from now on is the trainer's, and so are OOM kills."""
        self.log_prefix = log_prefix
        self.tail.clear()
        self._oom = OomCount.of(self.pid)

    def oom_killed(self) -> bool:
        """Whether it died of SIGKILL while its memory cgroup counted an OOM kill (worker/oom.py)."""
        return self._proc.returncode == -signal.SIGKILL and self._oom is not None and self._oom.killed_since()

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        code = await self._proc.wait()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._output), 1.0)  # flush the last lines of output
        return code

    @property
    def pids(self) -> tuple[int, ...]:
        """Every process of this worker seen so far: the keeper, the trainer once :meth:`trainer_pid` found it,
        and after :meth:`stop` every process it stopped."""
        return tuple(sorted(self._seen))

    def trainer_pid(self) -> int:
        """The trainer itself (the keeper's child), or the keeper while the trainer is not yet forked."""
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(self.pid).children()
            if children:
                self._seen.add(children[0].pid)
                return children[0].pid
        return self.pid

    def has_exited(self) -> bool:
        """Whether the keeper has ended, reaped or not (a peek: it does not reap)."""
        if self._proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    async def stop(self, grace_seconds: float, hold_seconds: float = 0.0, notify: int = 0) -> None:
        """SIGTERM the group, wait for the grace period, SIGKILL what is left; return once all are gone.
        ``hold_seconds``: wait that long first, without a SIGTERM, for the trainer to end by itself (the survivors'
        save: api.Stop), having told process ``notify`` (PEER_FAILED_SIGNAL) that a peer failed."""
        self.exited_before_stop = self.has_exited()
        if self.exited_before_stop:  # its pid may be reused by now: only the group's leftovers are ours
            self._seen.update(await asyncio.to_thread(_kill_until_gone, self.pid, []))
            await self._proc.wait()
            return
        tree = process_tree(self.pid)
        if hold_seconds > 0 and notify > 0 and notify in self._seen | {p.pid for p in tree}:
            with contextlib.suppress(ProcessLookupError):  # only a process of this worker
                os.kill(notify, PEER_FAILED_SIGNAL)
        held = await self._exited_within(hold_seconds) if hold_seconds > 0 else "grace"
        if held == "grace":  # it did not end by itself (or there was no hold)
            _signal_group(self.pid, signal.SIGTERM)
            held = await self._exited_within(grace_seconds)
        if held == "announced":
            log.info("worker %d: still there %gs after the trainer announced its exit: ending it", self.pid,
                     self._end_within)
        tree += process_tree(self.pid)  # anything forked during the grace period
        self._seen.update(p.pid for p in tree)
        self._seen.update(await asyncio.to_thread(_kill_until_gone, self.pid, tree))
        await self._proc.wait()
        self._output.cancel()

    def end_soon(self, within: float) -> None:
        """The trainer's state is saved and its exit code known: a stop under way, or the next one, waits at most
        ``within`` seconds more for it to exit before the SIGKILL."""
        self._end_within = within
        self._end_soon.set()

    def extend_stop(self, within: float) -> None:
        """The trainer saves the state it holds for the next generation (a peer failed): a stop under way, or the
        next one, waits ``within`` seconds from now at least before the SIGKILL (end_soon still ends it sooner)."""
        self._kept_until = max(self._kept_until, time.monotonic() + within)

    async def _exited_within(self, grace: float) -> Literal["exited", "announced", "grace"]:
        """Waits until the keeper exits ("exited"), ``_end_within`` after :meth:`end_soon` ("announced") or
        ``grace`` seconds, or until the time :meth:`extend_stop` named if that is later ("grace"), whichever comes
        first."""
        exited: asyncio.Future[Any] = asyncio.ensure_future(asyncio.shield(self._proc.wait()))
        cut_short: asyncio.Future[Any] = asyncio.ensure_future(self._end_soon_passed())
        deadline = time.monotonic() + grace
        try:
            while True:
                # An extension only moves the deadline later: a wait that times out before it looks again.
                left = max(deadline, self._kept_until) - time.monotonic()
                await asyncio.wait({exited, cut_short}, timeout=max(left, 0.0), return_when=asyncio.FIRST_COMPLETED)
                if exited.done() or cut_short.done() or max(deadline, self._kept_until) <= time.monotonic():
                    return "exited" if exited.done() else "announced" if cut_short.done() else "grace"
        finally:
            for waiting in (exited, cut_short):
                waiting.cancel()  # the keeper's own wait goes on under the shield

    async def _end_soon_passed(self) -> None:
        await self._end_soon.wait()
        await asyncio.sleep(self._end_within)

    async def dump_stacks(self, signum: int, *, reporter: int = 0, quiet: float = STACKS_QUIET,
                          limit: float = STACKS_LIMIT) -> tuple[list[str], str]:
        """Asks the trainer for its Python stacks (worker/stacks.py): the lines it printed in answer (until
        ``quiet`` seconds without a line, at most ``limit``), and why there are none when there are none. The lines
        are logged as they come, like all its output. ``reporter``: the pid that reported the trainer's progress,
        asked first."""
        target = await asyncio.to_thread(stack_dumper, self.pid, signum, reporter)
        if isinstance(target, str):
            return [], target
        lines: list[str] = []
        self._captures.append(lines)
        try:
            os.kill(target, signum)
            await _until_quiet(lines, quiet, limit)
        except ProcessLookupError:
            return [], f"its pid {target} ended before it could be asked for its stacks"
        finally:
            self._captures.remove(lines)
        name = signal.Signals(signum).name
        return lines, "" if lines else f"pid {target} printed nothing within {limit:g}s of {name}"

    async def _forward_output(self) -> None:
        assert self._proc.stdout is not None
        while True:
            try:
                line = await self._proc.stdout.readline()
            except ValueError:  # a line longer than the stream limit: log what we have
                line = await self._proc.stdout.read(65536)
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            self.tail.append(text)
            for capture in self._captures:
                capture.append(text)
            log.info("%s %s", self.log_prefix, text)


async def _until_quiet(lines: list[str], quiet: float, limit: float) -> None:
    """Until ``lines`` has had lines and then none for ``quiet`` seconds, or ``limit`` seconds have passed."""
    deadline = time.monotonic() + limit
    seen, since = 0, time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        if len(lines) != seen:
            seen, since = len(lines), time.monotonic()
        elif lines and time.monotonic() - since >= quiet:
            return


def stack_dumper(keeper: int, signum: int, reporter: int = 0) -> int | str:
    """The pid to ask for stacks: the process under the keeper that reported the trainer's progress, if it catches
    ``signum``; else the shallowest that does (a wrapper shell does not; a fork of the trainer, such as an input
    worker, inherits the handler, so the shallowest is the trainer itself); else why there is none. A process that
    does not catch the signal is never sent it: it would die of it. Blocking: run in a thread."""
    name = signal.Signals(signum).name
    try:
        tree = _breadth_first(keeper)
        for process in sorted(tree, key=lambda p: p.pid != reporter):  # stable: the reporter, then by depth
            if catches_signal(process.pid, signum):
                if process.status() == psutil.STATUS_STOPPED:
                    return f"the trainer (pid {process.pid}) is stopped (SIGSTOP): it cannot dump its stacks"
                return process.pid
    except psutil.Error as e:
        return f"the trainer's processes could not be read: {e}"
    return (f"no process of the worker catches {name}: its stacks are dumped by the instrumentation's "
            "sitecustomize and by import tfelastic.trainer (docs/operations.md)")


def _breadth_first(root: int) -> list[psutil.Process]:
    """``root``'s descendants, its children first, then theirs."""
    found: list[psutil.Process] = []
    level = psutil.Process(root).children()
    while level:
        found += level
        level = [child for process in level for child in process.children()]
    return found


def catches_signal(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (``SigCgt`` of /proc/PID/status): sent to a process that does
    not, a signal such as SIGUSR2 ends it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((line.split()[1] for line in f if line.startswith("SigCgt:")), "0")
    except (OSError, IndexError):
        return False
    return bool(int(caught, 16) >> (signum - 1) & 1)


def process_tree(root: int) -> list[psutil.Process]:
    """``root`` and its descendants, [] once ``root`` is gone. Other errors (AccessDenied) are the caller's."""
    try:
        process = psutil.Process(root)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) whose process group is ``pgid``."""
    members = []
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(pid)
    return members


def _kill_until_gone(pgid: int, tree: list[psutil.Process]) -> set[int]:
    """SIGKILL the group and every process of the tree until none is alive; returns the group's members it met.
    Blocking: run in a thread.

    A killed process counts as gone once it is a zombie: it runs no code and holds no port, and its reaping
    is up to its parent (or init), which may take a while. psutil.wait_procs would wait for the reaping.
    """
    started = next_report = time.monotonic()
    pause = 0.002
    met: set[int] = set()
    while True:
        alive = [p for p in tree if _alive(p)]
        members = group_members(pgid)
        met.update(members)
        if not alive and not members:
            return met
        if time.monotonic() >= next_report + 5.0:  # D state (a hung driver or NFS mount) resists SIGKILL
            next_report = time.monotonic()
            log.error("worker processes %s survive SIGKILL for %.0fs (uninterruptible sleep?); the node "
                      "cannot rejoin until they are gone", sorted({p.pid for p in alive} | set(members)),
                      next_report - started)
        if members:
            _signal_group(pgid, signal.SIGKILL)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
