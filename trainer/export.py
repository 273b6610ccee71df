"""The final model, written by the chief where the job says, loadable without a strategy.

Every worker must call :func:`export_model`: under MultiWorkerMirroredStrategy saving may run collectives (a
sync-on-read variable is all-reduced when read). The chief writes next to the target and renames into place, so
a reader never sees half an export; the other workers write to a local temporary directory and delete it.

A path ending in ``.keras`` gets the Keras format (one zip file); any other path a SavedModel directory (with a
``serving_default`` signature, loadable by ``tf.saved_model.load`` without tf_keras). :func:`load_model` loads
either outside any strategy.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from tfelastic.trainer._tf import keras, tf
from tfelastic.trainer.scratch import process_temp_dir
from tfelastic.trainer.tfkeras import check_model


def export_model(model: Any, path: str, strategy: Any | None = None) -> str | None:
    """Saves ``model`` to ``path`` on the chief; returns ``path`` there and None on the other workers."""
    check_model(model)
    strategy = strategy or tf.distribute.get_strategy()
    if strategy.extended.should_checkpoint:
        _save_then_rename(model, path)
        return path
    scratch = process_temp_dir("export")
    try:
        model.save(os.path.join(scratch, os.path.basename(path.rstrip("/")) or "model"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None


def load_model(path: str) -> Any:
    """The exported model without its optimizer (for inference and evaluation); call it outside any strategy."""
    return keras.models.load_model(path, compile=False)


def _save_then_rename(model: Any, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    tf.io.gfile.makedirs(parent)
    partial = f"{path.rstrip('/')}.partial-{os.getpid()}"
    if path.endswith(".keras"):
        partial += ".keras"  # the Keras format is chosen by the suffix
    _remove(partial)
    model.save(partial)
    _remove(path)
    tf.io.gfile.rename(partial, path)


def _remove(path: str) -> None:
    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    elif tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)

