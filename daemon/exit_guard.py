"""The last resort of a process that has decided how to exit: if it is still running some seconds later, it logs
where every thread is and ends with the exit code it decided on.

An agent's way out awaits its own tasks and gRPC (a leader hands the job over and steps down in etcd), then
asyncio's and gRPC's teardown at interpreter exit. One await that never ends holds the process forever: the chaos
soak found a drained leader whose coordinator ticker had lost its cancel (server.py) and whose exit never came;
gRPC's teardown can hang too (grpc/grpc#40989). A drained node must leave, and systemd must see the exit code
the agent decided on, not a kill after TimeoutStopSec.
"""

from __future__ import annotations

import logging
import os
import threading

from tfelastic.daemon.aio import thread_stacks

log = logging.getLogger("tfelastic")


def exit_within(seconds: float, code: int, doing: str) -> threading.Timer:
    """Ends the process with ``code`` unless it has exited ``seconds`` from now; ``doing`` says what it was doing."""
    def fire() -> None:
        log.error("the agent decided to exit with code %d but is still %s %gs later; exiting now. Threads:\n%s",
                  code, doing, seconds, thread_stacks())
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os._exit(code)

    timer = threading.Timer(seconds, fire)
    timer.name, timer.daemon = "tfelastic-exit-guard", True
    timer.start()
    return timer
