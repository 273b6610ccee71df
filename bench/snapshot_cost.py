"""Where a snapshot's cost goes, for the fast tier's model (~406 MB of training state: bench/tier_trainer.py's).

    python -m bench.snapshot_cost [--repeat 3] [--directory /dev/shm]

Prints the wall and CPU seconds of: TensorFlow's synchronous save; its asynchronous save until written; copying
the state into freshly allocated memory and into memory already in use; a flash snapshot
(tfelastic.trainer.flash) into a new file and into the file of the snapshot before the last, kept mapped (the
fast tier's turns). Each is repeated; the first of a kind pays for first use. Files stay under a temporary
directory in ``--directory``, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow loads (docs/facts.md, fact 1)

import numpy as np
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer import flash


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(label: str, action: Callable[[], object]) -> None:
    cpu, wall = cpu_seconds(), time.monotonic()
    action()
    print(f"{label:<44} wall {time.monotonic() - wall:6.3f} s  cpu {cpu_seconds() - cpu:6.3f} s", flush=True)


def trained_model() -> keras.Model:
    model = keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(4096, activation="relu"),
                              keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(4096, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(256, 64)).astype("float32"), rng.integers(0, 10, size=256), verbose=0)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--directory", default="/dev/shm")
    args = parser.parse_args()
    model = trained_model()
    checkpoint = tf.train.Checkpoint(model=model)
    values = [v.numpy() for v in model.variables + model.optimizer.variables()]
    print(f"training state: {sum(v.nbytes for v in values) / 1e6:.0f} MB", flush=True)
    root = tempfile.mkdtemp(prefix="tfelastic-bench-", dir=args.directory)
    try:
        run(args.repeat, root, checkpoint, values)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def copy_into(targets: list[np.ndarray], values: list[np.ndarray]) -> None:
    for target, value in zip(targets, values, strict=True):
        np.copyto(target, value)


def run(repeat: int, root: str, checkpoint: tf.train.Checkpoint, values: list[np.ndarray]) -> None:
    asynchronous = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    reused = [np.empty_like(v) for v in values]
    for n in range(repeat):
        measure(f"TensorFlow, synchronous #{n}", lambda: checkpoint.write(f"{root}/sync{n}/ckpt"))  # noqa: B023
    for n in range(repeat):
        def write_async() -> None:
            checkpoint.write(f"{root}/async{n}/ckpt", options=asynchronous)  # noqa: B023
            checkpoint.sync()
        measure(f"TensorFlow, asynchronous until written #{n}", write_async)
    for n in range(repeat):
        measure(f"copy into new memory #{n}", lambda: [np.array(v, copy=True) for v in values])
        measure(f"copy into memory in use #{n}", lambda: copy_into(reused, values))
    writer = flash.FlashWriter.from_tensorflow_snapshot(checkpoint, f"{root}/sync0")
    assert writer is not None, "the model's checkpoint should be all plain variables"
    for n in range(repeat + 2):
        building = f"{root}/flash{n}"
        os.makedirs(building)
        recycled = f"{root}/flash{n - 2}/{flash.DATA}" if n >= 2 else None
        kind = "a reused, mapped file" if recycled else "a new file"
        measure(f"flash snapshot into {kind} #{n}",
                lambda: writer.write(building, recycled, keep_mapped=True))  # noqa: B023
    writer.release()


if __name__ == "__main__":
    main()
