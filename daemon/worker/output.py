"""How a trainer ended, in words: its exit code, and what its last lines of output say about why it failed, and
its cause among a fixed set (:class:`~tfelastic.daemon.rendezvous.api.FailureCause`). Pure."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterable, Sequence

from tfelastic.daemon.rendezvous.api import FailureCause

# The last line of a Python traceback: "ZeroDivisionError: float division by zero", "tf.errors.OpError: ...".
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b(: .*)?$")


def exception_line(lines: Iterable[str]) -> str | None:
    """The exception a trainer died of, from its last lines of output: the last line of the last traceback, else
    the last line that looks like an exception; None when there is none."""
    lines = list(lines)
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=-1)
    found = None
    for line in lines[start + 1:]:
        if _EXCEPTION.match(line.strip()) and not line.startswith((" ", "\t")):
            found = line.strip()
    return found


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


# What TensorFlow, CUDA and Python print when memory runs out (device or host), searched in the last lines.
_OUT_OF_MEMORY = re.compile(r"ResourceExhaustedError|OOM when allocating|CUDA_ERROR_OUT_OF_MEMORY|CUDA out of memory|"
                            r"cudaErrorMemoryAllocation|\bMemoryError\b|std::bad_alloc|failed to allocate memory")
# What a worker prints when a peer failed under it (docs/facts.md, fact 3): a collective aborted, a connection to
# another task reset or refused, the coordination service's verdict on a silent task.
_PEER_FAILURE = re.compile(r"Collective ops is aborted by|UnavailableError|Connection reset by peer|Socket closed|"
                           r"failed to connect to all addresses|stopped sending heartbeats|tasks are unhealthy|"
                           r"Failed to connect to remote host")


def failure_cause(code: int, lines: Sequence[str], *, oom_killed: bool = False) -> FailureCause:
    """Why a trainer that ended by itself failed. Killed by SIGKILL while its memory cgroup counted an OOM kill
    (``oom_killed``, worker/oom.py): out of memory. Killed by another signal than SIGABRT: the signal (whatever it
    printed before). Else the exception it died of: out of memory or a peer's failure when it says so, else an
    exception. Else its last lines, which a C++ abort leaves without a Python exception: memory, a peer, or
    the signal or exit code."""
    if code == -signal.SIGKILL and oom_killed:
        return FailureCause.OUT_OF_MEMORY
    if code < 0 and -code != signal.SIGABRT:
        return FailureCause.SIGNAL
    exception = exception_line(lines)
    if exception is not None:
        return _told_by(exception) or FailureCause.EXCEPTION
    told = _told_by("\n".join(lines))
    return told or (FailureCause.SIGNAL if code < 0 else FailureCause.EXIT_CODE)


def _told_by(text: str) -> FailureCause | None:
    if _OUT_OF_MEMORY.search(text):  # first: a worker out of memory may also have seen its peers go
        return FailureCause.OUT_OF_MEMORY
    if _PEER_FAILURE.search(text):
        return FailureCause.PEER_FAILURE
    return None


def cause_in_words(cause: FailureCause) -> str:
    """The words before an exit's description that the description does not say itself."""
    return {FailureCause.OUT_OF_MEMORY: "ran out of memory: ",
            FailureCause.PEER_FAILURE: "saw a peer fail (not its own fault): "}.get(cause, "")
