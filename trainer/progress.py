"""Progress reports from a trainer to its local agent: one datagram on a Unix socket
(``TFELASTIC_PROGRESS_SOCKET``) per report, at most every 0.1 s. Without the variable every call is a no-op; a send
never blocks nor raises (a busy or gone agent loses the report, training goes on).

The wire format is a JSON object (:func:`decode`): ``g`` generation, ``pid``, ``step``, and optionally ``examples``,
``loss``, ``ckpt`` (the last checkpoint's step), ``st`` (its stall), ``done`` (training completed), ``ph`` (a
:class:`Phase`), ``rt``/``rs`` (the tier and step restored), ``x`` (the exit code the trainer ends with, its state
saved: :func:`announce_exit`). Every step also goes
into ``TFELASTIC_STEP_FILE``, 16 bytes in a shared mapping (generation and step, little-endian int64s: a store, no
system call), which the agent reads when the trainer ends, so that steps redone count from the step reached.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass
from enum import Enum

SOCKET_ENV = "TFELASTIC_PROGRESS_SOCKET"
STEP_FILE_ENV = "TFELASTIC_STEP_FILE"
GENERATION_ENV = "TFELASTIC_GENERATION"
STEP_MARK = struct.Struct("<qq")  # generation, step
MAX_DATAGRAM = 512
# Every number a report carries is bounded here, before it reaches a metric or the coordinator's state
# (docs/instrumentation.md, "What a report may carry"): exact in a float64 metric, an int64 field and JSON.
MAX_STEP = 1 << 53  # steps, checkpoint steps, restored steps, examples, generations
MAX_PID = (1 << 31) - 1  # pid_t
MAX_STALL_SECONDS = 86400.0  # a save that held training up for more than a day is not a measurement
MAX_EXIT_CODE = 255  # what a process's exit status can carry


class Phase(str, Enum):
    """What the trainer does from this report on."""

    TRAIN = "train"  # training steps: the next report is due within a step or two
    SETUP = "setup"  # start-up, restore, building and compiling: the first step comes after it
    SAVE = "save"  # a checkpoint is being written
    EVAL = "eval"  # evaluation or prediction


@dataclass(frozen=True)
class ProgressMessage:
    generation: int
    pid: int
    step: int
    examples: int | None = None
    loss: float | None = None
    checkpoint_step: int | None = None
    done: bool = False
    phase: Phase = Phase.TRAIN
    stall: float | None = None  # seconds the save of ``checkpoint_step`` held training up
    restored_tier: str | None = None  # RESTORE_TIERS: sent once, after the restore
    restored_step: int | None = None
    exit_code: int | None = None  # the trainer exits with this code, everything it must save saved (announce_exit)
    survivor_save: int | None = None  # a peer failed: the trainer saves this step, the state it holds
    hears_peer_failure: bool = False  # with a restore: it listens for the agent's word that a peer failed


RESTORE_TIERS = frozenset({"survivors", "local", "shared", "none"})


def encode(message: ProgressMessage) -> bytes:
    payload: dict[str, float | int | str] = {"g": message.generation, "pid": message.pid, "step": message.step}
    if message.examples is not None:
        payload["examples"] = message.examples
    if message.loss is not None and math.isfinite(message.loss):
        payload["loss"] = message.loss
    if message.checkpoint_step is not None:
        payload["ckpt"] = message.checkpoint_step
    if message.done:
        payload["done"] = 1
    if message.phase is not Phase.TRAIN:
        payload["ph"] = message.phase.value
    if message.stall is not None and math.isfinite(message.stall) and message.stall >= 0:
        payload["st"] = round(message.stall, 6)
    if message.restored_tier is not None:
        payload["rt"] = message.restored_tier
        if message.restored_step is not None:
            payload["rs"] = message.restored_step
        if message.hears_peer_failure:
            payload["pf"] = 1
    if message.exit_code is not None:
        payload["x"] = message.exit_code
    if message.survivor_save is not None:
        payload["sv"] = message.survivor_save
    return json.dumps(payload, separators=(",", ":")).encode()


def decode(data: bytes) -> ProgressMessage:
    """Raises ValueError on anything that is not a well-formed report."""
    if len(data) > MAX_DATAGRAM:
        raise ValueError(f"progress datagram of {len(data)} bytes exceeds {MAX_DATAGRAM}")
    raw = json.loads(data, parse_constant=_refuse_constant)
    if not isinstance(raw, dict):
        raise ValueError("progress datagram is not a JSON object")

    def integer(key: str, required: bool = False, high: int = MAX_STEP) -> int | None:
        value = raw.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"progress field {key!r} must be an integer, got {value!r}")
        if not 0 <= value <= high:
            raise ValueError(f"progress field {key!r} is out of range 0..{high}: {value}")
        return value

    phase = raw.get("ph", Phase.TRAIN.value)
    if not isinstance(phase, str) or phase not in _PHASES:
        raise ValueError(f"progress field 'ph' must be one of {', '.join(sorted(_PHASES))}, got {phase!r}")
    loss = raw.get("loss")
    if loss is not None and (not isinstance(loss, (int, float)) or isinstance(loss, bool)):
        raise ValueError(f"progress field 'loss' must be a number, got {loss!r}")
    if loss is not None and not math.isfinite(loss):  # 1e400 parses as infinity
        raise ValueError(f"progress field 'loss' must be a finite number, got {loss!r}")
    stall = raw.get("st")
    if stall is not None and (not isinstance(stall, (int, float)) or isinstance(stall, bool) or
                              not 0 <= stall <= MAX_STALL_SECONDS):  # NaN and inf fail too
        raise ValueError(f"progress field 'st' must be a number of seconds in 0..{MAX_STALL_SECONDS:g}, got "
                         f"{stall!r}")
    tier = raw.get("rt")
    if tier is not None and tier not in RESTORE_TIERS:
        raise ValueError(f"progress field 'rt' must be one of {', '.join(sorted(RESTORE_TIERS))}, got {tier!r}")
    return ProgressMessage(
        generation=integer("g", True) or 0,
        pid=integer("pid", True, MAX_PID) or 0,
        step=integer("step", True) or 0,
        examples=integer("examples"),
        loss=float(loss) if loss is not None else None,
        checkpoint_step=integer("ckpt"),
        done=raw.get("done") == 1,
        phase=Phase(phase),
        stall=float(stall) if stall is not None else None,
        restored_tier=tier,
        restored_step=integer("rs") if tier is not None else None,
        hears_peer_failure=tier is not None and raw.get("pf") == 1,
        exit_code=integer("x", high=MAX_EXIT_CODE),
        survivor_save=integer("sv"),
    )


_PHASES = frozenset(p.value for p in Phase)


def _phase(phase: Phase | str) -> Phase:
    if isinstance(phase, Phase):
        return phase
    if phase not in _PHASES:
        raise ValueError(f"phase {phase!r} is not one of {', '.join(sorted(_PHASES))}")
    return Phase(phase)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"progress datagram contains {name}, which is not a number")


class StepMark:
    """The trainer's side of ``TFELASTIC_STEP_FILE``: the last step it reached, for the agent to read after it."""

    def __init__(self, path: str, generation: int) -> None:
        with open(path, "r+b") as file:  # the agent made it, STEP_MARK.size bytes; the mapping outlives the fd
            self._map = mmap.mmap(file.fileno(), STEP_MARK.size)
        self._generation = generation

    @classmethod
    def open(cls, path: str | None, generation: int) -> StepMark | None:
        """None without a file to write (no agent, or one older than the step file): the mark is advisory."""
        if not path:
            return None
        try:
            return cls(path, generation)
        except (OSError, ValueError):
            return None

    def write(self, step: int) -> None:
        STEP_MARK.pack_into(self._map, 0, self._generation, step)


