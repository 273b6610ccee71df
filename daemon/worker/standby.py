"""The warm-start standby: a Python interpreter that has imported TensorFlow and waits to become a trainer.

Run by the keeper as ``PYTHON standby.py``, with the trainer's environment less the generation's values and two
pipes in ``TFELASTIC_STANDBY_FD``: it imports TensorFlow (no GPU touched, no port opened), says R on the second
pipe, and blocks on the first. A launch writes one JSON object, ``{"argv", "env", "cwd"}``; the standby answers L
and runs ``argv`` as ``__main__`` exactly as a cold start would (``__name__``, ``__file__``, ``sys.argv``,
``sys.path[0]``, the working directory, the environment). End of file without a message exits 0.
``TFELASTIC_STANDBY_NICE``: the import runs at that lower CPU priority, and every thread is back at its own before
the script runs (when that is not allowed, the launch starts cold). Standard library only: it runs in the
trainer's interpreter, where tfelastic need not be installed.
"""

import builtins
import contextlib
import json
import os
import runpy
import sys
import types
from importlib.machinery import SourceFileLoader
from typing import Any

FD_ENV = "TFELASTIC_STANDBY_FD"  # "LAUNCH_FD,SIGNAL_FD": the launch comes on the first; R and L go on the second
NICE_ENV = "TFELASTIC_STANDBY_NICE"  # how much lower its CPU priority is while it waits
LEGACY_KERAS_VALUES = ("1", "true", "yes")


def _preimport() -> None:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return  # a trainer without TensorFlow: the interpreter's own start-up is still saved
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in LEGACY_KERAS_VALUES:
        with contextlib.suppress(ImportError):
            import tf_keras  # noqa: F401


def _read_launch(fd: int) -> dict[str, Any]:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    launch: dict[str, Any] = json.loads(b"".join(chunks)) if chunks else {}
    return launch


def _become(launch: dict[str, Any], set_by_import: dict[str, str]) -> None:
    """The process state a cold start of ``argv`` would have had once it imported TensorFlow: the launch's
    environment, with what the import itself set (TensorFlow sets TF2_BEHAVIOR, TPU_ML_PLATFORM, ...)."""
    os.chdir(launch["cwd"])
    os.environ.clear()
    os.environ.update(launch["env"])
    os.environ.update(set_by_import)
    if hasattr(sys, "orig_argv"):
        sys.orig_argv = list(launch["argv"])


def _set_path0(entry: str) -> None:
    """What the interpreter puts first on sys.path for a script or -m; nothing with -P or PYTHONSAFEPATH, where
    the standby's own first entry is not its directory either."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = entry


def _run_script(path: str, args: list[str]) -> None:
    absolute = os.path.abspath(path)
    sys.argv = [path, *args]
    _set_path0(os.path.dirname(os.path.realpath(absolute)))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=absolute, __cached__=None, __loader__=SourceFileLoader("__main__", absolute),
                         __spec__=None, __package__=None, __builtins__=builtins)
    sys.modules["__main__"] = main
    with open(absolute, "rb") as f:
        code = compile(f.read(), absolute, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _run_module(module: str, args: list[str]) -> None:
    """As ``python -m`` does (runpy's own entry for it), in a fresh ``__main__`` that stays after the module's
    body returns, for its atexit handlers and threads."""
    sys.argv = ["-m", *args]  # replaced by the module's file, as -m does
    _set_path0(os.getcwd())
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]


def _restore_priority(priority: int) -> bool:
    """Every thread back to ``priority`` (the import may have started some): a trainer must not run niced."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), priority)
    except OSError as e:
        print(f"the standby cannot raise its priority back to {priority} ({e.strerror}): not taking the launch",
              file=sys.stderr)
        return False
    return True


def main() -> None:
    launch_fd, ready_fd = (int(fd) for fd in os.environ.pop(FD_ENV).split(","))
    nice = int(os.environ.pop(NICE_ENV, "0"))
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    if nice:
        os.nice(nice)
    before = dict(os.environ)
    _preimport()
    set_by_import = {k: v for k, v in os.environ.items() if before.get(k) != v}
    os.write(ready_fd, b"R")
    launch = _read_launch(launch_fd)
    if not launch or (nice and not _restore_priority(priority)):
        os._exit(0)
    os.write(ready_fd, b"L")  # the agent treats the launch as failed (and starts cold) until it hears this
    os.close(ready_fd)
    _become(launch, set_by_import)
    argv = launch["argv"]
    if argv[1] == "-m":
        _run_module(argv[2], argv[3:])
    else:
        _run_script(argv[1], argv[2:])


if __name__ == "__main__":
    main()
