"""The tf_keras guard: Keras 3 cannot run ``model.fit`` under MultiWorkerMirroredStrategy.

TensorFlow picks the Keras behind ``tf.keras`` from ``TF_USE_LEGACY_KERAS`` when it is imported, so the variable
must be set before the first ``import tensorflow``: :mod:`tfelastic.trainer._tf`, through which the library's
modules import TensorFlow, calls :func:`ensure_legacy_keras` first. :func:`check_keras` and :func:`check_model`
fail with the fix when it is too late (TensorFlow was imported first, the variable says no) or a model is a
Keras 3 model. Importing this module imports nothing heavy; the checks read ``sys.modules`` only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from types import ModuleType
from typing import Any

LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
_TRUE = ("true", "True", "1")  # exactly the values TensorFlow accepts


class KerasVersionError(RuntimeError):
    """Keras 3 would run under MultiWorkerMirroredStrategy."""


_FIX = (f"Set {LEGACY_KERAS_ENV}=1 before TensorFlow is imported (export it in the shell, or import "
        "tfelastic.trainer.strategy before tensorflow), install tf-keras (pip install tf-keras), and use "
        "tf_keras or tf.keras, not the keras package")


def ensure_legacy_keras(environ: MutableMapping[str, str] | None = None,
                        modules: Mapping[str, ModuleType] | None = None) -> None:
    """Sets ``TF_USE_LEGACY_KERAS=1`` if it is unset, then :func:`check_keras`. Call it before importing TF."""
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    if "tensorflow" not in mods:
        env.setdefault(LEGACY_KERAS_ENV, "1")
    check_keras(env, mods)


def check_keras(environ: Mapping[str, str] | None = None, modules: Mapping[str, ModuleType] | None = None) -> None:
    """Raises :class:`KerasVersionError` if ``tf.keras`` is, or will be, Keras 3."""
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    value = env.get(LEGACY_KERAS_ENV)
    tf = mods.get("tensorflow")
    if tf is None:
        if value is not None and value not in _TRUE:
            raise KerasVersionError(f"{LEGACY_KERAS_ENV}={value!r} makes tf.keras Keras 3, which cannot run "
                                    f"MultiWorkerMirroredStrategy. {_FIX}")
        return
    legacy_at_import = getattr(tf, "_tf_uses_legacy_keras", None)
    if legacy_at_import is False:
        if value in _TRUE:
            when = f"TensorFlow was imported before {LEGACY_KERAS_ENV}=1 was set"
        else:
            when = f"TensorFlow was imported with {LEGACY_KERAS_ENV}" + (" unset" if value is None else f"={value!r}")
        raise KerasVersionError(f"tf.keras is Keras 3 in this process ({when}); Keras 3 cannot run "
                                f"MultiWorkerMirroredStrategy. {_FIX}")
    if legacy_at_import is None and _keras_major(tf) == 3:  # a TensorFlow without the flag: ask tf.keras
        raise KerasVersionError(f"tf.keras resolves to Keras 3, which cannot run MultiWorkerMirroredStrategy. {_FIX}")


def check_model(model: Any) -> None:
    """Raises :class:`KerasVersionError` if ``model`` was built with Keras 3 (``import keras``)."""
    root = type(model).__module__.split(".")[0]
    if root == "keras":
        raise KerasVersionError(f"the model is a Keras 3 model ({type(model).__module__}.{type(model).__name__}); "
                                f"Keras 3 cannot run MultiWorkerMirroredStrategy. Build it with tf_keras "
                                f"(import tf_keras as keras). {_FIX}")


def _keras_major(tf: ModuleType) -> int | None:
    try:
        version = str(tf.keras.__version__)
    except (AttributeError, ImportError):
        return None
    head = version.split(".")[0]
    return int(head) if head.isdigit() else None
