"""A custom training loop for MultiWorkerMirroredStrategy that survives restarts exactly.

:func:`make_train_step` averages the per-example loss over the *global* batch and divides the regularization
losses by the replica count, so the all-reduced gradient is the global mean loss's whatever the replica count.
:class:`TrainLoop` adds the fast checkpoint tier (:mod:`tfelastic.trainer.tiered`: the model, the optimizer, the
epoch and the position in it), the data position (:mod:`tfelastic.trainer.data`), the save schedule, progress
reports and the graceful stop. docs/trainer.md shows it in use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tfelastic.trainer import flash, snapshots
from tfelastic.trainer._tf import tf
from tfelastic.trainer.batching import epoch_steps
from tfelastic.trainer.data import ExamplesFn, distribute_epoch
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.preemption import STOP, preemption_guard
from tfelastic.trainer.progress import Phase, ProgressReporter
from tfelastic.trainer.save_schedule import DEFAULT_BUDGET, SaveSchedule
from tfelastic.trainer.survivors import SurvivorSave
from tfelastic.trainer.tfkeras import check_model
from tfelastic.trainer.tier_restore import TierRestore
from tfelastic.trainer.tiered import TieredCheckpoint

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], Any]  # (labels, predictions) -> per-example loss, shape [batch]


def make_train_step(strategy: Any, model: Any, optimizer: Any, loss_fn: LossFn, global_batch: int,
                    metrics: Sequence[Any] = ()) -> Callable[[Any], Any]:
    """A ``tf.function`` that runs one step on the next batch of a distributed iterator and returns the loss of
    the global batch (the sum over replicas of their share of the mean).

    The step exchanges with the other workers twice: the distributed iterator's agreement on whether a batch is
    left, then one all-reduce of the loss and the gradients together, and every update waits for both: a step
    that a peer's failure interrupts changed no variable, and one that completed changed all of them, so the
    state a survivor holds is exactly one step's (:mod:`tfelastic.trainer.survivors`).
    A sparse gradient (an embedding's) is exchanged by gathers of their own, after which a failure can leave the
    step half applied: the survivors' save sees it and saves nothing."""

    def replica_step(features: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(labels, predictions), global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        pairs = [(g, v) for g, v in zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                        strict=True) if g is not None]
        summed = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, [loss, *(g for g, _ in pairs)])
        optimizer.apply_gradients(zip(summed[1:], (v for _, v in pairs), strict=True),
                                  experimental_aggregate_gradients=False)  # summed above, with the loss
        for metric in metrics:
            metric.update_state(labels, predictions)
        return summed[0]

    def train_step(iterator: Any) -> Any:
        per_replica = strategy.run(replica_step, args=next(iterator))
        return strategy.experimental_local_results(per_replica)[0]  # every replica holds the global loss

    return tf.function(train_step)  # type: ignore[no-any-return]


