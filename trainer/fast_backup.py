"""``model.fit`` on the fast checkpoint tier: :class:`FastBackupAndRestore`, what :func:`fit_callbacks` uses by
default in place of tf_keras's ``BackupAndRestore``.

It keeps tf_keras's own resume logic: the model's ``_training_state`` is a
:class:`~tf_keras.src.distribute.worker_training_state.WorkerTrainingState` whose storage is a
:class:`~tfelastic.trainer.tiered.TieredCheckpoint`, so ``fit`` resumes at the saved epoch and batch exactly as
with ``BackupAndRestore(save_freq=N)``. Saves are asynchronous snapshots (see :mod:`tfelastic.trainer.tiered`),
every ``save_every`` steps, or, by default, as often as the overhead budget allows
(:mod:`tfelastic.trainer.save_schedule`); in a multi-worker job the workers adopt the chief's interval.

Importing this module imports TensorFlow and tf_keras (through :mod:`tfelastic.trainer._tf`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from tfelastic.trainer._tf import WorkerTrainingState, keras, tf
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.loop import agree_across_workers, agreed_interval, make_all_reduce
from tfelastic.trainer.progress import Phase, ProgressReporter
from tfelastic.trainer.save_schedule import DEFAULT_BUDGET, SaveSchedule
from tfelastic.trainer.survivors import SurvivorSave
from tfelastic.trainer.tier_restore import TierRestore
from tfelastic.trainer.tiered import TieredCheckpoint


class TieredTrainingState(WorkerTrainingState):  # type: ignore[misc]
    """tf_keras's training state (model, saved epoch and batch, train counter) on the fast tier."""

    def __init__(self, model: Any, shared_store: str, env: TrainerEnvironment, keep_local: int,
                 keep_shared: int) -> None:
        # Not WorkerTrainingState.__init__: it builds CheckpointManagers on the backup directory. These are the
        # attributes its resume logic (maybe_load_initial_counters_from_ckpt) reads.
        self._enable_save_before_preemption = False
        self._model = model
        self._save_freq = 1  # a number of steps: fit resumes at the saved batch, not at the next epoch
        self._ckpt_saved_epoch = tf.Variable(tf.constant(self.CKPT_SAVED_EPOCH_UNUSED_VALUE, tf.int64),
                                             name="ckpt_saved_epoch")
        self._ckpt_saved_batch = tf.Variable(tf.constant(self.CKPT_SAVED_BATCH_UNUSED_VALUE, tf.int64),
                                             name="ckpt_saved_batch")
        checkpoint = tf.train.Checkpoint(model=model, ckpt_saved_epoch=self._ckpt_saved_epoch,
                                         ckpt_saved_batch=self._ckpt_saved_batch, train_counter=model._train_counter)
        self.tier = TieredCheckpoint(checkpoint, shared_store,
                                     is_chief=bool(model.distribute_strategy.extended.should_checkpoint), env=env,
                                     keep_local=keep_local, keep_shared=keep_shared)

    def back_up(self, epoch: int, batch: int = 0) -> float:
        """A snapshot at the optimizer's step; returns the stall. (``epoch`` and ``batch`` are tracked by the
        callback in the checkpointed variables, as tf_keras does.)"""
        return self.tier.save(int(self._model.optimizer.iterations.numpy()))

    def flush(self) -> None:
        self.tier.flush()

    def backup_if_preempted(self) -> None:
        """tf_keras's on-demand save exists only on Google Cloud; the graceful stop is GracefulStopCallback."""

    def restore(self) -> TierRestore:
        """The fast tier's restore; with no snapshot at all, tf_keras's own BackupAndRestore checkpoint in the same
        directory, if there is one (a job that ran before the fast tier resumes where it was: the checkpoint
        holds the same objects)."""
        result = self.tier.restore()
        legacy = os.path.join(self.tier.shared_store, "chief")
        if result.tier == "none" and tf.io.gfile.exists(os.path.join(legacy, "checkpoint")):
            path = tf.train.latest_checkpoint(legacy)
            if path:
                self.tier.checkpoint.restore(path).expect_partial()
                return TierRestore(int(self._model.optimizer.iterations.numpy()), "shared", path)
        return result

    def delete_backup(self) -> None:
        """Kept: the final state lets a job restarted after fit resume at its end (see fit_callbacks)."""


