"""Saves large snapshots back to back on the fast checkpoint tier (tfelastic.trainer.tiered), for the kill test.

    TFELASTIC_LOCAL_CHECKPOINT_DIR=LOCAL python snapshot_writer.py SHARED_DIR

Restores the newest snapshot of either tier that restores, prints ``restored STEP TIER VALUES`` (VALUES: the
distinct values found in the variables; a consistent snapshot has one, equal to STEP), then, for step = STEP+1,
...: fills every variable with the step and starts its snapshot, printing ``sealed STEP`` once a snapshot is
complete in the local tier and ``persisted STEP`` once the chief's copy is complete in the shared tier. The
variables are large (64 MiB in all), so a kill at a random time usually lands inside a write or a copy.
"""

import sys

from tfelastic.trainer.tfkeras import ensure_legacy_keras
from tfelastic.trainer.tiered import TieredCheckpoint

ensure_legacy_keras()
import tensorflow as tf  # noqa: E402

variables = [tf.Variable(tf.zeros([2_000_000])) for _ in range(8)]
step = tf.Variable(0, dtype=tf.int64)
tier = TieredCheckpoint(tf.train.Checkpoint(step=step, variables=variables), sys.argv[1], is_chief=True,
                        keep_local=2, keep_shared=2)
restored = tier.restore()
values = sorted({float(v) for var in variables for v in tf.unique(var).y.numpy()})
print(f"restored {int(step.numpy())} {restored.tier} {' '.join(f'{v:g}' for v in values)}", flush=True)
sealed = persisted = None
while True:
    step.assign_add(1)
    for var in variables:
        var.assign(tf.fill(var.shape, float(step.numpy())))
    tier.save(int(step.numpy()))
    if tier.sealed_step != sealed:
        sealed = tier.sealed_step
        print(f"sealed {sealed}", flush=True)
    if tier.persisted_step != persisted:
        persisted = tier.persisted_step
        print(f"persisted {persisted}", flush=True)