def make_eval_step(strategy: Any, model: Any, loss_fn: LossFn, global_batch: int,
                   metrics: Sequence[Any] = ()) -> Callable[[Any], Any]:
    """Like :func:`make_train_step` without the update: the global batch's mean loss; metrics updated."""

    def replica_step(features: Any, labels: Any) -> Any:
        predictions = model(features, training=False)
        for metric in metrics:
            metric.update_state(labels, predictions)
        return tf.nn.compute_average_loss(loss_fn(labels, predictions), global_batch_size=global_batch)

    def eval_step(iterator: Any) -> Any:
        per_replica = strategy.run(replica_step, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return tf.function(eval_step)  # type: ignore[no-any-return]


@dataclass
class LoopResult:
    step: int  # the optimizer step reached (also the step of the last checkpoint)
    initial_step: int  # the step this run restored
    epoch: int
    loss: float | None  # the last step's global-batch loss; None when no step ran


class TrainLoop:
    """The loop; build ``model`` (so that it has weights) and the optimizer inside ``strategy.scope()`` first."""

    def __init__(self, strategy: Any, model: Any, optimizer: Any, *, loss_fn: LossFn, global_batch: int,
                 examples: ExamplesFn, examples_per_epoch: int, checkpoint_dir: str, save_every: int | None = None,
                 overhead_budget: float = DEFAULT_BUDGET, metrics: Sequence[Any] = (), max_to_keep: int = 3,
                 reporter: ProgressReporter | None = None, graceful_stop: bool = True,
                 on_step: Callable[[int, Any], None] | None = None, env: TrainerEnvironment | None = None,
                 survivors_save: bool = True) -> None:
        check_model(model)
        self.schedule = SaveSchedule(save_every, budget=overhead_budget)  # validates both
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.global_batch, self.examples_per_epoch = global_batch, examples_per_epoch
        self._env = env or TrainerEnvironment.from_env()
        self._examples = examples
        self._reporter = reporter or ProgressReporter.from_env()
        self._graceful_stop = graceful_stop
        self._on_step = on_step  # (step, loss tensor): runs on every worker after every step, before the stop check
        epoch_steps(examples_per_epoch, global_batch)  # validates both
        with strategy.scope():
            # Slots exist before the restore, so it fills them at once rather than on the first step: a
            # restore that fails half-way is then fully overwritten by the fallback checkpoint.
            optimizer.build(model.trainable_variables)
        self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self._examples_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="examples_in_epoch")
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=self._epoch,
                                         examples_in_epoch=self._examples_done)
        self.checkpoints = TieredCheckpoint(checkpoint, checkpoint_dir,
                                            is_chief=bool(strategy.extended.should_checkpoint), env=self._env,
                                            keep_shared=max(max_to_keep, 2))
        self.schedule.copy_floor = self.checkpoints.persist_seconds
        self.step = self.epoch = self.examples_done = 0
        self._last_saved: int | None = None
        self._reported_seal: int | None = None
        self.stalls: list[float] = []
        self._train_step = make_train_step(strategy, model, optimizer, loss_fn, global_batch, metrics)
        # After a peer's failure, ranks 0 and 1 save the step they hold (trainer/survivors.py); off: the newest
        # snapshot is restored.
        self._survivors = SurvivorSave(strategy, model, optimizer, self._reporter, self._env.rank,
                                       self._env.world_size) if survivors_save else None
        self._all_reduce = make_all_reduce(strategy)

    def restore(self) -> TierRestore:
        """Restores the step the coordinator chose (see :mod:`tfelastic.trainer.tiered`) and checks that every
        worker restored the same step."""
        self._reporter.report(self.step, phase=Phase.SETUP)
        result = self.checkpoints.restore()
        self.step = int(self.optimizer.iterations.numpy())
        self.epoch, self.examples_done = int(self._epoch.numpy()), int(self._examples_done.numpy())
        self._last_saved = self.step if result.path else None
        agree_across_workers(self.strategy, self.step, "restored step", self._all_reduce)
        if result.path:
            log.info("restored %s (%s tier): step %d, epoch %d, %d examples into it", result.path, result.tier,
                     self.step, self.epoch, self.examples_done)
        self._reporter.report(self.step, restored_step=result.step, restored_tier=result.tier, phase=Phase.SETUP,
                              hears_peer_failure=self._survivors is not None and self._survivors.hears_peer_failure)
        return result

    @property
    def last_checkpoint(self) -> str | None:
        """The checkpoint prefix of the last save that :meth:`save` flushed (``final``: the end of :meth:`run`, a
        graceful stop), or of the last restore, in the shared tier; a TensorFlow checkpoint, which any TensorFlow
        tool reads (None after a restore from a flash snapshot, which is not: ``trainer/flash.py``)."""
        if self._last_saved is None:
            return None
        if flash.is_flash(snapshots.snapshot_dir(self.checkpoints.shared_store, self._last_saved)):
            return None
        return snapshots.checkpoint_prefix(snapshots.snapshot_dir(self.checkpoints.shared_store, self._last_saved))

    def save(self, final: bool = False) -> int:
        """A snapshot at the current step (every worker must call it); returns the step. ``final``: waits until it
        is in the shared tier, and ends with a barrier, so that it is complete for every worker on return."""
        if self._last_saved != self.step:
            self._reporter.report(self.step, examples=self._examples_seen(), phase=Phase.SAVE)
            self._set_position()
            began = time.monotonic()
            self.checkpoints.wait_sealed()  # the previous snapshot is reported before this one can overtake it
            self._report_sealed()
            self.checkpoints.save(self.step, portable=final)
            stall = time.monotonic() - began  # with the wait for the previous seal: it held training up too
            self.stalls.append(stall)
            proposal = self.schedule.saved(self.step, stall, began, self.checkpoints.last_write_seconds)
            self.schedule.adopt(self.step, self._agreed(proposal))
            self.checkpoints.pace_copies(self.schedule.copy_seconds)
            self._last_saved = self.step
            self._reporter.report(self.step, examples=self._examples_seen(), stall=stall, force=True)
        if final:
            self.checkpoints.save(self.step, portable=True)  # last_checkpoint: TensorFlow's format
            self.checkpoints.flush()
            self._all_reduce(0.0)  # the chief reaches it once its snapshot is in the shared tier
            self._report_sealed()
        return self.step

    def _agreed(self, proposal: int) -> int:
        """The chief's interval, on every worker (a fixed one needs no agreement)."""
        if self.schedule.fixed or self.strategy.num_replicas_in_sync == 1:
            return proposal
        return agreed_interval(self.strategy, self._all_reduce, proposal, self._env.is_chief)

    def _report_sealed(self) -> None:
        sealed = self.checkpoints.sealed_step
        if sealed is not None and sealed != self._reported_seal:
            self._reported_seal = sealed
            self._reporter.report(self.step, examples=self._examples_seen(), checkpoint_step=sealed)

    def run(self, steps: int) -> LoopResult:
        """Trains until the optimizer step reaches ``steps``, then saves. Raises
        :class:`~tfelastic.trainer.preemption.Preempted` (exit 42) after saving on a stop request."""
        initial, loss = self.step, None
        self._reporter.report(self.step, examples=self._examples_seen(), phase=Phase.SETUP)  # the first step traces
        guard = preemption_guard(self.strategy) if self._graceful_stop else None
        self.schedule.start(self.step)
        with STOP.training():
            while self.step < steps:
                left = epoch_steps(self.examples_per_epoch, self.global_batch, self.examples_done)
                if left == 0:
                    self.epoch, self.examples_done = self.epoch + 1, 0
                    continue
                self._reporter.report(self.step, phase=Phase.SETUP)  # an epoch's input pipeline starts (shuffle)
                iterator = iter(distribute_epoch(self.strategy, self._examples, epoch=self.epoch,
                                                 global_batch=self.global_batch, skip=self.examples_done))
                for _ in range(min(left, steps - self.step)):
                    try:
                        loss = self._train_step(iterator)
                    except tf.errors.OpError as e:  # a peer's failure, among others: the step it holds is kept
                        if self._survivors is not None:
                            self._survivors.after_failure(e, self._train_step, (iterator,), self.step, initial,
                                                          self.checkpoints, self._set_position)
                        raise
                    self.step, self.examples_done = self.step + 1, self.examples_done + self.global_batch
                    self._after_step(loss, guard)
            self.save(final=True)
        final_loss = None if loss is None else float(loss)
        self._reporter.report(self.step, examples=self._examples_seen(), loss=final_loss, done=True)
        return LoopResult(self.step, initial, self.epoch, final_loss)

    def report_alive(self) -> None:
        """A progress report at the current step, when one is due: call it from work after training (a test
        loop, an export) so that the agent's hang detection does not take it for a stalled trainer."""
        if self._reporter.due():
            self._reporter.report(self.step, examples=self._examples_seen(), phase=Phase.EVAL)

    def _after_step(self, loss: Any, guard: Any) -> None:
        self._reporter.reached(self.step)  # the agent reads it if this process dies before the next report
        if self._on_step is not None:
            self._on_step(self.step, loss)
        self.schedule.step_done(time.monotonic(), self.checkpoints.writing, *self.checkpoints.copy_beside_step())
        self._report_sealed()
        if self.schedule.due(self.step):
            self.save()
        elif self._reporter.due():  # reading the loss waits for the step: only when a report is due
            self._reporter.report(self.step, examples=self._examples_seen(), loss=float(loss))
        if guard is not None:
            guard.after_step(lambda: self.save(final=True))

    def _examples_seen(self) -> int:
        return self.step * self.global_batch

    def _set_position(self) -> None:
        """The checkpointed epoch and place in it, to the current step's (before a save)."""
        self._epoch.assign(self.epoch)
        self._examples_done.assign(self.examples_done)


