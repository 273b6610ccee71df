"""How a trainer ended, in words: its exit code, and what its last lines of output say about why it failed. Pure."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterable

# The last line of a Python traceback: "ZeroDivisionError: float division by zero", "tf.errors.OpError: ...".
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b(: .*)?$")


def exception_line(lines: Iterable[str]) -> str | None:
    """The exception a trainer died of, from its last lines of output: the last line of the last traceback, else
    the last line that looks like an exception; None when there is none."""
    lines = list(lines)
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=-1)
    found = None
    for line in lines[start + 1:]:
        if _EXCEPTION.match(line.strip()) and not line.startswith((" ", "\t")):
            found = line.strip()
    return found


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
