"""Every exit code a tfelastic process ends with: the one table (README.md and docs/operations.md document it).

The agent's codes are what systemd's unit reacts to (``RestartPreventExitStatus=78``); the trainer's own code 42
(checkpointed and stopped) is TensorFlow's and lives with the trainer, which imports nothing of the daemon.
"""

from __future__ import annotations

import enum

from tfelastic.trainer.exit_codes import CHECKPOINTED_AND_STOPPED


class ExitCode(enum.IntEnum):
    SUCCEEDED = 0  # the job succeeded, or the process was stopped on purpose (SIGTERM, SIGHUP, drain) and left cleanly
    FAILED = 1  # the job failed (restart budget, join timeout), or the coordinator stayed unreachable
    USAGE = 2  # a malformed command line (an unknown flag, a missing argument), as every command-line tool
    CONFIG = 78  # EX_CONFIG: bad configuration, wrong token or TLS, a job spec refused, a bad job state in etcd
    INTERRUPTED = 130  # a command-line tool stopped with Ctrl-C (128 + SIGINT)


EX_CONFIG = ExitCode.CONFIG

__all__ = ["CHECKPOINTED_AND_STOPPED", "EX_CONFIG", "ExitCode"]
