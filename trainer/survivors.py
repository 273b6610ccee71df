"""The survivors' save: when a peer's failure breaks a mirrored job's step, the workers left hold the last step that
every worker completed, in memory; two of them (ranks 0 and 1: one survives any single failure) write it to the
shared tier before the process ends, and the next generation restores it (the coordinator counts a step in the
backup dir as every member's). A failure then costs at most the step it interrupted.

How the save is reached: the step's collective fails the moment a peer's connection resets (a SIGKILL, an exit, a
node whose kernel still answers), and the exception returns to Python in the training thread; no signal handler
is needed, and none could run while that thread waits in TensorFlow's C++. A peer that hangs, or a node lost
without a reset, fails the collective only when TensorFlow's coordination service gives up on it (about 10 s):
the agent has stopped this trainer by then, and the next generation restores the newest snapshot.

Invariants: the state saved is exactly one step's: :mod:`~tfelastic.trainer.step_graph` confirms that the
collective that failed is one every update of the model waits for (else nothing is saved), and the optimizer's
step counter, which tf_keras advances without waiting for the exchange, is set back to the step completed. The
agent is told before the save starts (its stop waits for it, bounded) and again once it is durable. Nothing here
raises: the original error is the one the trainer raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from tfelastic.trainer._tf import tf
from tfelastic.trainer.peer_failure import listen_for_peer_failure
from tfelastic.trainer.progress import ProgressReporter
from tfelastic.trainer.step_graph import interrupted_before_any_update
from tfelastic.trainer.tiered import TieredCheckpoint

log = logging.getLogger(__name__)

# What a collective raises when a peer is gone (its connection reset, the coordination service's verdict, an
# abort): a worker's own errors (out of memory, a bad value) are not among them.
PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError,
                 tf.errors.DeadlineExceededError, tf.errors.InternalError, tf.errors.UnknownError)
WRITERS = 2  # ranks 0 .. WRITERS-1 write the survivors' step: one of them survives any single failure
FAILED_EXIT = 1  # the error is raised on: the trainer exits 1, its state saved


class SurvivorSave:
    """The survivors' save of one training loop (``fit``'s or :class:`~tfelastic.trainer.loop.TrainLoop`'s)."""

    def __init__(self, strategy: Any, model: Any, optimizer: Any, reporter: ProgressReporter, rank: int,
                 world_size: int) -> None:
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.reporter, self.rank = reporter, rank
        # A worker's own collective failure (one worker with several GPUs) is not a peer's: no survivors there.
        self.writes = world_size > 1 and rank < WRITERS
        self.saved: str | None = None  # the snapshot written, once one is
        # The agent's word that a peer failed aborts a collective that waits without a call in flight to it; the
        # trainer's restore report says it listens, which is also what makes its agent hold a failure stop for it.
        self.hears_peer_failure = self.writes and listen_for_peer_failure(self._word_heard)

    def _word_heard(self) -> None:
        """The agent said a peer failed: the save comes once the training thread meets its failed step, which may
        finish work first (a periodic save): the stop waits for it (bounded by the agent)."""
        self.reporter.announce_survivor_save(self.reporter.last_step)

    def after_failure(self, error: BaseException, step_function: Any, step_args: Sequence[Any], completed: int,
                      started_at: int, tier: TieredCheckpoint, prepare: Callable[[], None]) -> None:
        """``error`` ended a call of ``step_function`` (a ``tf.function``; ``step_args``: its arguments) after
        ``completed`` steps (the run began at ``started_at``): saves that step if the state is exactly it (see the
        module docstring). ``prepare`` sets the checkpointed position (epoch, place in it) to the step's."""
        if not self.writes or not isinstance(error, PEER_FAILURES) or completed <= started_at:
            return
        # Told first, the agent keeps its stop waiting (bounded); told last, it ends the stop: whatever happens in
        # between (the graph's answer, a save that fails), nothing is left for the process to do.
        self.reporter.announce_survivor_save(completed)
        try:
            self._save(error, step_function, step_args, completed, tier, prepare)
        finally:
            self.reporter.announce_exit(FAILED_EXIT, completed)

    def _save(self, error: BaseException, step_function: Any, step_args: Sequence[Any], completed: int,
              tier: TieredCheckpoint, prepare: Callable[[], None]) -> None:
        cause = f"{type(error).__name__}: {cause_line(error)}"
        if not self._one_steps_state(error, step_function, step_args, completed, cause):
            return
        began = time.monotonic()
        try:
            prepare()
            path = tier.save_for_survivors(completed, task=f"rank {self.rank}", cause=cause)
        except Exception as e:  # the original error is the one to raise; this one is said
            log.warning("a peer failed (%s); saving step %d, the state this worker holds, failed: %s: %s (a "
                        "sync-on-read variable, such as a batch normalization's statistics, is read by an "
                        "all-reduce). The next generation restores the newest snapshot", cause, completed,
                        type(e).__name__, cause_line(e))
            return
        self.saved = path
        log.warning("a peer failed (%s): saved step %d, the state this worker holds, for the next generation %s "
                    "(%.2fs)", cause, completed, f"to {path}" if path else "(the shared tier had it)",
                    time.monotonic() - began)

    def _one_steps_state(self, error: BaseException, step_function: Any, step_args: Sequence[Any], completed: int,
                         cause: str) -> bool:
        """Whether the variables hold exactly step ``completed`` (the optimizer's counter set back to it)."""
        try:
            traced = step_function.get_concrete_function(*step_args)
            # Every variable of the model: a layer's own state (a batch normalization's statistics, a generator)
            # is updated in the step too, and need not wait for the exchange.
            clean = interrupted_before_any_update(error, traced, self.model.variables)
        except Exception as e:  # a function this module cannot read: nothing is known
            log.debug("cannot read the step's graph: %s: %s", type(e).__name__, e)
            clean = False
        counted = int(self.optimizer.iterations.numpy())
        if not clean or counted not in (completed, completed + 1):
            log.warning("a peer failed (%s); the state this worker holds is not saved: the step may have updated "
                        "some variables before it failed (%s). The next generation restores the newest snapshot",
                        cause, f"its optimizer counts step {counted}" if clean else
                        "the collective that failed is not one that every update waits for")
            return False
        if counted != completed:
            # tf_keras advances its step counter without waiting for the exchange (measured: docs/facts.md).
            self.optimizer.iterations.assign(completed)
        return True


def cause_line(error: BaseException) -> str:
    """The line of an error that says why: a failed collective's "Collective ops is aborted by: ..." (TensorFlow's
    first line is "Graph execution error:"), else its first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "aborted by" in line:
            return line[:300]
    return lines[0][:300] if lines else ""
