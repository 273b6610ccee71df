"""Progress reports from a trainer to its local agent: one datagram on a Unix socket per report.

The agent sets ``TFELASTIC_PROGRESS_SOCKET``. Without it (no agent) every call is a no-op. A send never blocks
and never raises: if the agent is busy or gone, the report is dropped, and training goes on.

Wire format (the agent decodes it with :func:`decode`): a JSON object with ``g`` (generation), ``pid``,
``step`` and the optional ``examples``, ``loss``, ``ckpt`` (the step of the last checkpoint saved), ``done``
(training completed: an exit 0 after this is a completion even if the agent was stopping the worker) and ``ph``
(the :class:`Phase` the trainer enters, when it is not ``train``: the agent's hang detection gives long work its
own allowance; see :mod:`tfelastic.daemon.worker.stall`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass
from enum import Enum

SOCKET_ENV = "TFELASTIC_PROGRESS_SOCKET"
GENERATION_ENV = "TFELASTIC_GENERATION"
MAX_DATAGRAM = 512
MAX_INT = 1 << 62


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
    return json.dumps(payload, separators=(",", ":")).encode()


def decode(data: bytes) -> ProgressMessage:
    """Raises ValueError on anything that is not a well-formed report."""
    if len(data) > MAX_DATAGRAM:
        raise ValueError(f"progress datagram of {len(data)} bytes exceeds {MAX_DATAGRAM}")
    raw = json.loads(data, parse_constant=_refuse_constant)
    if not isinstance(raw, dict):
        raise ValueError("progress datagram is not a JSON object")

    def integer(key: str, required: bool = False) -> int | None:
        value = raw.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"progress field {key!r} must be an integer, got {value!r}")
        if not -MAX_INT <= value <= MAX_INT:
            raise ValueError(f"progress field {key!r} is out of range: {value}")
        return value

    phase = raw.get("ph", Phase.TRAIN.value)
    if not isinstance(phase, str) or phase not in _PHASES:
        raise ValueError(f"progress field 'ph' must be one of {', '.join(sorted(_PHASES))}, got {phase!r}")
    loss = raw.get("loss")
    if loss is not None and (not isinstance(loss, (int, float)) or isinstance(loss, bool)):
        raise ValueError(f"progress field 'loss' must be a number, got {loss!r}")
    return ProgressMessage(
        generation=integer("g", True) or 0,
        pid=integer("pid", True) or 0,
        step=integer("step", True) or 0,
        examples=integer("examples"),
        loss=float(loss) if loss is not None else None,
        checkpoint_step=integer("ckpt"),
        done=raw.get("done") == 1,
        phase=Phase(phase),
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


class ProgressReporter:
    """Sends progress to the agent, at most one report every ``min_interval`` seconds unless forced."""

    def __init__(self, path: str | None, generation: int, min_interval: float = 0.1) -> None:
        self._path = path
        self._generation = generation
        self._min_interval = min_interval
        self._last_sent = -math.inf
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls, min_interval: float = 0.1) -> ProgressReporter:
        return cls(os.environ.get(SOCKET_ENV), int(os.environ.get(GENERATION_ENV, "0")), min_interval)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def due(self) -> bool:
        """Whether a report now would be sent: callers skip reading (and syncing) values when it would not."""
        return self._sock is not None and time.monotonic() - self._last_sent >= self._min_interval

    def report(self, step: int, *, examples: int | None = None, loss: float | None = None,
               checkpoint_step: int | None = None, force: bool = False, done: bool = False,
               phase: Phase | str = Phase.TRAIN) -> bool:
        """Returns whether a datagram was sent. ``done`` (training completed) and a ``phase`` other than
        ``train`` (long work starts: a save, an evaluation) are sent at once."""
        phase = _phase(phase)  # a typo is the caller's bug: it raises, rather than drop every report
        if self._sock is None:
            return False
        now = time.monotonic()
        urgent = force or done or checkpoint_step is not None or phase is not Phase.TRAIN
        if not urgent and now - self._last_sent < self._min_interval:
            return False
        try:  # numbers may come as numpy scalars or tensors: make them plain
            message = ProgressMessage(self._generation, os.getpid(), int(step),
                                      None if examples is None else int(examples),
                                      None if loss is None else float(loss),
                                      None if checkpoint_step is None else int(checkpoint_step), done,
                                      phase)
            self._sock.sendto(encode(message), self._path)  # type: ignore[arg-type]
        except (OSError, TypeError, ValueError):
            return False  # the agent is busy or gone, or a value is unusable; progress is advisory
        self._last_sent = now
        return True


_default: ProgressReporter | None = None


def report(step: int, *, examples: int | None = None, loss: float | None = None,
           checkpoint_step: int | None = None, force: bool = False, done: bool = False,
           phase: Phase | str = Phase.TRAIN) -> bool:
    """Report progress through a reporter built from the environment the agent set. Before long work that is
    not a training step (a checkpoint save, an evaluation), report its ``phase`` ("save", "eval", "setup"): the
    agent's learned hang detection then allows it its own time."""
    global _default
    if _default is None:
        _default = ProgressReporter.from_env()
    return _default.report(step, examples=examples, loss=loss, checkpoint_step=checkpoint_step, force=force,
                           done=done, phase=phase)
