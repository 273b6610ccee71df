"""What the agent promises the outside world: its exit codes (the trainer's variables: README.md)."""

from __future__ import annotations

import enum

from tfelastic.daemon.config import EX_CONFIG


class ExitCode(enum.IntEnum):
    SUCCEEDED = 0  # the job succeeded, or the agent was stopped on purpose (SIGTERM) and left cleanly
    FAILED = 1  # the job failed (restart budget, join timeout) or the coordinator stayed unreachable
    CONFIG = EX_CONFIG  # bad configuration, wrong token, or a job spec the coordinator refused



class FatalSessionError(Exception):
    """The coordinator refused this agent for a reason that retrying cannot fix."""

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = exit_code
