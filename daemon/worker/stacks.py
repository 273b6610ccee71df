"""Where a hung trainer hangs, from the Python stacks it dumps on a signal. Pure, except for the constants.

A trainer's Python signal handlers do not run while its main thread waits in TensorFlow's C++ (a collective, an
iterator, a device call): CPython runs them between bytecodes, on the main thread. :mod:`faulthandler` does not
wait: its handler is a C signal handler that writes every thread's Python stack to stderr at once. The agent sets
:data:`STACKS_SIGNAL_ENV` in the trainer's environment; the instrumentation's ``sitecustomize`` (every Python
program of the worker) and ``import tfelastic.trainer`` register faulthandler for that signal. Before the agent
reports a hang, it sends the signal to the shallowest process of the worker that catches it (read from
``/proc/PID/status``: a process that does not catch it would die of it), and the dump reaches the agent's log
through the trainer's output like any other line. This module reads the dump back into a one-line summary.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tfelastic.daemon
import tfelastic.trainer

STACKS_SIGNAL = signal.SIGUSR2
STACKS_SIGNAL_ENV = "TFELASTIC_STACKS_SIGNAL"  # its number; trainer/stacks.py and the sitecustomize read it

# tfelastic's own files: a frame there (TrainLoop, a callback) is not the user's code. A checkout's folders, where
# this process imports them from with links resolved; an installed or linked layout by its path (_TFELASTIC), since
# a trainer may import them from another place than its agent.
OWN_CODE = tuple(str(Path(module.__file__ or "").resolve().parent) for module in (tfelastic.daemon, tfelastic.trainer))
_TFELASTIC = re.compile(r"/tfelastic/(trainer|daemon)/")

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.+)$')
# Installed libraries and the standard library (TensorFlow, tf_keras, threading), and frozen modules.
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python3(\.\d+)?/|^<")
_LIBRARY_ROOT = re.compile(r"^.*/(site|dist)-packages/|^.*/lib/python3(\.\d+)?/")  # up to a package's own path


@dataclass(frozen=True)
class Frame:
    file: str
    line: str  # "???" when faulthandler could not tell
    function: str

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"

    def short(self) -> str:
        """As ``str``, a library's file named from its package (``tensorflow/python/eager/execute.py``)."""
        return f"{self.function} ({_LIBRARY_ROOT.sub('', self.file)}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    current: bool  # the thread that ran the signal handler
    frames: tuple[Frame, ...]  # innermost first, as faulthandler writes them

    @property
    def started_by_threading(self) -> bool:
        """A thread of the threading module (its outermost frame is threading's bootstrap), not the main one."""
        return bool(self.frames) and self.frames[-1].function == "_bootstrap" and \
            self.frames[-1].file.endswith("threading.py")


def parse_dump(lines: Iterable[str]) -> list[ThreadStack]:
    """The threads of a faulthandler dump among ``lines`` (other output around it is skipped)."""
    threads: list[ThreadStack] = []
    current: bool | None = None
    frames: list[Frame] = []
    for line in lines:
        if (start := _THREAD.match(line.rstrip())) is not None:
            if current is not None:
                threads.append(ThreadStack(current, tuple(frames)))
            current, frames = start.group(1) == "Current thread", []
        elif current is not None and (frame := _FRAME.match(line.rstrip())) is not None:
            frames.append(Frame(frame["file"], frame["line"], frame["function"]))
    if current is not None:
        threads.append(ThreadStack(current, tuple(frames)))
    return threads


def main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The main thread: not one the threading module started, its outermost frame a module's top level; the thread
    that ran the handler, or the last listed (CPython lists the oldest thread last), when that does not decide."""
    candidates = [t for t in threads if t.frames and not t.started_by_threading] or [t for t in threads if t.frames]
    top_level = [t for t in candidates if t.frames[-1].function == "<module>"] or candidates
    return next((t for t in top_level if t.current), top_level[-1] if top_level else None)


def is_own_code(frame: Frame, library: Sequence[str] = OWN_CODE, script: str | None = None) -> bool:
    """A frame of the trainer's own code: its ``script`` (wherever it lies: ``python -m`` runs one from a package),
    or any file but the standard library, an installed package and tfelastic."""
    if frame.file == script:
        return True
    return not _LIBRARY.search(frame.file) and not _TFELASTIC.search(frame.file) and \
        not any(frame.file.startswith(root + "/") for root in library)


def script_of(thread: ThreadStack) -> str | None:
    """The file the main thread runs as ``__main__``: its outermost module-level frame (``python -m`` puts runpy's
    frames outside it)."""
    return next((f.file for f in reversed(thread.frames) if f.function == "<module>" and not f.file.startswith("<")),
                None)


def waits_in_a_library(lines: Iterable[str], library: Sequence[str] = OWN_CODE) -> bool:
    """Whether the main thread's innermost frame is a library's (TensorFlow's execute, a lock's wait): a trainer
    that may be waiting for a peer that hangs. False where it is the trainer's own code, or there is no dump."""
    main = main_thread(parse_dump(lines))
    return main is not None and not is_own_code(main.frames[0], library, script_of(main))


def hang_site(lines: Iterable[str], library: Sequence[str] = OWN_CODE) -> str | None:
    """One line: the innermost frame of the trainer's own code on its main thread, the library call it waits in,
    and another thread that is in the trainer's own code (an input pipeline's function run by TensorFlow); None
    when ``lines`` hold no dump."""
    threads = parse_dump(lines)
    main = main_thread(threads)
    if main is None:
        return None
    script = script_of(main)
    own = next((f for f in main.frames if is_own_code(f, library, script)), None)
    innermost = main.frames[0]
    if own is None:
        return f"hung in {innermost.short()}, in no frame of the trainer's own code"
    site = f"hung in {own}" + (f", waiting in {innermost.short()}" if innermost != own else "")
    # A thread whose innermost frame is the trainer's own code: an input pipeline's function, say.
    elsewhere = [f for t in threads if t is not main for f in t.frames[:1] if is_own_code(f, library, script)]
    if elsewhere:
        site += f"; another thread in {elsewhere[0]}"
    return site