class FastBackupAndRestore(keras.callbacks.Callback):  # type: ignore[misc]
    """Restores at ``on_train_begin`` and saves snapshots during ``fit`` (see the module docstring).

    ``backup_dir``: the shared tier's store (the agent's backup directory holds it by default, so that the agents
    see its snapshots when they choose the step to restore). ``save_every``: steps between snapshots; None adapts
    to ``overhead_budget`` (a fraction of training time).
    """

    def __init__(self, backup_dir: str, *, save_every: int | None = None, overhead_budget: float = DEFAULT_BUDGET,
                 keep_local: int = 2, keep_shared: int = 3, reporter: ProgressReporter | None = None,
                 env: TrainerEnvironment | None = None, survivors_save: bool = True) -> None:
        super().__init__()
        self.backup_dir = backup_dir
        self.schedule = SaveSchedule(save_every, budget=overhead_budget)
        self._keep = (keep_local, keep_shared)
        self._reporter = reporter or ProgressReporter.from_env()
        self._env = env or TrainerEnvironment.from_env()
        self._supports_tf_logs = True
        self._state: TieredTrainingState | None = None
        self._step = 0  # the optimizer step, counted without reading it (a read waits for the step to finish)
        self._steps_per_call = 1
        self._reported_seal: int | None = None
        self._all_reduce: Callable[[float], float] | None = None
        self.restored: TierRestore | None = None
        self.stalls: list[float] = []
        self._survivors_save = survivors_save
        self._survivors: SurvivorSave | None = None
        self._started_at = 0  # the optimizer step fit resumed at
        self._epoch = 0  # the epoch under way
        self._completed: tuple[int, int] = (0, 0)  # the epoch and batch of the last batch completed (or restored)
        self._unguarded: Any = None  # model.train_function as fit made it

    @property
    def tier(self) -> TieredCheckpoint:
        assert self._state is not None, "the tier exists from on_train_begin on"
        return self._state.tier

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        if model.optimizer is not None and not getattr(model.optimizer, "_built", True):
            model.optimizer.build(model.trainable_variables)  # slots exist before the restore fills them
        self._state = TieredTrainingState(model, self.backup_dir, self._env, *self._keep)
        self.schedule.copy_floor = self.tier.persist_seconds
        model._training_state = self._state
        self._reporter.report(int(model.optimizer.iterations.numpy()), phase=Phase.SETUP)
        self.restored = self._state.restore()
        self._step = self._started_at = int(model.optimizer.iterations.numpy())
        self._completed = (int(self._state._ckpt_saved_epoch.numpy()), int(self._state._ckpt_saved_batch.numpy()))
        strategy = model.distribute_strategy
        if strategy.num_replicas_in_sync > 1:
            self._all_reduce = make_all_reduce(strategy)
            agree_across_workers(strategy, self._step, "restored step", self._all_reduce)
        steps_per_execution = getattr(model, "_steps_per_execution", None)
        self._steps_per_call = int(steps_per_execution.numpy()) if steps_per_execution is not None else 1
        self.schedule.start(self._step)
        if self._survivors_save and strategy.num_replicas_in_sync > 1 and \
                getattr(model, "train_function", None) is not None:
            self._survivors = SurvivorSave(strategy, model, model.optimizer, self._reporter, self._env.rank,
                                           self._env.world_size)
            self._unguarded = model.train_function  # fit calls the attribute at each step: it calls this one
            model.train_function = self._keeping_the_survivors_step(self._unguarded)
        self._reporter.report(self._step, restored_step=self.restored.step, restored_tier=self.restored.tier,
                              force=True, phase=Phase.SETUP,
                              hears_peer_failure=self._survivors is not None and self._survivors.hears_peer_failure)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self._state is not None
        self._epoch = epoch
        self._state._ckpt_saved_epoch.assign(epoch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # The batch just finished (the last of a steps_per_execution call): a save after it resumes after it.
        assert self._state is not None
        self._state._ckpt_saved_batch.assign(batch)
        self._completed = (self._epoch, batch)
        self._step += self._steps_per_call
        self.schedule.step_done(time.monotonic(), self.tier.writing, *self.tier.copy_beside_step())
        self._report_sealed()
        if self.schedule.due(self._step):
            self.save()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._unguarded is not None:  # a later fit makes no new one: it gets fit's own back
            self.model.train_function, self._unguarded = self._unguarded, None
        if self._state is not None:
            self._state.flush()  # a snapshot still being written completes before fit returns
            self._report_sealed()
        # As tf_keras does: a later fit without this callback must not resume from this one's counters.
        # (GracefulStopCallback, later in the list, keeps its own reference for its final save.)
        if getattr(self.model, "_training_state", None) is self._state:
            del self.model._training_state

    def _keeping_the_survivors_step(self, train_function: Any) -> Callable[[Any], Any]:
        """``train_function``, whose failure for a peer's saves the step this worker holds (SurvivorSave)."""
        def guarded(iterator: Any) -> Any:
            try:
                return train_function(iterator)
            except tf.errors.OpError as e:
                if self._survivors is not None:
                    self._survivors.after_failure(e, train_function, (iterator,), self._step, self._started_at,
                                                  self.tier, self._set_completed_position)
                raise
        return guarded

    def _set_completed_position(self) -> None:
        """The checkpointed epoch and batch, to the last batch completed's: an epoch that has begun without a
        batch completed resumes at its first batch, not after the previous epoch's last."""
        assert self._state is not None
        epoch, batch = self._completed
        self._state._ckpt_saved_epoch.assign(epoch)
        self._state._ckpt_saved_batch.assign(batch)

    def save(self) -> int:
        """A snapshot now (every worker must call it at the same step); returns the step."""
        assert self._state is not None
        step = self._step = int(self.model.optimizer.iterations.numpy())
        self._reporter.report(step, phase=Phase.SAVE)
        began = time.monotonic()
        self.tier.wait_sealed()  # the previous snapshot is reported before this one can overtake it
        self._report_sealed()
        self._state.back_up(epoch=0)
        stall = time.monotonic() - began  # with the wait for the previous seal: it held training up too
        self.stalls.append(stall)
        proposal = self.schedule.saved(step, stall, began, self.tier.last_write_seconds)
        self.schedule.adopt(step, self._agreed(proposal))
        self.tier.pace_copies(self.schedule.copy_seconds)
        self._reporter.report(step, phase=Phase.TRAIN, stall=stall, force=True)
        return step

    def _agreed(self, proposal: int) -> int:
        """The chief's interval, on every worker (a fixed one needs no agreement)."""
        if self.schedule.fixed or self._all_reduce is None:
            return proposal
        return agreed_interval(self.model.distribute_strategy, self._all_reduce, proposal, self._env.is_chief)

    def _report_sealed(self) -> None:
        state = self._state
        sealed = state.tier.sealed_step if state is not None else None
        if sealed is not None and sealed != self._reported_seal:
            self._reported_seal = sealed
            self._reporter.report(self._step, checkpoint_step=sealed)
