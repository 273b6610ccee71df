"""Graceful stop: on SIGTERM every worker saves at one agreed step boundary, then exits 42
(:data:`~tfelastic.trainer.exit_codes.CHECKPOINTED_AND_STOPPED`).

This module owns SIGTERM in the trainer. Inside :meth:`StopSignal.training` the workers agree on the step through
TensorFlow's ``PreemptionCheckpointHandler`` (built with our ``TerminationConfig``, with the GCE metadata server
hidden while it is built), all save there, and each raises :class:`Preempted` (a ``SystemExit(42)``); outside
training the signal raises :class:`Preempted` at once, nothing being unsaved. One handler per process
(:func:`preemption_guard`). Why not TensorFlow's defaults: docs/trainer.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from tfelastic.trainer._tf import tf
from tfelastic.trainer.exit_codes import CHECKPOINTED_AND_STOPPED
from tfelastic.trainer.progress import announce_exit

log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """The trainer saved at an agreed step (or had nothing unsaved) and stops: exit code 42.

    A ``SystemExit``, so an uncaught one ends the process with 42 after ``finally`` blocks ran. ``step`` is the
    step of the checkpoint saved for the stop, None when the stop came outside training.

    Creating one tells the agent that the state is saved and the process exits 42
    (:func:`~tfelastic.trainer.progress.announce_exit`): during a stop the agent ends the process a second later if
    it has not ended by then, rather than wait out its grace while the input pipeline is torn down (tf.data's
    autotuning thread can hold ``fit``'s return for up to a minute).
    """

    def __init__(self, step: int | None = None) -> None:
        super().__init__(CHECKPOINTED_AND_STOPPED)
        self.step = step
        # Advisory, as every report: nothing here may turn the stop's exit 42 into a traceback (a bad
        # TFELASTIC_GENERATION, no file descriptor left for the socket).
        with contextlib.suppress(OSError, ValueError):
            announce_exit(CHECKPOINTED_AND_STOPPED, step)


class StopSignal:
    """The process's SIGTERM: remembered while training, a :class:`Preempted` at once outside it."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self._training = 0
        self._installed = False

    def install(self) -> None:
        """Installs the handler; call after creating the strategy (MWMS installs its own, which swallows it)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("SIGTERM handling not installed: signal handlers can only be set from the main thread")
            return
        signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    @property
    def installed(self) -> bool:
        return self._installed

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """While inside, a SIGTERM waits for the agreed step; leaving after one arrived raises Preempted."""
        self._training += 1
        completed = False
        try:
            yield
            completed = True
        finally:
            self._training -= 1
        if completed and self.received.is_set() and not self._training:
            raise Preempted()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.set()
        if not self._training:
            log.info("SIGTERM outside training: nothing unsaved, exiting %d", CHECKPOINTED_AND_STOPPED)
            raise Preempted()
        log.info("SIGTERM: stopping at the next step all workers agree on")


STOP = StopSignal()


class _DropDeprecationNotice(logging.Filter):
    """The handler's own save path calls its deprecated ``total_run_calls``: a warning the user cannot act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "total_run_calls" not in record.getMessage()


class PreemptionGuard:
    """Agrees with every worker on a step to stop at, saves there, and raises :class:`Preempted`.

    One per process (:func:`preemption_guard`): the handler keeps its agreement keys in the coordination
    service for the life of the process. Call :meth:`after_step` after every training step on every worker.
    """

    def __init__(self, strategy: Any) -> None:
        self._save: Callable[[], int] | None = None
        self._saved_step: int | None = None
        config = tf.distribute.experimental.TerminationConfig(
            termination_watcher_fn=STOP.received.is_set, exit_fn=self._exit, grace_period=0, save_fn=self._run_save)
        unused = tempfile.mkdtemp(prefix="tfelastic-preemption-")
        try:
            # Our saves go through save_fn; the handler's own manager only needs a directory without checkpoints.
            manager = tf.train.CheckpointManager(tf.train.Checkpoint(), unused, max_to_keep=1)
            with _no_metadata_server():
                self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
                    strategy.cluster_resolver, manager, termination_config=config)
        finally:
            os.rmdir(unused)
        tf.get_logger().addFilter(_DropDeprecationNotice())
        if not STOP.installed:
            STOP.install()

    def after_step(self, save: Callable[[], int]) -> None:
        """If the workers agreed to stop at this step: ``save()`` (it returns the step saved), then raise."""
        self._save = save
        self._handler.save_checkpoint_if_preempted()

    def _run_save(self, *args: object, **kwargs: object) -> None:
        assert self._save is not None
        self._saved_step = self._save()

    def _exit(self) -> None:
        log.info("saved at step %s for a stop request; exiting %d", self._saved_step, CHECKPOINTED_AND_STOPPED)
        raise Preempted(self._saved_step)


_guard: PreemptionGuard | None = None


def preemption_guard(strategy: Any) -> PreemptionGuard:
    """The process's guard, created on first use with ``strategy``."""
    global _guard
    if _guard is None:
        _guard = PreemptionGuard(strategy)
    return _guard


@contextlib.contextmanager
def _no_metadata_server() -> Iterator[None]:
    """Points TensorFlow's GCE metadata address at a local port that refuses connections (bound, not listening):
    platform detection then fails in milliseconds and takes the SIGTERM path on every platform."""
    saved = os.environ.get("GCE_METADATA_IP")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        os.environ["GCE_METADATA_IP"] = f"127.0.0.1:{closed.getsockname()[1]}"
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("GCE_METADATA_IP", None)
            else:
                os.environ["GCE_METADATA_IP"] = saved
