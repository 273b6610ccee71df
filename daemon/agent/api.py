"""What the agent promises the outside world: its exit codes and the variables its trainer gets."""

from __future__ import annotations

import enum

from tfelastic.daemon.config import EX_CONFIG


class ExitCode(enum.IntEnum):
    SUCCEEDED = 0  # the job succeeded, or the agent was stopped on purpose (SIGTERM) and left cleanly
    FAILED = 1  # the job failed (restart budget, join timeout) or the coordinator stayed unreachable
    CONFIG = EX_CONFIG  # bad configuration, wrong token, or a job spec the coordinator refused


# Variables set for every trainer. TF_USE_LEGACY_KERAS=1 is also set unless the user sets it otherwise.
TRAINER_ENV = (
    "TF_CONFIG",
    "TFELASTIC_JOB",
    "TFELASTIC_NODE_ID",
    "TFELASTIC_RANK",
    "TFELASTIC_WORLD_SIZE",
    "TFELASTIC_GENERATION",
    "TFELASTIC_RESTART_COUNT",
    "TFELASTIC_BACKUP_DIR",
    "TFELASTIC_PROGRESS_SOCKET",
)


class FatalSessionError(Exception):
    """The coordinator refused this agent for a reason that retrying cannot fix."""

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = exit_code