def read_step_mark(path: str, generation: int) -> int | None:
    """The agent's side: the step the trainer of ``generation`` last wrote, if it wrote one."""
    try:
        with open(path, "rb") as file:
            data = file.read(STEP_MARK.size)
    except OSError:
        return None
    if len(data) != STEP_MARK.size:
        return None
    written, step = STEP_MARK.unpack(data)
    return step if written == generation and 0 <= step <= MAX_STEP else None


def reset_step_mark(path: str) -> None:
    """Before each launch: no step of any generation (generations start at 1)."""
    with open(path, "wb") as file:
        file.write(STEP_MARK.pack(0, -1))


class ProgressReporter:
    """Sends progress to the agent, at most one report every ``min_interval`` seconds unless forced; marks every
    step it is given in the step file."""

    def __init__(self, path: str | None, generation: int, min_interval: float = 0.1,
                 step_file: str | None = None) -> None:
        self._path = path
        self._generation = generation
        self._min_interval = min_interval
        self._last_sent = -math.inf
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        self._mark = StepMark.open(step_file, generation) if path else None
        self._step = 0  # the last step reached, for a report that has none of its own (announce_exit)

    @classmethod
    def from_env(cls, min_interval: float = 0.1) -> ProgressReporter:
        return cls(os.environ.get(SOCKET_ENV), int(os.environ.get(GENERATION_ENV, "0")), min_interval,
                   os.environ.get(STEP_FILE_ENV))

    @property
    def marks_steps(self) -> bool:
        return self._mark is not None

    def reached(self, step: int) -> None:
        """The trainer finished ``step`` (a plain int): marked for the agent, with no report."""
        if 0 <= step <= MAX_STEP:
            self._step = step
            if self._mark is not None:
                self._mark.write(step)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def due(self) -> bool:
        """Whether a report now would be sent: callers skip reading (and syncing) values when it would not."""
        return self._sock is not None and time.monotonic() - self._last_sent >= self._min_interval

    def report(self, step: int, *, examples: int | None = None, loss: float | None = None,
               checkpoint_step: int | None = None, force: bool = False, done: bool = False,
               phase: Phase | str = Phase.TRAIN, stall: float | None = None, restored_tier: str | None = None,
               restored_step: int | None = None, hears_peer_failure: bool = False) -> bool:
        """Returns whether a datagram was sent. ``done`` (training completed), a ``phase`` other than ``train``
        (long work starts: a save, an evaluation), a checkpoint and a restore are sent at once.
        ``hears_peer_failure``, with a restore: this process listens for the agent's word that a peer failed
        (:mod:`~tfelastic.trainer.peer_failure`)."""
        if restored_tier is not None and restored_tier not in RESTORE_TIERS:
            raise ValueError(f"restored_tier {restored_tier!r} is not one of {', '.join(sorted(RESTORE_TIERS))}")
        phase = _phase(phase)  # a typo is the caller's bug: it raises, rather than drop every report
        if self._sock is None:
            return False
        if isinstance(step, int):  # a tensor is left for the send below to convert, if a report is due
            self.reached(step)
        now = time.monotonic()
        urgent = (force or done or checkpoint_step is not None or phase is not Phase.TRAIN
                  or restored_tier is not None)
        if not urgent and now - self._last_sent < self._min_interval:
            return False
        try:  # numbers may come as numpy scalars or tensors: make them plain
            message = ProgressMessage(self._generation, os.getpid(), int(step),
                                      None if examples is None else int(examples),
                                      None if loss is None else float(loss),
                                      None if checkpoint_step is None else int(checkpoint_step), done,
                                      phase, None if stall is None else float(stall), restored_tier,
                                      None if restored_step is None else int(restored_step),
                                      hears_peer_failure=hears_peer_failure and restored_tier is not None)
        except (TypeError, ValueError):
            return False  # a value is unusable; progress is advisory
        return self._send(message)

    def announce_exit(self, code: int, step: int | None = None) -> bool:
        """Tells the agent that this process exits with ``code`` and that everything it had to save is saved
        (``step``: the step saved, default the last one reached; the step file is left as it is). During a stop
        the agent then ends the process a second later if it has not ended by itself: what runs after this call
        (``finally`` blocks, the input pipeline's teardown, the interpreter's exit) gets that second."""
        if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= MAX_EXIT_CODE:
            raise ValueError(f"exit code {code!r} is not an integer in 0..{MAX_EXIT_CODE}")
        if self._sock is None:
            return False
        return self._send(ProgressMessage(self._generation, os.getpid(), self._step if step is None else int(step),
                                          exit_code=code))

    @property
    def last_step(self) -> int:
        """The last step reached (given to :meth:`report` or :meth:`reached`)."""
        return self._step

    def announce_survivor_save(self, step: int) -> bool:
        """Tells the agent that a peer failed and that this process now saves ``step``, the state it holds: the
        agent's stop then waits for the save (bounded) rather than SIGKILL the process after its failure grace."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step {step!r} is not an integer in 0..{MAX_STEP}")
        if self._sock is None:
            return False
        return self._send(ProgressMessage(self._generation, os.getpid(), step, survivor_save=step))

    def _send(self, message: ProgressMessage) -> bool:
        try:
            self._sock.sendto(encode(message), self._path)  # type: ignore[union-attr, arg-type]
        except OSError:
            return False  # the agent is busy or gone; progress is advisory
        self._last_sent = time.monotonic()
        return True


_default: ProgressReporter | None = None


def _default_reporter() -> ProgressReporter:
    global _default
    if _default is None:
        _default = ProgressReporter.from_env()
    return _default


def report(step: int, *, examples: int | None = None, loss: float | None = None,
           checkpoint_step: int | None = None, force: bool = False, done: bool = False,
           phase: Phase | str = Phase.TRAIN) -> bool:
    """Report progress through a reporter built from the environment the agent set. Before long work that is
    not a training step (a checkpoint save, an evaluation), report its ``phase`` ("save", "eval", "setup"): the
    agent's learned hang detection then allows it its own time."""
    return _default_reporter().report(step, examples=examples, loss=loss, checkpoint_step=checkpoint_step,
                                      force=force, done=done, phase=phase)


def announce_exit(code: int, step: int | None = None) -> bool:
    """:meth:`ProgressReporter.announce_exit` through a reporter built from the environment the agent set."""
    return _default_reporter().announce_exit(code, step)
