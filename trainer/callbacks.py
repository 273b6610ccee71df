"""Keras callbacks that connect ``model.fit`` to the local agent.

:func:`fit_callbacks` is the bundle for ``model.fit`` under the daemon: BackupAndRestore on the agent's backup
directory, progress reports, the graceful stop on SIGTERM (exit 42), and TensorBoard on the chief only.

Importing this module imports TensorFlow and tf_keras (through :mod:`tfelastic.trainer._tf`).
"""

from __future__ import annotations

from typing import Any, Literal

from tfelastic.trainer._tf import WorkerTrainingState, keras
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.fast_backup import FastBackupAndRestore
from tfelastic.trainer.loop import make_all_reduce
from tfelastic.trainer.preemption import STOP, preemption_guard
from tfelastic.trainer.progress import Phase, ProgressReporter
from tfelastic.trainer.save_schedule import DEFAULT_BUDGET
from tfelastic.trainer.tfkeras import check_keras, check_model


class ProgressCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Reports the optimizer step, examples seen, loss and saved checkpoints to the local agent.

    Cheap enough to leave on: values are read from the model (a device-to-host copy) only when a report is due,
    at most every ``min_interval`` of the reporter, or when a checkpoint was just saved. Checkpoints are seen by
    watching the BackupAndRestore of the same ``fit`` (``model._training_state``), so a restore that shifts the
    save schedule is reported at the step really saved. ``global_batch_size`` turns steps into examples.
    """

    def __init__(self, reporter: ProgressReporter | None = None, *, global_batch_size: int | None = None) -> None:
        super().__init__()
        self._reporter = reporter or ProgressReporter.from_env()
        self._global_batch_size = global_batch_size
        self._last_checkpoint: str | None = None
        self._batch_loss_scale = 1.0
        self._supports_tf_logs = True  # keep Keras from syncing every batch's logs to numpy for us
        # (step, batch) of the last step read in this epoch: later batches' steps are counted from it, not read
        self._step_base: tuple[int, int] | None = None

    # Under ParameterServerStrategy a batch's end comes when its step is scheduled, not done: no marks there.
    _counts_steps = True

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _latest_checkpoint(self) -> str | None:
        """The newest checkpoint BackupAndRestore wrote in this ``fit``: a cached attribute, no file access."""
        state = getattr(self.model, "_training_state", None)
        manager = getattr(state, "write_checkpoint_manager", None)
        return getattr(manager, "latest_checkpoint", None)

    def _saved_checkpoint(self) -> bool:
        latest = self._latest_checkpoint()
        if latest is None or latest == self._last_checkpoint:
            return False
        self._last_checkpoint = latest
        return True

    def _keras_restore_tier(self) -> str | None:
        """The tier of the restore that a tf_keras ``BackupAndRestore`` earlier in this ``fit`` just made: "shared"
        (its step is the model's step now), or "none" when it found no checkpoint. None where no such callback
        came first, or where the restorer is tfelastic's, which reports its restore itself (its training state is a
        subclass)."""
        state = getattr(self.model, "_training_state", None)
        if state is None or type(state) is not WorkerTrainingState:
            return None
        return "none" if state.read_checkpoint_manager.latest_checkpoint is None else "shared"

    def _per_batch_loss_scale(self) -> float:
        """tf_keras reduces each batch's logs with the model's ``distribute_reduction_method``; "auto" means "sum"
        off TPUs, so under MultiWorkerMirroredStrategy a batch's loss is the sum of every replica's. The mean is
        what Keras reports for the epoch, and what stays comparable when the world size changes."""
        strategy, method = self.model.distribute_strategy, self.model.distribute_reduction_method
        if method == "auto":  # tf_keras's own test for a TPU strategy, by class name
            method = "first" if type(strategy).__name__.startswith("TPUStrategy") else "sum"
        return 1.0 / strategy.num_replicas_in_sync if method == "sum" else 1.0

    def _send(self, logs: dict[str, Any] | None, *, force: bool = False, done: bool = False,
              loss_scale: float = 1.0, phase: Phase = Phase.TRAIN) -> int:
        step = self._step()
        # Under ParameterServerStrategy a batch's logs are a RemoteValue, not a dict: the step alone then.
        loss = logs.get("loss") if isinstance(logs, dict) else None
        loss = None if loss is None else float(loss) * loss_scale
        examples = step * self._global_batch_size if self._global_batch_size else None
        saved = self._saved_checkpoint()
        self._reporter.report(step, examples=examples, loss=loss,
                              checkpoint_step=step if saved else None, force=force, done=done, phase=phase)
        return step

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._step_base = None
        if self._reporter.enabled:
            self._batch_loss_scale = self._per_batch_loss_scale()
            self._saved_checkpoint()  # a checkpoint restored at start is not a new save
            tier = self._keras_restore_tier()
            if tier is not None:  # the agent takes the step resumed from here, not from the first step's report
                step = self._step()
                self._reporter.report(step, restored_tier=tier, restored_step=step if tier == "shared" else None,
                                      phase=Phase.SETUP)
            self._send(None, force=True, phase=Phase.SETUP)  # the first step traces and compiles

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._step_base = None  # batch numbers start again

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.due() or (self._reporter.enabled and self._latest_checkpoint() != self._last_checkpoint):
            self._step_base = (self._send(logs, loss_scale=self._batch_loss_scale), batch)
        elif self._reporter.marks_steps and self._counts_steps:
            self._mark(batch)

    def _mark(self, batch: int) -> None:
        """Marks this batch's step for the agent without reading it: ``batch`` counts the steps since the last
        read (by ``steps_per_execution`` when several run per call); read once per epoch, where batches start."""
        if self._step_base is None:
            self._step_base = (self._step(), batch)
        step, base = self._step_base
        self._reporter.reached(step + batch - base)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.enabled:
            self._send(logs, done=True)

    # Evaluation and prediction are progress too: the agent's hang detection keeps watching after training
    # (pass this callback to evaluate/predict), and a long evaluation (validation in fit too) gets the eval
    # phase's allowance rather than the training steps' limit.
    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._alive(force=True)

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._alive(force=True)

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._alive()

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._alive()

    def _alive(self, force: bool = False) -> None:
        if force or self._reporter.due():
            optimizer = getattr(self.model, "optimizer", None)  # predict() needs no compiled model
            self._reporter.report(int(optimizer.iterations.numpy()) if optimizer is not None else 0,
                                  phase=Phase.EVAL)


class SavePhaseCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Tells the agent before a checkpoint callback of the same ``fit`` saves, so that a long save gets the save
    phase's allowance instead of looking like a stalled step. Put it first, before the savers (its hooks run
    before theirs): ``fit_callbacks`` and the automatic instrumentation do. Knows tf_keras's BackupAndRestore
    and ModelCheckpoint; at an epoch's end (validation, savers with ``save_freq="epoch"``, the next epoch's
    input pipeline) it reports the setup phase."""

    def __init__(self, reporter: ProgressReporter, savers: list[Any]) -> None:
        super().__init__()
        self._reporter = reporter
        self._savers = [s for s in savers if isinstance(s, (keras.callbacks.BackupAndRestore,
                                                            keras.callbacks.ModelCheckpoint))]
        self._supports_tf_logs = True
        self._epoch_end_announced = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Before a save; and at an epoch's last batch, before fit builds the validation data, validates and
        runs the epoch-end callbacks (only at ``on_epoch_end`` when the epoch's length is unknown)."""
        if not self._reporter.enabled:
            return
        last = batch + 1 == (self.params or {}).get("steps")
        phase = Phase.SAVE if any(_will_save(s, batch) for s in self._savers) else Phase.SETUP if last else None
        if phase is not None:
            self._reporter.report(int(self.model.optimizer.iterations.numpy()), phase=phase)
        self._epoch_end_announced = last

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.enabled and not self._epoch_end_announced:
            self._reporter.report(int(self.model.optimizer.iterations.numpy()), phase=Phase.SETUP)
        self._epoch_end_announced = False


def _saves_at_batches(saver: Any) -> bool:
    return isinstance(getattr(saver, "save_freq", None), int)


def _will_save(saver: Any, batch: int) -> bool:
    """Whether ``saver`` saves in its ``on_train_batch_end`` for ``batch``, read from tf_keras's own counters
    without changing them (a private detail: a version that renames them makes this say no, never fail)."""
    if not _saves_at_batches(saver):
        return False
    every = int(saver.save_freq)
    if isinstance(saver, keras.callbacks.BackupAndRestore):
        return int(getattr(saver, "_batches_count", -every)) + 1 >= every
    last = getattr(saver, "_last_batch_seen", None)
    seen = getattr(saver, "_batches_seen_since_last_saving", None)
    if last is None or seen is None:
        return False
    return int(seen) + (batch + 1 if batch <= int(last) else batch - int(last)) >= every


class GracefulStopCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """The graceful stop for ``model.fit``: on SIGTERM every worker saves through the BackupAndRestore of the same
    ``fit`` at one agreed batch and raises :class:`~tfelastic.trainer.preemption.Preempted` (exit 42); at the end
    of ``fit`` it saves the final state (``final_save``), so that a stop or a failure during evaluation or export
    resumes without training again. Put it after BackupAndRestore and ProgressCallback (``fit_callbacks`` does).

    tf_keras' own ``BackupAndRestore(save_before_preemption=True)`` is off outside Google Cloud (see
    :mod:`tfelastic.trainer.preemption`); this callback is its replacement.
    """

    def __init__(self, reporter: ProgressReporter | None = None, *, final_save: bool = True) -> None:
        super().__init__()
        self._reporter = reporter or ProgressReporter.from_env()
        self._final_save = final_save
        self._state: Any = None
        self._training: Any = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_model(self.model)
        self._state = getattr(self.model, "_training_state", None)
        if self._state is None:
            raise RuntimeError("GracefulStopCallback needs a tf_keras BackupAndRestore earlier in the same fit's "
                               "callbacks: it saves through it (use fit_callbacks(), which puts them in order)")
        self._guard = preemption_guard(self.model.distribute_strategy)
        self._all_reduce = make_all_reduce(self.model.distribute_strategy)
        self._training = STOP.training()
        self._training.__enter__()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._guard.after_step(self._save)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._final_save:
            self._save(training_done=True)  # still done: the agent does not watch the silent work after fit
        self._training.__exit__(None, None, None)  # raises Preempted if a SIGTERM came in the last steps

    def _save(self, training_done: bool = False) -> int:
        self._reporter.report(int(self.model.optimizer.iterations.numpy()), phase=Phase.SAVE)
        self._state.back_up(epoch=0)  # the epoch and batch saved are those BackupAndRestore tracks
        flush = getattr(self._state, "flush", None)
        if flush is not None:  # the fast tier saves asynchronously: the snapshot must be complete before the exit
            flush()
        # Every worker leaves the save together: none may tell its agent that the job's state is durable (Preempted
        # does; the agent ends it a second later) while the chief still writes or copies it to the shared tier.
        self._all_reduce(0.0)
        step = int(self.model.optimizer.iterations.numpy())
        self._reporter.report(step, checkpoint_step=step, done=training_done)
        return step


def fit_callbacks(backup_dir: str | None = None, *, save_every: int | Literal["epoch"] | None = None,
                  fast_tier: bool = True, overhead_budget: float = DEFAULT_BUDGET,
                  global_batch_size: int | None = None, tensorboard_dir: str | None = None,
                  graceful_stop: bool = True, delete_checkpoint: bool = False, survivors_save: bool = True,
                  env: TrainerEnvironment | None = None, reporter: ProgressReporter | None = None
                  ) -> list[keras.callbacks.Callback]:
    """SavePhaseCallback + FastBackupAndRestore (or BackupAndRestore) + ProgressCallback + GracefulStopCallback +
    TensorBoard (chief only), in that order.

    ``backup_dir``: default ``TFELASTIC_BACKUP_DIR/fit``, or ``./tfelastic-backup/JOB/fit`` without an agent.
    ``fast_tier`` (default): asynchronous snapshots to the node's memory, persisted to ``backup_dir`` in the
    background (:class:`~tfelastic.trainer.fast_backup.FastBackupAndRestore`); ``save_every`` steps apart, or by
    default as often as ``overhead_budget`` (a fraction of training time, 1 %) allows. ``fast_tier=False``:
    tf_keras's ``BackupAndRestore`` (synchronous, on shared storage), every ``save_every`` steps (default 100), or
    "epoch", which also selects it and needs ``graceful_stop=False``: tf_keras resumes an epoch-saved backup at
    the next epoch, so a stop saved mid-epoch would skip the rest of that epoch. ``delete_checkpoint``: tf_keras
    deletes the backup after a successful ``fit`` by default; here the final state is kept, so that a failure
    after ``fit`` (evaluation, export) does not train again; a finished job restarted resumes at its end and
    trains no step (deleting needs ``fast_tier=False``). ``tensorboard_dir``: written by the chief only.
    ``survivors_save`` (with the fast tier): when a peer's failure breaks a step, ranks 0 and 1 save the step they
    hold (:mod:`~tfelastic.trainer.survivors`); False: the next generation restores the newest snapshot.
    """
    check_keras()
    if save_every == "epoch" and graceful_stop:
        raise ValueError("save_every='epoch' with graceful_stop=True would lose the rest of an epoch on a stop: "
                         "tf_keras resumes an epoch-based backup at the next epoch. Give save_every a number of "
                         "steps, or pass graceful_stop=False")
    fast = fast_tier and save_every != "epoch"
    if fast and delete_checkpoint:
        raise ValueError("delete_checkpoint=True needs fast_tier=False: the fast tier keeps its snapshots, and the "
                         "agent removes the node-local ones when the job succeeds")
    environment = env or TrainerEnvironment.from_env()
    reporter = reporter or ProgressReporter.from_env()
    directory = backup_dir or environment.backup_path("fit")
    backup: keras.callbacks.Callback
    if fast:
        backup = FastBackupAndRestore(directory, save_every=save_every if isinstance(save_every, int) else None,
                                      overhead_budget=overhead_budget, reporter=reporter, env=environment,
                                      survivors_save=survivors_save)
    else:
        backup = keras.callbacks.BackupAndRestore(directory, save_freq=save_every or 100,
                                                  delete_checkpoint=delete_checkpoint)
    callbacks: list[keras.callbacks.Callback] = [
        SavePhaseCallback(reporter, [backup]), backup, ProgressCallback(reporter, global_batch_size=global_batch_size),
    ]
    if graceful_stop:
        callbacks.append(GracefulStopCallback(reporter, final_save=not delete_checkpoint))
    if tensorboard_dir and environment.is_chief:
        callbacks.append(keras.callbacks.TensorBoard(tensorboard_dir))
    return callbacks
