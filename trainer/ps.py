"""ParameterServerStrategy jobs (``tfelastic run --strategy parameter-server --ps N``): one script for every task.

Every task gets the same command and its own ``TF_CONFIG`` (a chief, N ps and the workers). A ps or worker task
only serves, so a script starts with :func:`serve_unless_chief` and only the chief goes on, to
:func:`parameter_server_strategy` and either :class:`PsTrainLoop` (``ClusterCoordinator.schedule``, a checkpoint
every ``save_every`` steps after a ``join``) or ``Model.fit`` with :func:`ps_fit_callbacks`
(:class:`PsBackupAndRestore`, :class:`PsProgressCallback`). The chief alone reports progress, saves and ends the job
by exiting 0; on SIGTERM it waits for the steps in flight, saves and exits 42, a ps or worker task ends at once.

Invariants: the checkpoint holds exactly the steps counted (a ``join`` before each save); the step reported never
goes back within a chief's life, though a step may be applied more than once (a worker that died after its update
reached the ps has it retried). Why the mirrored job's helpers do not serve here: docs/parameter-server.md.

Importing this module imports TensorFlow and tf_keras (through :mod:`tfelastic.trainer._tf`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tfelastic.trainer._tf import WorkerTrainingState, keras, tf
from tfelastic.trainer.callbacks import ProgressCallback
from tfelastic.trainer.checkpoint import ChiefCheckpointManager, RestoreResult
from tfelastic.trainer.environment import CHIEF, TrainerEnvironment, TrainerEnvironmentError
from tfelastic.trainer.preemption import STOP, Preempted
from tfelastic.trainer.progress import Phase, ProgressReporter, report
from tfelastic.trainer.tfkeras import check_keras, check_model

log = logging.getLogger(__name__)

DEFAULT_MIN_SHARD_BYTES = 256 << 10  # TensorFlow's parameter_server_training tutorial's choice


def serve_unless_chief(environment: TrainerEnvironment | None = None) -> None:
    """Call first in a script that every task of a parameter-server job runs: on a ps or worker task it starts this
    task's ``tf.distribute.Server`` and serves until the process is stopped (it never returns there); on the chief,
    in a mirrored job or without ``TF_CONFIG`` it returns at once, and the script goes on to train."""
    env = environment or TrainerEnvironment.from_env()
    if not env.serves_only:
        return
    assert env.task_type is not None
    # A Python handler would never run while the main thread sits in server.join(): the agent would wait out its
    # whole stop grace for nothing, then SIGKILL. With the default action SIGTERM ends the task at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    address = env.cluster[env.task_type][env.task_index]
    print(f"tfelastic: serving as {env.task_type} {env.task_index} of a parameter-server job on {address}",
          flush=True)
    server = tf.distribute.Server(tf.train.ClusterSpec(env.cluster), job_name=env.task_type,
                                  task_index=env.task_index, protocol="grpc", start=True)
    server.join()
    raise RuntimeError(f"the TensorFlow server of {env.task_type} {env.task_index} stopped serving")


def parameter_server_strategy(environment: TrainerEnvironment | None = None, *,
                              min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES, max_shards: int | None = None) -> Any:
    """The chief's ``tf.distribute.ParameterServerStrategy`` over TF_CONFIG's cluster (``TFConfigClusterResolver``),
    its variables split by ``MinSizePartitioner`` into shards of at least ``min_shard_bytes``, over at most
    ``max_shards`` (default: the number of parameter servers). Connects to every task (it waits for them to
    serve), and installs the graceful stop's SIGTERM handler. Call :func:`serve_unless_chief` first."""
    check_keras()
    env = environment or TrainerEnvironment.from_env()
    if not env.parameter_server_job:
        raise TrainerEnvironmentError(
            "parameter_server_strategy() needs a TF_CONFIG with a 'ps' job (tfelastic run --strategy "
            f"parameter-server --ps N); this task's cluster is {env.cluster or 'none (no TF_CONFIG)'}")
    if env.task_type != CHIEF:
        raise TrainerEnvironmentError(
            f"only the chief trains in a parameter-server job, and this is {env.task_type} {env.task_index}: call "
            "serve_unless_chief() before parameter_server_strategy()")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.cluster_spec().as_dict() != env.cluster:
        raise TrainerEnvironmentError(f"the environment given ({env.cluster}) is not TF_CONFIG's cluster "
                                      f"({resolver.cluster_spec().as_dict()}), which the strategy connects to")
    if max_shards is not None and max_shards < 1:
        raise ValueError(f"max_shards={max_shards} must be at least 1")
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=min_shard_bytes, max_shards=max_shards or len(env.ps))
    report(0, phase=Phase.SETUP)  # connecting waits for every task to serve: start-up's allowance, not a step's
    _show_worker_recoveries()
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    STOP.install()
    return strategy


