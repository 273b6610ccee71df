"""Exit codes a trainer uses to tell its agent how it ended. Importing this module imports nothing heavy."""

# The trainer saved a checkpoint at a step boundary agreed by every worker, then exited on a stop request
# (SIGTERM from the agent: a drain, a scale-up, ``systemctl stop``): nothing done since that step is lost.
# The value is TensorFlow's own: PreemptionCheckpointHandler's default exit_fn exits 42 off Google Cloud, so
# unmodified scripts that use ``BackupAndRestore(save_before_preemption=True)`` are understood as well.
CHECKPOINTED_AND_STOPPED = 42
