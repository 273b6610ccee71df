"""The demo's trainer: a small real model, trained with MultiWorkerMirroredStrategy and BackupAndRestore.

It uses generated data (no downloads), keeps the global batch fixed whatever the world size, reports progress
to the agent, and, on the chief, appends JSON events (start, first_step, end) to ``TFELASTIC_DEMO_EVENTS`` so
the demo can show where each generation resumed and how long recovery took.

    python -m tfelastic.trainer.demo_trainer [--epochs 4] [--steps-per-epoch 50] [--save-every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Keras 3 cannot run model.fit under MWMS
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfelastic.trainer.progress import ProgressReporter

GLOBAL_BATCH = 64
FEATURES = 32
CLASSES = 4


def _event(kind: str, any_rank: bool = False, **fields: object) -> None:
    path = os.environ.get("TFELASTIC_DEMO_EVENTS")
    if not path or (os.environ.get("TFELASTIC_RANK", "0") != "0" and not any_rank):
        return
    record = {"event": kind, "time": time.time(), "generation": int(os.environ.get("TFELASTIC_GENERATION", 0)),
              "world_size": int(os.environ.get("TFELASTIC_WORLD_SIZE", 1)), **fields}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="extra time per step, to stand in for a heavier model (tests use it)")
    parser.add_argument("--slow-every", type=int, default=0,
                        help="every Nth step takes --slow-step-seconds instead of --step-seconds: step times that "
                             "vary, as with a periodic callback or an uneven batch (benchmarks use it)")
    parser.add_argument("--slow-step-seconds", type=float, default=0.0)
    parser.add_argument("--wedge-at-step", type=int, default=0,
                        help="in the first generation, the last rank stops making progress at this step while "
                             "its process stays alive, as a deadlocked input pipeline would: TensorFlow's "
                             "heartbeats go on, only hang detection can catch it (tests use it)")
    args = parser.parse_args(argv)
    wedged_rank = os.environ.get("TFELASTIC_GENERATION") == "1" and (
        os.environ.get("TFELASTIC_RANK") == str(int(os.environ.get("TFELASTIC_WORLD_SIZE", 1)) - 1))

    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    backup_dir = os.environ.get("TFELASTIC_BACKUP_DIR", "/tmp/tfelastic-demo-backup")
    reporter = ProgressReporter.from_env()

    rng = tf.random.Generator.from_seed(7)
    x = rng.normal((4096, FEATURES))
    y = tf.argmax(tf.matmul(x, rng.normal((FEATURES, CLASSES))), axis=1)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH).with_options(options)

    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Input((FEATURES,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(CLASSES),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Progress(keras.callbacks.Callback):  # type: ignore[misc]
        first = True

        def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            print(f"generation {os.environ.get('TFELASTIC_GENERATION')}: starting at step {step}", flush=True)
            _event("start", initial_step=step)
            reporter.report(step, force=True)

        def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            if self.first:
                self.first = False
                _event("first_step", step=step)
            reporter.report(step, examples=step * GLOBAL_BATCH, loss=(logs or {}).get("loss"),
                            checkpoint_step=step if step % args.save_every == 0 else None)
            slow = args.slow_every > 0 and step % args.slow_every == 0
            if pause := args.slow_step_seconds if slow else args.step_seconds:
                time.sleep(pause)
            if wedged_rank and step >= args.wedge_at_step > 0:
                _event("wedged", any_rank=True, step=step)
                while True:
                    time.sleep(3600)

        def on_train_end(self, logs: dict[str, float] | None = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            reporter.report(step, done=True)
            _event("end", final_step=step, loss=float((logs or {}).get("loss", float("nan"))))

    callbacks = [keras.callbacks.BackupAndRestore(backup_dir, save_freq=args.save_every), Progress()]
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, callbacks=callbacks, verbose=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