class _WorkerRecoveries(logging.Filter):
    """TensorFlow logs a worker's failure as an error but its re-attachment at INFO: let that one through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "has been recovered" in record.getMessage()


def _show_worker_recoveries() -> None:
    logger = tf.get_logger()
    if logger.getEffectiveLevel() > logging.INFO and not any(isinstance(f, _WorkerRecoveries) for f in
                                                              logger.filters):
        logger.addFilter(_WorkerRecoveries())
        logger.setLevel(logging.INFO)


@dataclass(frozen=True)
class PsLoopResult:
    step: int  # the optimizer step reached, which the last checkpoint holds
    initial_step: int  # the step this run restored
    loss: float | None  # what the last step scheduled returned; None when no step ran
    checkpoint: str | None  # the last checkpoint's prefix


class PsTrainLoop:
    """The chief's custom loop over a ``ClusterCoordinator`` (see the module docstring).

    Build the model (so that it has weights) and the optimizer inside ``strategy.scope()`` first, then::

        loop = PsTrainLoop(strategy, model, optimizer, checkpoint_dir=env.backup_path("loop"), save_every=100)
        loop.restore()
        iterator = iter(loop.coordinator.create_per_worker_dataset(per_worker_dataset_fn))
        result = loop.run(lambda: loop.coordinator.schedule(train_step, args=(iterator,)), steps=1000)

    Each call of the function given to :meth:`run` must schedule exactly one optimizer step and return its
    ``RemoteValue``. ``trackables`` are checkpointed with the model and the optimizer.
    """

    def __init__(self, strategy: Any, model: Any, optimizer: Any, *, checkpoint_dir: str, save_every: int = 100,
                 max_to_keep: int = 3, examples_per_step: int | None = None, reporter: ProgressReporter | None = None,
                 graceful_stop: bool = True, poll_seconds: float = 0.05, **trackables: Any) -> None:
        check_model(model)
        if save_every < 1:
            raise ValueError(f"save_every={save_every} must be a positive number of steps")
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.save_every = save_every
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        if callable(getattr(optimizer, "build", None)):
            with strategy.scope():
                # Slots exist before the restore, so that it fills them now rather than inside the first step,
                # which runs on a worker.
                optimizer.build(model.trainable_variables)
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, **trackables)
        self.checkpoints = ChiefCheckpointManager(self.checkpoint, checkpoint_dir, is_chief=True,
                                                  max_to_keep=max_to_keep)
        self.step = 0
        self.last_checkpoint: str | None = None  # the prefix of the last checkpoint saved or restored
        self._saved: int | None = None
        self._last: Any = None  # the RemoteValue of the last step scheduled
        self._examples_per_step = examples_per_step
        self._reporter = reporter or ProgressReporter.from_env()
        self._graceful_stop = graceful_stop
        self._poll = poll_seconds

    def restore(self) -> RestoreResult:
        """Restores the newest checkpoint of ``checkpoint_dir`` that restores, if any (``step`` is then its step).
        Raises :class:`~tfelastic.trainer.checkpoint.NoRestorableCheckpointError` if there are some and none
        restores."""
        self._reporter.report(self.step, phase=Phase.SETUP)
        result = self.checkpoints.restore()
        self.step = self._read_step()
        self._saved = self.step if result.path else None
        self.last_checkpoint = result.path
        if result.path:
            log.info("restored %s: step %d", result.path, self.step)
        self._reporter.report(self.step, restored_tier="shared" if result.path else "none",
                              restored_step=self.step if result.path else None, phase=Phase.SETUP)
        return result

    def run(self, schedule_step: Callable[[], Any], steps: int) -> PsLoopResult:
        """Schedules steps until the optimizer step reaches ``steps``, with a checkpoint every ``save_every`` steps
        and at the end. Raises :class:`~tfelastic.trainer.preemption.Preempted` (exit 42) after saving on
        SIGTERM, and the error of a step that failed other than by a worker's loss (a parameter server's, say)."""
        initial = self.step
        self._reporter.report(self.step, examples=self._examples(), phase=Phase.SETUP)  # the first step traces
        try:
            with STOP.training() if self._graceful_stop else contextlib.nullcontext():
                while self.step < steps:
                    # Up to the next multiple of save_every: a chunk's steps are all applied when it is saved.
                    boundary = min(steps, (self.step // self.save_every + 1) * self.save_every)
                    for _ in range(boundary - self.step):
                        self._last = schedule_step()
                        self._report_if_due()
                        if self._stopping():
                            break
                    saved = self.save()
                    if self._stopping():
                        raise Preempted(saved)
                self.save()
        except Preempted as stop:
            if stop.step is None:  # the signal came after the last step: the final save holds it
                raise Preempted(self.step) from None
            raise
        loss = self._loss()
        self._reporter.report(self.step, examples=self._examples(), loss=loss, done=True)
        return PsLoopResult(self.step, initial, loss, self.last_checkpoint)

    def save(self) -> int:
        """Waits for every step scheduled, then checkpoints the step reached (unless saved already); returns it."""
        self._wait()
        self.step = self._read_step()
        if self._saved == self.step:
            return self.step
        self._reporter.report(self.step, examples=self._examples(), phase=Phase.SAVE)
        began = time.monotonic()
        self.last_checkpoint = self.checkpoints.save(self.step)
        self._saved = self.step
        self._reporter.report(self.step, examples=self._examples(), loss=self._loss(), checkpoint_step=self.step,
                              stall=time.monotonic() - began)
        return self.step

    def report_alive(self) -> None:
        """A progress report when one is due: call it from work after training (an evaluation, an export)."""
        if self._reporter.due():
            self._reporter.report(self.step, examples=self._examples(), phase=Phase.EVAL)

    def _wait(self) -> None:
        """``join``, reporting progress while it waits (a chunk may take longer than the agent's stall limit)."""
        while not self.coordinator.done():  # raises the error of a failed step, as join does
            self._report_if_due()
            time.sleep(self._poll)
        self.coordinator.join()

    def _report_if_due(self) -> None:
        if self._reporter.due():  # reading the step is a call to a parameter server: only when a report is due
            self.step = max(self.step, self._read_step())
            self._reporter.report(self.step, examples=self._examples())

    def _stopping(self) -> bool:
        return self._graceful_stop and STOP.received.is_set()

    def _read_step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def _examples(self) -> int | None:
        return self.step * self._examples_per_step if self._examples_per_step else None

    def _loss(self) -> float | None:
        if self._last is None:
            return None
        try:
            return float(self._last.fetch())  # after a join: ready, no wait
        except (TypeError, ValueError):
            return None  # the step returned something other than a scalar loss


class PsTrainingState(WorkerTrainingState):  # type: ignore[misc]
    """tf_keras' training state, under a type of its own: :class:`PsBackupAndRestore` reports its restore, and a
    ProgressCallback that finds this type leaves that report to it."""


class PsBackupAndRestore(keras.callbacks.BackupAndRestore):  # type: ignore[misc]
    """tf_keras's ``BackupAndRestore`` for ``Model.fit`` under ParameterServerStrategy: saves every ``save_every``
    steps (or at each epoch's end with ``"epoch"``) after joining the coordinator, so that a checkpoint holds the
    steps it claims, and resumes at the batch after the one saved. On SIGTERM it saves at the next batch and raises
    :class:`~tfelastic.trainer.preemption.Preempted` (exit 42); at the end of ``fit`` it saves the final state (a
    failure after ``fit`` does not train again), kept unless ``delete_checkpoint``. Works without the strategy too.
    Needs ``steps_per_epoch`` (ParameterServerStrategy needs it anyway)."""

    def __init__(self, backup_dir: str, *, save_every: int | Literal["epoch"] = 100, graceful_stop: bool = True,
                 delete_checkpoint: bool = False, reporter: ProgressReporter | None = None) -> None:
        if save_every != "epoch" and (not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every={save_every!r} must be a positive number of steps or 'epoch'")
        super().__init__(backup_dir, save_freq=save_every, delete_checkpoint=delete_checkpoint)
        self._graceful_stop = graceful_stop
        self._reporter = reporter or ProgressReporter.from_env()
        self._batches_count = 0  # tf_keras's own counter (SavePhaseCallback reads it), typed here
        self._training: Any = None
        self._saved_step: int | None = None
        self.latest_checkpoint: str | None = None  # the prefix of the last checkpoint saved or restored

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        check_model(model)
        if not (self.params or {}).get("steps"):
            raise ValueError("PsBackupAndRestore needs fit(..., steps_per_epoch=N): it saves the batch reached")
        if model.optimizer is not None and callable(getattr(model.optimizer, "build", None)) and not getattr(
                model.optimizer, "_built", False):
            model.optimizer.build(model.trainable_variables)  # slots exist before the restore fills them
        # save_freq=1 whatever ours: only its type matters to tf_keras, whose resume logic then starts at the batch
        # after the one saved (after an epoch's last: the next epoch) instead of at the next epoch.
        self._training_state = model._training_state = PsTrainingState(model, self.backup_dir, save_freq=1)
        self._reporter.report(self._step(), phase=Phase.SETUP)
        self._training_state.restore()
        step = self._step()
        restored = self._training_state.read_checkpoint_manager.latest_checkpoint
        self._saved_step = step if restored else None
        self.latest_checkpoint = restored
        self._reporter.report(step, restored_tier="shared" if restored else "none",
                              restored_step=step if restored else None, phase=Phase.SETUP)
        if self._graceful_stop:
            self._training = STOP.training()
            self._training.__enter__()

    def _implements_train_batch_hooks(self) -> bool:
        return True  # with "epoch" too: the graceful stop looks for a SIGTERM after every batch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Nothing: tf_keras records the batch here, but under this strategy it is only scheduled now."""

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batches_count += 1
        stopping = self._graceful_stop and STOP.received.is_set()
        if stopping or (isinstance(self.save_freq, int) and self._batches_count >= self.save_freq):
            self._batches_count = 0
            step = self._save(self._current_epoch, batch)
            if stopping:
                self._leave_training(step)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, int(self.params["steps"]) - 1)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        step = self._save(self._current_epoch, int(self.params["steps"]) - 1) if not self.delete_checkpoint else None
        if self._training is not None:
            self._leave_training(step)
        super().on_train_end(logs)

    def _save(self, epoch: int, batch: int) -> int:
        """Joins the coordinator (every step scheduled is then in the variables), then saves; returns the step."""
        strategy = self.model.distribute_strategy
        if isinstance(strategy, tf.distribute.ParameterServerStrategy):
            tf.distribute.coordinator.ClusterCoordinator(strategy).join()  # one coordinator per strategy: fit's
        step = self._step()
        if step == self._saved_step:
            return step
        self._reporter.report(step, phase=Phase.SAVE)
        began = time.monotonic()
        state = self._training_state
        state._ckpt_saved_epoch.assign(epoch)
        state._ckpt_saved_batch.assign(batch)
        state.back_up(epoch=epoch, batch=batch)
        self._saved_step = step
        self.latest_checkpoint = state.write_checkpoint_manager.latest_checkpoint
        self._reporter.report(step, checkpoint_step=step, stall=time.monotonic() - began)
        return step

    def _leave_training(self, step: int | None) -> None:
        """Leaves the graceful stop's training section; raises Preempted with the step saved if a stop came."""
        training, self._training = self._training, None
        try:
            training.__exit__(None, None, None)
        except Preempted:
            raise Preempted(step) from None
        if STOP.received.is_set():
            raise Preempted(step)

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())


