"""The trainer of bench/checkpoint_tier.py: a model with ~406 MB of training state (Dense 64-4096-4096-4096-10 and
Adam: weights and two slots), trained with ``model.fit`` on random data, on one worker.

    python bench/tier_trainer.py VARIANT STEPS BACKUP_DIR

VARIANT: ``none`` (no checkpoints), ``sync20`` (tf_keras ``BackupAndRestore(save_freq=20)``), ``fast``
(``fit_callbacks()`` with its defaults: the fast tier, adaptive interval), ``fastN`` (the fast tier every N
steps). Prints one JSON line when training starts (``initial_step``, the restored tier) and, after every step,
``step N T CPU STEAL WRITING COPYING SAVED`` (T: monotonic seconds; CPU: this process's CPU seconds; STEAL: the
host's stolen CPU seconds, what the hypervisor gave to others; WRITING: 1 while a snapshot is written in the
background; COPYING: 1 when a copy to the shared tier ran during the step; SAVED: the step of the newest snapshot
begun, -1 before one), then a summary line with the snapshot stalls and the adaptive interval.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow loads (docs/facts.md, fact 1)

import numpy as np
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer.callbacks import fit_callbacks

variant, steps, backup_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
BATCH = 256


class StepClock(keras.callbacks.Callback):  # type: ignore[misc]
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.step = int(self.model.optimizer.iterations.numpy())
        self.copies = 0
        print(json.dumps({"initial_step": self.step, "tier": getattr(restorer, "restored", None) and
                          restorer.restored.tier}), flush=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.step += 1
        cpu = sum(os.times()[:2])
        tier = restorer.tier if restorer is not None else None
        copies_begun = tier.copies_begun if tier else 0  # a copy may begin and end within the step
        writing, copying = (int(tier.writing), int(tier.copying_step is not None or copies_begun != self.copies))\
            if tier else (0, 0)
        self.copies = copies_begun
        saved = tier.last_save_step if tier and tier.last_save_step is not None else -1
        print(f"step {self.step} {time.monotonic():.4f} {cpu:.3f} {stolen_seconds():.2f} {writing} {copying} {saved}",
              flush=True)


def stolen_seconds() -> float:
    """The host's CPU time stolen by the hypervisor (/proc/stat's 8th field): a VM's neighbours, not us."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


model = keras.Sequential([keras.layers.Input((64,)), keras.layers.Dense(4096, activation="relu"),
                          keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(4096, activation="relu"),
                          keras.layers.Dense(10)])
model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(BATCH * 50, 64)).astype("float32")
y = rng.integers(0, 10, size=BATCH * 50)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
restorer: Any = None
callbacks: list[keras.callbacks.Callback] = []
if variant == "sync20":
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir, save_freq=20, delete_checkpoint=False)]
elif variant.startswith("fast"):
    every = int(variant[4:]) if variant[4:] else None  # fast20: a fixed interval, for comparison
    callbacks = fit_callbacks(backup_dir, save_every=every)
    restorer = callbacks[1]
elif variant != "none":
    raise SystemExit(f"unknown variant {variant!r}: none, sync20 or fast")
model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[*callbacks, StepClock()])
print(json.dumps({"done": True, "stalls": [round(s, 4) for s in getattr(restorer, "stalls", [])],
                  "interval": restorer.schedule.interval if restorer else None,
                  "interference": restorer and restorer.schedule.mean_interference,
                  "copy_cost": restorer and restorer.schedule.mean_copy_cost,
                  "copy_seconds": restorer and restorer.schedule.copy_seconds}), flush=True)
