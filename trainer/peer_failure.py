"""The agent's word that a peer failed: on its signal, this process's pending collectives are aborted, so that a
step blocked in one fails at once and the survivors' save (:mod:`~tfelastic.trainer.survivors`) runs.

Why it is needed: a collective learns of a dead peer by itself only when it has a call in flight to it. A worker
that waits for the peer to fetch its part of an all-reduce has none, and waits until TensorFlow's coordination
service declares the peer dead (about 10 s: docs/facts.md), by which time its agent has stopped it. The agent
knows within milliseconds.

How a signal reaches a thread that waits in TensorFlow's C++: Python's own C handler writes the signal's number
to the file descriptor of :func:`signal.set_wakeup_fd` at once, whatever the main thread does; a thread of this
module waits on it and aborts the collectives (TensorFlow's ``abort_collective_ops``, what
MultiWorkerMirroredStrategy's own health check calls). The Python-level handler, a no-op, runs later.

The agent names the signal in ``TFELASTIC_PEER_FAILED_SIGNAL`` (tfelastic.daemon.worker.process) and sends it
only to a trainer that said it listens (its restore report). Nothing is installed outside an agent, outside the
main thread, for a signal the trainer handles itself, or when the wakeup descriptor is in use (asyncio's).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType

from tfelastic.trainer._tf import eager_context, tf

log = logging.getLogger(__name__)

PEER_FAILED_SIGNAL_ENV = "TFELASTIC_PEER_FAILED_SIGNAL"  # tfelastic.daemon.worker.process.PEER_FAILED_SIGNAL_ENV
ABORT_MESSAGE = "tfelastic: a peer of this worker failed (its agent said so)"

_listening: bool | None = None  # once decided, for the process
_heard: list[Callable[[], None]] = []  # called in the watcher's thread once the collectives are aborted


def listen_for_peer_failure(on_word: Callable[[], None] | None = None, env: Mapping[str, str] = os.environ) -> bool:
    """Installs the listener once per process (see the module docstring); whether it listens. ``on_word`` is
    called, in the listener's thread, each time the agent's word comes (the survivors' save tells the agent that
    it will save, so that the stop waits for it while the training thread gets to its failed step)."""
    global _listening
    if _listening is None:
        _listening = _install(env)
    if _listening and on_word is not None:
        _heard.append(on_word)
    return _listening


def _install(env: Mapping[str, str]) -> bool:
    value = env.get(PEER_FAILED_SIGNAL_ENV, "").strip()
    if not value.isdigit() or threading.current_thread() is not threading.main_thread():
        return False
    signum = int(value)
    try:
        if signal.getsignal(signum) not in (signal.SIG_DFL, None):
            return False  # the trainer's own
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (asyncio): leave it
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return False
        signal.signal(signum, _noop)
    except (OSError, ValueError) as e:
        log.warning("no early word of a peer's failure in this process (signal %s): %s", value, e)
        return False
    threading.Thread(target=_watch, args=(read_end, signum), name="tfelastic-peer-failure", daemon=True).start()
    return True


def _noop(signum: int, frame: FrameType | None) -> None:
    """The signal's Python handler: the work is the watcher thread's."""


def _watch(read_end: int, signum: int) -> None:
    while True:
        try:
            data = os.read(read_end, 64)
        except OSError:
            return
        if not data:
            return
        if signum in data:  # every signal Python handles is written here: the others are not ours
            log.warning("the agent says a peer failed: aborting this worker's collectives")
            eager_context.context().abort_collective_ops(tf.errors.UNAVAILABLE, ABORT_MESSAGE)
            for heard in _heard:
                try:
                    heard()
                except Exception:  # advisory, as every report: the watcher must stay
                    log.exception("after the agent's word")