class PsProgressCallback(ProgressCallback):
    """:class:`~tfelastic.trainer.callbacks.ProgressCallback` for ParameterServerStrategy: a batch's logs are a
    ``RemoteValue`` there, whose fetch would wait for that step and so serialize the workers; they are left out
    (the loss comes with the epoch's end and fit's end). Checkpoints are reported by :class:`PsBackupAndRestore`,
    which knows the step it saved."""

    _counts_steps = False  # a batch's end is its step's scheduling: the step file is written by reports only

    def _send(self, logs: Any, *, force: bool = False, done: bool = False, loss_scale: float = 1.0,
              phase: Phase = Phase.TRAIN) -> int:
        return super()._send(logs if isinstance(logs, dict) else None, force=force, done=done,
                             loss_scale=loss_scale, phase=phase)

    def _latest_checkpoint(self) -> str | None:
        return None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._reporter.enabled:
            self._send(logs, force=True)


def ps_fit_callbacks(backup_dir: str | None = None, *, save_every: int | Literal["epoch"] = 100,
                     graceful_stop: bool = True, delete_checkpoint: bool = False,
                     global_batch_size: int | None = None, env: TrainerEnvironment | None = None,
                     reporter: ProgressReporter | None = None) -> list[Any]:
    """:class:`PsBackupAndRestore` + :class:`PsProgressCallback`, for the chief's ``Model.fit`` (the counterpart of
    ``fit_callbacks`` for a parameter-server job). ``backup_dir``: default ``TFELASTIC_BACKUP_DIR/fit``, or
    ``./tfelastic-backup/JOB/fit`` without an agent. ``global_batch_size``: a step's batch, to report examples."""
    check_keras()
    environment = env or TrainerEnvironment.from_env()
    reporter = reporter or ProgressReporter.from_env()
    directory = backup_dir or environment.backup_path("fit")
    return [PsBackupAndRestore(directory, save_every=save_every, graceful_stop=graceful_stop,
                               delete_checkpoint=delete_checkpoint, reporter=reporter),
            PsProgressCallback(reporter, global_batch_size=global_batch_size)]
