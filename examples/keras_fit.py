"""A CNN on 28x28 grayscale images, 10 classes, trained with ``model.fit`` under MultiWorkerMirroredStrategy.

The fast checkpoint tier (snapshots in the node's memory every ``--save-every`` steps, or ``auto``, persisted to
the agent's backup directory; ``--fast-tier off``: tf_keras' BackupAndRestore), a cosine learning-rate schedule,
progress reports, a graceful stop on SIGTERM (save at an agreed step, exit 42), TensorBoard on the chief,
evaluation, and the export of the final model. Runs alone (one worker) or under ``tfelastic run``; see
examples/README.md. The last line of stdout is a JSON summary.

    python examples/keras_fit.py --epochs 3 --steps-per-epoch 50 --export-dir /tmp/cnn.keras
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import mnist_like as common
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer.batching import BatchPlan
from tfelastic.trainer.callbacks import ProgressCallback, fit_callbacks
from tfelastic.trainer.export import export_model
from tfelastic.trainer.preemption import Preempted

EXAMPLE = "keras_fit"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, help="default: the training examples / global batch")
    parser.add_argument("--tensorboard-dir", help="TensorBoard logs, written by the chief only")
    parser.add_argument("--plain-keras", action="store_true",
                        help="only tf_keras' own BackupAndRestore, none of tfelastic's callbacks (the overhead "
                             "benchmark's baseline: no progress reports, no graceful stop)")
    parser.add_argument("--fast-tier", choices=["on", "off"], default="on",
                        help="fit_callbacks' fast checkpoint tier (asynchronous snapshots in the node's memory, "
                             "default), or tf_keras' synchronous BackupAndRestore on the backup directory")
    parser.add_argument("--reached-file", help="the chief appends 'GENERATION STEP' here when fit starts, keeps "
                                               "the step it reached, counted by itself, in FILE.GENERATION, and "
                                               "appends 'STEP SECONDS' (the monotonic clock) at each step's end to "
                                               "FILE.GENERATION.times (benchmarks count the steps redone after a "
                                               "restart, and the time of new steps, from them)")
    common.add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.save_every is None and (args.plain_keras or args.fast_tier == "off"):
        parser.error("--save-every auto needs the fast tier (not --plain-keras or --fast-tier off)")
    return args


def datasets(data: common.Data, plan: BatchPlan, seed: int) -> tuple[Any, Any]:
    """Global batches; each worker takes its share of every batch (auto-shard by data)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
             .shuffle(len(data.x_train), seed=seed).repeat()
             .batch(plan.global_batch, drop_remainder=True).with_options(options))
    test = (tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test))
            .batch(plan.global_batch, drop_remainder=True).with_options(options))
    return train, test


class StepProbe(keras.callbacks.Callback):  # type: ignore[misc]
    """Records the step fit resumed at and when its first and last steps ended; sleeps ``--step-seconds`` after
    each step; keeps ``--reached-file`` (the chief's own count of its steps: the one it resumed at, plus a step per
    batch)."""

    def __init__(self, step_seconds: float, reached_file: str | None = None, generation: int = 0) -> None:
        super().__init__()
        self.step_seconds = step_seconds
        self.initial_step = 0
        self.first_step_end: float | None = None
        self.last_step_end: float | None = None
        self._reached_file, self._generation = reached_file, generation
        self._reached_fd: int | None = None
        self._times_fd: int | None = None
        self._steps = 0

    @property
    def train_seconds(self) -> float | None:
        """From the end of the first step (which traces and compiles) to the end of the last."""
        if self.first_step_end is None or self.last_step_end is None:
            return None
        return self.last_step_end - self.first_step_end

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_step = self._steps = int(self.model.optimizer.iterations.numpy())
        print(f"starting at step {self.initial_step}", flush=True)
        if self._reached_file:
            with open(self._reached_file, "a") as starts:
                starts.write(f"{self._generation} {self.initial_step}\n")
            self._reached_fd = os.open(f"{self._reached_file}.{self._generation}", os.O_WRONLY | os.O_CREAT, 0o644)
            self._times_fd = os.open(f"{self._reached_file}.{self._generation}.times",
                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._steps += 1
        if self._reached_fd is not None:  # rewritten in place: what a SIGKILL leaves is the last step's
            os.pwrite(self._reached_fd, f"{self._steps:20d}\n".encode(), 0)
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.last_step_end = time.monotonic()
        if self.first_step_end is None:
            self.first_step_end = self.last_step_end
        if self._times_fd is not None:  # unbuffered: a SIGKILL loses no step that ended
            os.write(self._times_fd, f"{self._steps} {self.last_step_end:.6f}\n".encode())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        print(f"training done at step {int(self.model.optimizer.iterations.numpy())}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    strategy, env, plan, data = common.set_up(args)
    train, test = datasets(data, plan, args.seed)
    steps_per_epoch = args.steps_per_epoch or max(1, len(data.x_train) // plan.global_batch)
    with strategy.scope():
        model = common.build_cnn()
        schedule = common.learning_rate_schedule(plan.learning_rate, args.epochs * steps_per_epoch)
        model.compile(optimizer=keras.optimizers.Adam(schedule),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    probe = StepProbe(args.step_seconds, args.reached_file if env.rank == 0 else None, env.generation)
    backup_dir = args.backup_dir or env.backup_path(EXAMPLE)
    if args.plain_keras:
        callbacks = [keras.callbacks.BackupAndRestore(backup_dir, save_freq=args.save_every, delete_checkpoint=False)]
    else:
        callbacks = fit_callbacks(backup_dir, save_every=args.save_every, global_batch_size=plan.global_batch,
                                  tensorboard_dir=args.tensorboard_dir, fast_tier=args.fast_tier == "on",
                                  survivors_save=args.survivors_save == "on")
    fields: dict[str, Any] = {"world_size": env.world_size, "target_step": args.epochs * steps_per_epoch,
                              **plan.as_dict()}
    try:
        started = time.perf_counter()
        history = model.fit(train, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
                            callbacks=[*callbacks, probe], verbose=0)
        fit_seconds = time.perf_counter() - started
    except Preempted as stop:
        common.emit_summary(args, EXAMPLE, preempted=True, final_step=stop.step, initial_step=probe.initial_step,
                            **fields)
        raise
    progress = [c for c in callbacks if isinstance(c, ProgressCallback)]  # evaluation reports progress too
    loss, accuracy = model.evaluate(test, callbacks=progress, verbose=0)
    exported = export_model(model, args.export_dir, strategy) if args.export_dir else None
    train_loss = (history.history.get("loss") or [None])[-1]  # no epoch ran when resumed at the end
    common.emit_summary(args, EXAMPLE, preempted=False, final_step=int(model.optimizer.iterations.numpy()),
                        initial_step=probe.initial_step, fit_seconds=fit_seconds,
                        train_seconds=probe.train_seconds, train_loss=train_loss,
                        loss=float(loss),
                        accuracy=float(accuracy), exported=exported, weights_digest=common.final_weights(model, args),
                        **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
