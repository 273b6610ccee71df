"""The last resort of a process that has decided how to exit: if it is still running some seconds later, it logs
where every thread is and ends with the exit code it decided on.

An agent's way out awaits gRPC (a leader hands the job over and steps down in etcd) and then tears down gRPC's
completion queue at interpreter exit. A gRPC that stopped delivering completions would hold the process forever:
the chaos soak found a drained leader whose gRPC, server and etcd channel alike, went silent while its event loop
ran on, and whose exit never came (grpc/grpc#40989 is one known way for the teardown to hang). A drained node must
leave, and systemd must see the exit code the agent decided on, not a kill after TimeoutStopSec.
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
