"""A parameter-server training script written the TensorFlow way, with no knowledge of tfelastic.

It follows TensorFlow's "Parameter server training with ParameterServerStrategy" tutorial, Model.fit part: the
cluster comes from TF_CONFIG through ``TFConfigClusterResolver``; a "worker" or "ps" task starts its own
``tf.distribute.Server`` and joins it (it never exits by itself); the chief builds a
``tf.distribute.ParameterServerStrategy`` with a ``MinSizePartitioner``, a model in ``strategy.scope()``, a
``DatasetCreator`` whose function each worker runs, and ``model.fit`` (which creates the ``ClusterCoordinator``)
with ``tf.keras.callbacks.BackupAndRestore`` (saving every epoch, its default: the only saving it does under this
strategy). The tutorial's random data stays random; its TensorBoard and ModelCheckpoint callbacks are left out. It
imports nothing of tfelastic: the daemon must run it as it is.

    python ps_tutorial.py [BACKUP_DIR]

Test knobs, ordinary environment variables: PS_TUTORIAL_EPOCHS (default 5), PS_TUTORIAL_STEPS (steps per epoch,
default 20), PS_TUTORIAL_EPOCH_SECONDS (the chief pauses this long after each epoch, default 0).
"""

import os
import sys
import time

import tensorflow as tf

EPOCHS = int(os.environ.get("PS_TUTORIAL_EPOCHS", "5"))
STEPS = int(os.environ.get("PS_TUTORIAL_STEPS", "20"))
EPOCH_SECONDS = float(os.environ.get("PS_TUTORIAL_EPOCH_SECONDS", "0"))
GLOBAL_BATCH_SIZE = 64


def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
    batch_size = input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)
    x = tf.random.uniform((10, 10))
    y = tf.random.uniform((10,))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(batch_size).prefetch(2)


def main() -> int:
    backup_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/backup"
    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if cluster_resolver.task_type in ("worker", "ps"):
        os.environ["GRPC_FAIL_FAST"] = "use_caller"  # the tutorial's setting: a lost peer fails the call
        server = tf.distribute.Server(cluster_resolver.cluster_spec(), job_name=cluster_resolver.task_type,
                                      task_index=cluster_resolver.task_id,
                                      protocol=cluster_resolver.rpc_layer or "grpc", start=True)
        server.join()

    num_ps = len(cluster_resolver.cluster_spec().as_dict().get("ps", []))
    variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10), max_shards=num_ps)
    strategy = tf.distribute.ParameterServerStrategy(cluster_resolver, variable_partitioner=variable_partitioner)

    with strategy.scope():
        model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])
        model.compile(tf.keras.optimizers.legacy.SGD(learning_rate=0.1), loss="mse", steps_per_execution=10)

    callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
    if EPOCH_SECONDS:  # a test knob, not the tutorial's: slows the run down between epochs
        callbacks.append(tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: time.sleep(EPOCH_SECONDS)))
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=EPOCHS, steps_per_epoch=STEPS,
              callbacks=callbacks, verbose=2)
    print(f"done at step {int(model.optimizer.iterations.numpy())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
