"""The worker keeper: the first process of every worker, so that a worker never outlives its agent.

The agent starts ``python -I -S keeper.py CMD...`` in a new session. The keeper asks the kernel to send it
SIGHUP when the agent dies (``PR_SET_PDEATHSIG``), starts CMD as its child, and waits. When the agent dies,
even by SIGKILL, the keeper terminates the whole session: SIGTERM, a grace period, then SIGKILL. It is also a
child subreaper, so processes that detach from the trainer are still its descendants and are still found.

It exits with the trainer's status, re-raising the signal that killed the trainer. It runs before any
package is importable (``-S``), so it uses the standard library only and imports nothing of tfelastic.
"""

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_ENV = "TFELASTIC_KEEPER_GRACE"
AGENT_PID_ENV = "TFELASTIC_AGENT_PID"
PRIORITY_ENV = "TFELASTIC_KEEPER_PRIORITY"  # the trainer's nice value (worker/priority.py: the agent runs ahead)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def _descendants() -> list[int]:
    """Every process whose parent chain leads to this one (reparented orphans included: we are a subreaper)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
                parents[int(entry)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [os.getpid()]
    while frontier:
        pid = frontier.pop()
        children = [p for p, ppid in parents.items() if ppid == pid]
        found += children
        frontier += children
    return found


def _kill_all(sig: int) -> None:
    for pid in _descendants():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _terminate_descendants(grace: float) -> None:
    """SIGTERM (and SIGCONT, for stopped ones) to every descendant, then SIGKILL after ``grace`` seconds."""
    _kill_all(signal.SIGTERM)
    _kill_all(signal.SIGCONT)
    deadline = time.monotonic() + grace
    while _descendants() and time.monotonic() < deadline:
        _reap()
        time.sleep(0.02)
    while _descendants():
        _kill_all(signal.SIGKILL)
        _reap()
        time.sleep(0.01)


def _orphaned(grace: float) -> None:
    """The agent is gone: terminate everything under us, then exit."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _terminate_descendants(grace)
    os._exit(128 + signal.SIGHUP)


def main(argv: list[str]) -> int:
    # A stop may come before the trainer exists: hold SIGTERM until the fork, then hand it on (below).
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    grace = float(os.environ.pop(GRACE_ENV, "10"))
    agent = int(os.environ.pop(AGENT_PID_ENV, "0")) or os.getppid()  # the agent says who it is: we may be late
    priority = os.environ.pop(PRIORITY_ENV, "")
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGHUP, lambda *_: _orphaned(grace))
    _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != agent:  # the agent died before the death signal was armed
        _orphaned(grace)
    keeper = os.getpid()
    trainer = os.fork()
    if trainer == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the keeper itself was SIGKILLed: take the trainer along
        if os.getppid() != keeper:  # it died before the death signal was armed
            os._exit(128 + signal.SIGKILL)
        if priority:  # one thread yet: the nice value is the whole process's, and every thread it starts inherits it
            with contextlib.suppress(OSError, ValueError):  # raising a nice value needs no privilege
                os.setpriority(os.PRIO_PROCESS, 0, int(priority))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])  # a stop that reached us already ends us
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"tfelastic: cannot start trainer {argv[0]!r}: {e}", file=sys.stderr, flush=True)
            os._exit(127)
    # The agent signals the whole process group on stop; the trainer handles SIGTERM, the keeper waits. A stop
    # that came while the trainer did not exist yet is the trainer's (it would otherwise train on until the
    # agent's SIGKILL, stop_grace later); ignoring SIGTERM discards the one held here.
    if signal.SIGTERM in signal.sigpending():
        os.kill(trainer, signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
    # Descriptors passed for the trainer (a warm standby's pipes) are the trainer's alone: a keeper holding
    # them would keep a pipe open after the trainer died, and a write to it would not fail.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == trainer:
            break
    if _descendants():  # the trainer left processes behind; they must not outlive the worker
        _terminate_descendants(grace)
    if os.WIFSIGNALED(status):  # die the same way, so the agent sees the signal, not an exit code
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
