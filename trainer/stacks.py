"""Every thread's Python stack to stderr when the agent asks, before it reports this trainer hung.

The agent names the signal in ``TFELASTIC_STACKS_SIGNAL`` (tfelastic.daemon.worker.stacks). :mod:`faulthandler`'s
handler is C: it runs while the main thread waits in TensorFlow's C++, where a Python signal handler would wait for
the call to return. The instrumentation's ``sitecustomize`` registers it already in every Python program of the
worker; importing :mod:`tfelastic.trainer` registers it too, for a trainer the instrumentation misses (started with
``-I``, ``-E`` or ``-S``, or with the instrumentation off). Outside an agent nothing is registered.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Mapping

STACKS_SIGNAL_ENV = "TFELASTIC_STACKS_SIGNAL"  # tfelastic.daemon.worker.stacks.STACKS_SIGNAL_ENV


def register_stack_dump(env: Mapping[str, str] = os.environ) -> bool:
    """Registers the dump for the agent's signal; False outside an agent (or with a value that is no number),
    when the trainer handles that signal itself (its handler stays), or when stderr has no file descriptor to
    write to (a wrapper object, or none): an import never fails for it."""
    value = env.get(STACKS_SIGNAL_ENV, "").strip()
    if not value.isdigit():
        return False
    try:
        if signal.getsignal(int(value)) not in (signal.SIG_DFL, None):  # None: a C handler, faulthandler's say
            return False
        faulthandler.register(int(value), all_threads=True, chain=False)  # chain: the default action kills us
    except (OSError, ValueError, AttributeError, RuntimeError) as e:  # io.UnsupportedOperation: no fileno()
        if sys.stderr is not None:
            print(f"tfelastic: no stack dump on signal {value} in this process: {e!r}", file=sys.stderr, flush=True)
        return False
    return True
