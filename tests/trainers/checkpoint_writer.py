"""Saves large checkpoints back to back with tfelastic.trainer's ChiefCheckpointManager, for the kill test.

    python checkpoint_writer.py DIR

Restores the newest checkpoint that restores, prints ``restored STEP VALUES`` (VALUES: the distinct values
found in the variables; a consistent checkpoint has one, equal to STEP), then, for step = STEP+1, ...: fills
every variable with the step and saves it as ckpt-STEP, printing ``saved STEP`` once the save returned. The
variables are large (64 MiB in all), so a kill at a random time usually lands inside a save.
"""

import sys

from tfelastic.trainer.checkpoint import ChiefCheckpointManager
from tfelastic.trainer.tfkeras import ensure_legacy_keras

ensure_legacy_keras()
import tensorflow as tf  # noqa: E402

variables = [tf.Variable(tf.zeros([2_000_000])) for _ in range(8)]
step = tf.Variable(0, dtype=tf.int64)
manager = ChiefCheckpointManager(tf.train.Checkpoint(step=step, variables=variables), sys.argv[1], is_chief=True,
                                 max_to_keep=2)
manager.restore()
values = sorted({float(v) for var in variables for v in tf.unique(var).y.numpy()})
print(f"restored {int(step.numpy())} {' '.join(f'{v:g}' for v in values)}", flush=True)
while True:
    step.assign_add(1)
    for var in variables:
        var.assign(tf.fill(var.shape, float(step.numpy())))
    manager.save(int(step.numpy()))
    print(f"saved {int(step.numpy())}", flush=True)
