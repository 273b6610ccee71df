"""A multi-worker Keras script written the TensorFlow way, with no knowledge of tfelastic.

It follows TensorFlow's "Multi-worker training with Keras" tutorial: the cluster comes from TF_CONFIG,
``tf.distribute.MultiWorkerMirroredStrategy()``, a model built and compiled in ``strategy.scope()``,
``tf.keras.callbacks.BackupAndRestore(backup_dir=...)`` (saving every epoch, its default) and ``model.fit``. The
tutorial's MNIST download is replaced by generated data (no machine here reaches the internet). It imports
nothing of tfelastic: progress reports can only come from the agent's automatic instrumentation.

    python unmodified_keras.py [BACKUP_DIR]

Test knobs, ordinary environment variables: UNMODIFIED_EPOCHS (default 6), UNMODIFIED_STEPS (steps per epoch,
default 10), UNMODIFIED_STEP_SECONDS (time the input pipeline takes per batch, default 0), UNMODIFIED_HANG_AT and
UNMODIFIED_HANG_MARKER: the input pipeline of the first worker to produce batch number HANG_AT sleeps forever
while its process stays alive (a stuck pipeline, which TensorFlow does not notice: docs/facts.md, fact 3), once
per marker file; with UNMODIFIED_HANG_EVERY_WORKER=1 every worker's pipeline does (a marker file per task index).
UNMODIFIED_OOM_MARKER: the first worker to start asks TensorFlow for a 4 TiB tensor before it trains, and dies of
the ResourceExhaustedError, once per marker file.
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

EPOCHS = int(os.environ.get("UNMODIFIED_EPOCHS", "6"))
STEPS = int(os.environ.get("UNMODIFIED_STEPS", "10"))
STEP_SECONDS = float(os.environ.get("UNMODIFIED_STEP_SECONDS", "0"))
HANG_AT = int(os.environ.get("UNMODIFIED_HANG_AT", "0"))
HANG_MARKER = os.environ.get("UNMODIFIED_HANG_MARKER", "")
if HANG_MARKER and os.environ.get("UNMODIFIED_HANG_EVERY_WORKER") == "1":
    HANG_MARKER += f".{json.loads(os.environ.get('TF_CONFIG', '{}')).get('task', {}).get('index', 0)}"

_batches = 0


def slow_input(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stands in for a heavy input pipeline; hangs once at batch HANG_AT if asked to."""
    global _batches
    _batches += 1
    if HANG_AT and _batches == HANG_AT and HANG_MARKER:
        try:
            os.close(os.open(HANG_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # the first worker there wins
        except FileExistsError:
            pass
        else:
            print(f"input pipeline: hanging at batch {_batches}", flush=True)
            while True:
                time.sleep(60)
    time.sleep(STEP_SECONDS)
    return x, y


def run_out_of_memory_once(marker: str) -> None:
    """A real out-of-memory error of TensorFlow's: no machine here has 4 TiB, and it raises, not the kernel."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    tf.random.uniform([2**20, 2**20])


def generated_dataset(batch_size: int) -> tf.data.Dataset:
    rng = np.random.default_rng(7)
    x_train = rng.random((2048, 28, 28), dtype=np.float32)
    y_train = (x_train.mean(axis=(1, 2)) * 10).astype(np.int64) % 10
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048).repeat().batch(batch_size)
    if STEP_SECONDS or HANG_AT:
        dataset = dataset.map(lambda x, y: tf.numpy_function(slow_input, [x, y], [tf.float32, tf.int64],
                                                             stateful=True))
        dataset = dataset.map(lambda x, y: (tf.ensure_shape(x, [None, 28, 28]), tf.ensure_shape(y, [None])))
    return dataset


def build_and_compile_model() -> tf.keras.Model:
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(8, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.001), metrics=["accuracy"])
    return model


def main() -> int:
    backup_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/backup"
    per_worker_batch_size = 16
    tf_config = json.loads(os.environ.get("TF_CONFIG", '{"cluster": {"worker": ["localhost:0"]}}'))
    num_workers = len(tf_config["cluster"]["worker"])
    if os.environ.get("UNMODIFIED_OOM_MARKER"):
        run_out_of_memory_once(os.environ["UNMODIFIED_OOM_MARKER"])

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = generated_dataset(global_batch_size)
    with strategy.scope():
        multi_worker_model = build_and_compile_model()

    callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
    multi_worker_model.fit(multi_worker_dataset, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks,
                           verbose=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
