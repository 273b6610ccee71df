"""Automatic progress reporting for unmodified Keras scripts: ``model.fit`` gets a ProgressCallback by itself.

The agent puts :data:`SITE_DIR` first on the trainer's ``PYTHONPATH``; its ``sitecustomize`` waits for tf_keras's
training module and hands it to :func:`instrument_training_module`, after which every ``Model.fit`` without a
:class:`~tfelastic.trainer.callbacks.ProgressCallback` gets one. Covered: ``fit`` of tf_keras models, subclasses,
repeated calls. Not: custom loops (call :func:`tfelastic.trainer.report`), Keras 3, a ``CallbackList``, and
interpreters started with ``-I``, ``-E`` or ``-S`` (docs/instrumentation.md). Importing this module does not import
TensorFlow: it runs while tf_keras is being imported.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

# The directory the agent injects: it holds only sitecustomize.py (package data, not a package).
SITE_DIR = str(Path(__file__).resolve().with_name("sitedir"))
ENABLE_ENV = "TFELASTIC_INSTRUMENT"
OFF_VALUES = frozenset({"0", "false", "no", "off"})  # sitedir/sitecustomize.py keeps a copy (it imports nothing)
FIT_MODULE = "tf_keras.src.engine.training"  # where tf_keras defines Model.fit
_MARK = "_tfelastic_instrumented"

_warned = False
_reporter: Any = None  # one ProgressReporter (one socket) for every fit of the process, made on first use


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(ENABLE_ENV, "1").strip().lower() not in OFF_VALUES


def warn_once(what: str, error: BaseException) -> None:
    """The instrumentation never breaks the script: it says once on stderr why it is off, and steps aside."""
    global _warned
    if not _warned:
        _warned = True
        print(f"tfelastic: automatic progress reporting is off in this process: {what}: {error!r}",
              file=sys.stderr, flush=True)


def instrument_training_module(module: ModuleType) -> bool:
    """Wraps ``module.Model.fit``; returns False if it was wrapped already."""
    model = module.Model
    fit = model.fit
    if getattr(fit, _MARK, False):
        return False
    model.fit = _wrap_fit(fit)
    return True


def _wrap_fit(fit: Callable[..., Any]) -> Callable[..., Any]:
    # Position of ``callbacks`` among fit's arguments after self, for a call that passes it positionally.
    index = list(inspect.signature(fit).parameters).index("callbacks") - 1

    @functools.wraps(fit)
    def instrumented_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            args, kwargs = _with_progress(args, kwargs, index)
        except Exception as e:
            warn_once("cannot add the progress callback to fit", e)
        return fit(self, *args, **kwargs)

    setattr(instrumented_fit, _MARK, True)
    return instrumented_fit


def _with_progress(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    positional = len(args) > index
    callbacks = args[index] if positional else kwargs.get("callbacks")
    added = _add_progress(callbacks)
    if added is callbacks:
        return args, kwargs
    if positional:
        return (*args[:index], added, *args[index + 1:]), kwargs
    return args, {**kwargs, "callbacks": added}


def _add_progress(callbacks: Any) -> Any:
    """A new list with a progress callback appended (last, so it sees the save BackupAndRestore made in the same
    batch) and a save-phase callback put first (so the agent hears of a save before the script's own checkpoint
    callbacks make it), or ``callbacks`` itself when there is nothing to add. The caller's list is never
    changed."""
    import tensorflow as tf  # loaded already: fit is being called
    from tf_keras.callbacks import CallbackList

    reporter = _shared_reporter()
    if not reporter.enabled or isinstance(callbacks, CallbackList):
        return callbacks
    from tfelastic.trainer.callbacks import ProgressCallback, SavePhaseCallback

    existing = tf.nest.flatten(callbacks) if callbacks else []  # what Keras accepts: None, one, or a list
    progress, save_phase = _guarded_classes()
    reports = any(isinstance(c, ProgressCallback) for c in existing)  # the script reports by itself
    announces = any(isinstance(c, SavePhaseCallback) for c in existing)
    if reports and announces:
        return callbacks
    return [*([] if announces else [save_phase(reporter, existing)]), *existing,
            *([] if reports else [progress(reporter)])]


def _shared_reporter() -> Any:
    global _reporter
    if _reporter is None:
        from tfelastic.trainer.progress import ProgressReporter

        _reporter = ProgressReporter.from_env()
    return _reporter


_HOOKS = ("on_train_begin", "on_train_batch_end", "on_train_end", "on_epoch_end", "on_test_begin",
          "on_test_batch_end", "on_predict_begin", "on_predict_batch_end")


@functools.cache
def _guarded_classes() -> tuple[type, type]:
    """ProgressCallback and SavePhaseCallback whose errors are reported once and then silence them, instead of
    failing ``fit``."""
    from tfelastic.trainer.callbacks import ProgressCallback, SavePhaseCallback

    return _guarded(ProgressCallback, "AutoProgressCallback"), _guarded(SavePhaseCallback, "AutoSavePhaseCallback")


def _guarded(base: type, name: str) -> type:
    def guard(hook_name: str) -> Callable[..., None]:
        def hook(self: Any, *args: Any) -> None:
            if getattr(self, "_failed", False):
                return
            try:
                getattr(base, hook_name)(self, *args)
            except Exception as e:
                self._failed = True
                warn_once(f"the {base.__name__} failed", e)

        return hook

    # Only the hooks the base defines: Keras skips a batch hook a callback leaves at its default.
    hooks = {h: guard(h) for h in _HOOKS if any(h in vars(c) for c in base.__mro__ if c.__module__.startswith(
        "tfelastic"))}
    return type(name, (base,), hooks)


__all__ = ["ENABLE_ENV", "FIT_MODULE", "OFF_VALUES", "SITE_DIR", "enabled", "instrument_training_module"]
