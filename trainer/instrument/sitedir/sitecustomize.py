"""tfelastic's automatic progress reporting, run by Python at start-up in every trainer process.

The agent puts this file's directory first on the trainer's ``PYTHONPATH`` (see tfelastic.trainer.instrument),
so Python's ``site`` imports this file as ``sitecustomize``. It must cost nothing in programs that never use
Keras, so it imports no module (``sys`` and ``os`` are loaded already) and adds one import finder whose only
work per import is one string comparison. When tf_keras's training module is imported, the finder lets it load
and then hands it to ``tfelastic.trainer.instrument``, which wraps ``Model.fit``. Any error is reported once on
stderr and ignored: the script runs as if this file were not there.

Then it runs the ``sitecustomize`` this file shadows, if any (a virtual environment's, or the distribution's),
so that whatever the environment sets up there still happens, errors included.

First of all it registers :mod:`faulthandler` (a built-in module) for the signal the agent names in
``TFELASTIC_STACKS_SIGNAL``: the agent asks a hung trainer for its Python stacks with it (tfelastic.trainer.stacks).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported at start-up; type checkers treat this name as true
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

_TARGET = "tf_keras.src.engine.training"  # tfelastic.trainer.instrument.FIT_MODULE
_OFF_VALUES = ("0", "false", "no", "off")  # tfelastic.trainer.instrument.OFF_VALUES
_HERE = os.path.dirname(os.path.realpath(__file__))


def _warn(what: str, error: BaseException) -> None:
    print(f"tfelastic: automatic progress reporting is off in this process: {what}: {error!r}",
          file=sys.stderr, flush=True)


def _register_stack_dump() -> None:
    """tfelastic.trainer.stacks.register_stack_dump, which this file cannot import (it would cost every program)."""
    value = os.environ.get("TFELASTIC_STACKS_SIGNAL", "").strip()
    if value.isdigit():
        try:
            import faulthandler

            faulthandler.register(int(value), all_threads=True, chain=False)
        except Exception as e:  # a closed stderr, say: the trainer runs on, the agent reports the hang without stacks
            print(f"tfelastic: no stack dump on signal {value} in this process: {e!r}", file=sys.stderr, flush=True)


def _instrument(module: ModuleType) -> None:
    try:
        from tfelastic.trainer.instrument import instrument_training_module

        instrument_training_module(module)
    except Exception as e:  # e.g. tfelastic is not installed for the interpreter that runs the trainer
        _warn(f"cannot instrument {_TARGET}", e)


class _PatchingLoader:
    """Runs the real loader, then instruments the module. The module keeps its real loader (for tracebacks,
    ``inspect`` and ``importlib.reload``), so the only trace of this class is the wrapped ``fit``."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        _instrument(module)


class TfelasticFitFinder:
    """A meta path finder that only answers for tf_keras's training module, and only once."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _TARGET:
            return None
        try:
            sys.meta_path.remove(self)  # one module to watch; later imports pay nothing at all
            spec = self._real_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]
            return spec
        except Exception as e:
            _warn(f"cannot watch {_TARGET}", e)
            return None  # the ordinary finders take over

    @staticmethod
    def _real_spec(fullname: str, path: Sequence[str] | None, target: ModuleType | None) -> ModuleSpec | None:
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                return spec
        return None


def _real(entry: str) -> str:
    return os.path.realpath(entry or os.getcwd())


def _chain() -> None:
    """Runs the next ``sitecustomize`` on sys.path, the one Python would have run without this file."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", [p for p in sys.path if isinstance(p, str) and _real(p) != _HERE])
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec

    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # ``import sitecustomize`` finds the environment's own, as before
    spec.loader.exec_module(module)  # its errors reach site.py, which reports them as it always did


_register_stack_dump()
if os.environ.get("TFELASTIC_INSTRUMENT", "1").strip().lower() not in _OFF_VALUES \
        and _TARGET not in sys.modules:
    sys.meta_path.insert(0, TfelasticFitFinder())
_chain()