def make_all_reduce(strategy: Any) -> Callable[[float], float]:
    """A function that sums a number over all replicas: every worker must call it, so it is also a barrier."""
    if strategy.num_replicas_in_sync == 1:
        return lambda value: float(value)

    def replica(value: Any) -> Any:
        local = tf.identity(value)  # on this replica's device: all_reduce needs one
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)

    def local_sum(value: Any) -> Any:
        return strategy.experimental_local_results(strategy.run(replica, args=(value,)))[0]

    compiled = tf.function(local_sum)
    return lambda value: float(compiled(tf.constant(value, tf.float64)))


def agreed_interval(strategy: Any, all_reduce: Callable[[float], float], proposal: int, is_chief: bool) -> int:
    """The chief's save interval, on every worker (one all-reduce: every worker must call it). Each of the chief's
    local replicas adds its share, so the sum is the chief's proposal whatever its number of GPUs."""
    local_replicas = max(len(getattr(strategy.extended, "worker_devices", ())) or 1, 1)
    return max(1, round(all_reduce(proposal / local_replicas if is_chief else 0.0)))


def agree_across_workers(strategy: Any, value: int, what: str, all_reduce: Callable[[float], float] | None = None
                         ) -> None:
    """Raises RuntimeError unless every worker passes the same ``value`` (one all-reduce)."""
    replicas = strategy.num_replicas_in_sync
    summed = (all_reduce or make_all_reduce(strategy))(float(value))
    if summed != float(value) * replicas:
        raise RuntimeError(f"workers disagree on the {what}: this worker has {value}, the mean over the "
                           f"{replicas} replicas is {summed / replicas:g}. They restored different checkpoints "
                           "(storage not shared, or a transient read error): restart the job")
