"""Keras callbacks that connect ``model.fit`` to the local agent.

Importing this module imports TensorFlow and tf_keras (``TF_USE_LEGACY_KERAS=1`` is set first: FACTS 1).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from typing import Any

import tf_keras as keras
from tfelastic.trainer.progress import ProgressReporter


class ProgressCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Reports the optimizer step, examples seen, loss and saved checkpoints to the local agent.

    Cheap enough to leave on: values are read from the model (a device-to-host copy) only when a report is due,
    at most every ``min_interval`` of the reporter, or when a checkpoint was just saved. Checkpoints are seen by
    watching the BackupAndRestore of the same ``fit`` (``model._training_state``), so a restore that shifts the
    save schedule is reported at the step really saved. ``global_batch_size`` turns steps into examples.
    """

    def __init__(self, reporter: ProgressReporter | None = None, *, global_batch_size: int | None = None) -> None:
        super().__init__()
        self._reporter = reporter or ProgressReporter.from_env()
        self._global_batch_size = global_batch_size
        self._last_checkpoint: str | None = None
        self._supports_tf_logs = True  # keep Keras from syncing every batch's logs to numpy for us

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _latest_checkpoint(self) -> str | None:
        """The newest checkpoint BackupAndRestore wrote in this ``fit``: a cached attribute, no file access."""
        state = getattr(self.model, "_training_state", None)
        manager = getattr(state, "write_checkpoint_manager", None)
        return getattr(manager, "latest_checkpoint", None)

    def _saved_checkpoint(self) -> bool:
        latest = self._latest_checkpoint()
        if latest is None or latest == self._last_checkpoint:
            return False
        self._last_checkpoint = latest
        return True

    def _send(self, logs: dict[str, Any] | None, *, force: bool = False, done: bool = False) -> None:
        step = self._step()
        loss = (logs or {}).get("loss")
        examples = step * self._global_batch_size if self._global_batch_size else None
        saved = self._saved_checkpoint()
        self._reporter.report(step, examples=examples, loss=None if loss is None else float(loss),
                              checkpoint_step=step if saved else None, force=force, done=done)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.enabled:
            self._saved_checkpoint()  # a checkpoint restored at start is not a new save
            self._send(None, force=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.due() or (self._reporter.enabled and self._latest_checkpoint() != self._last_checkpoint):
            self._send(logs)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.enabled:
            self._send(logs, done=True)
