"""A 2-worker mirrored job whose rank 0 is SIGKILLed at a random moment, for the survivors' save
(trainer/survivors.py): tests/integration/test_survivors.py and bench/survivors.py run it.

    survivor.py train STYLE STORE KILL_SECONDS CHAIN   (STYLE: loop or fit; run as both workers, with TF_CONFIG)
    survivor.py stall STYLE STORE STEP CHAIN           (the same; rank 1 sleeps after STEP, rank 0 keeps the chain)
    survivor.py restore STYLE STORE                    (alone: restores the newest snapshot, prints a JSON line)

``train``: rank 0 kills itself KILL_SECONDS after its first step ends (mid-step, at any point of it: compute,
all-reduce, update); rank 1 appends the state it holds after every completed step to CHAIN (a JSON line: step and
a checksum of every variable, the optimizer's included) and, once its step fails, a last line saying what the
survivors' save wrote. ``stall``: rank 1 sleeps for good after step STEP, so rank 0 waits in its next step's
all-reduce for a peer that is alive, with no call that could fail: only the agent's word (SIGUSR1,
trainer/peer_failure.py) ends that wait. ``restore`` prints the checksum of what a new process restores, so that
the test compares it, bit for bit, with the chain's line for the same step. The model is large enough (~19 MB of
weights; SURVIVOR_WIDTH sets its width) that the all-reduce takes a good part of a step.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer.callbacks import fit_callbacks
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.loop import TrainLoop

FEATURES, CLASSES, BATCH = 256, 10, 32
WIDTH = int(os.environ.get("SURVIVOR_WIDTH", "2048"))  # bench/survivors.py --state sets it
EXAMPLES = 4096


def build(strategy: Any) -> tuple[Any, Any]:
    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((FEATURES,)), keras.layers.Dense(WIDTH, activation="relu"),
                                  keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(CLASSES)])
        optimizer = keras.optimizers.Adam(1e-3)
    return model, optimizer


def data() -> tf.data.Dataset:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=EXAMPLES)
    return tf.data.Dataset.from_tensor_slices((x, y))


def checksum(model: Any, optimizer: Any) -> str:
    """Every variable's bytes summed as 64-bit words, in a fixed order: the model's, then the optimizer's."""
    sums = []
    for variable in [*model.trainable_variables, *optimizer.variables]:
        raw = np.ascontiguousarray(variable.numpy()).view(np.uint8).ravel()
        padded = np.zeros(-(-raw.size // 8) * 8, np.uint8)
        padded[:raw.size] = raw
        sums.append(int(padded.view(np.uint64).sum(dtype=np.uint64)))
    return hashlib.sha256(",".join(map(str, sums)).encode()).hexdigest()[:16]


def loss_fn(labels: Any, logits: Any) -> Any:
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def train(style: str, store: str, kill_seconds: float, chain: str, stall_after: int | None = None) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = TrainerEnvironment.from_env().rank
    survivor = 0 if stall_after is not None else 1
    model, optimizer = build(strategy)
    killer: list[threading.Timer] = []

    def after_step(step: int) -> None:
        if stall_after is not None and rank == 1 and step == stall_after:
            time.sleep(600)
        if stall_after is None and rank == 0 and not killer:
            killer.append(threading.Timer(kill_seconds, os.kill, (os.getpid(), signal.SIGKILL)))
            killer[0].start()
        if rank == survivor:
            record({"step": step, "checksum": checksum(model, optimizer)})

    def record(line: dict[str, Any]) -> None:
        with open(chain, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    try:
        if style == "loop":
            loop = TrainLoop(strategy, model, optimizer, loss_fn=loss_fn, global_batch=2 * BATCH,
                             examples=lambda epoch: data(), examples_per_epoch=EXAMPLES, checkpoint_dir=store,
                             save_every=10_000, on_step=lambda step, loss: after_step(step))
            loop.restore()
            loop.run(10_000)
        else:
            class Chain(keras.callbacks.Callback):  # type: ignore[misc]
                def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                    after_step(int(optimizer.iterations.numpy()))

            with strategy.scope():
                model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(data().repeat().batch(2 * BATCH), epochs=1000, steps_per_epoch=7, verbose=0,
                      callbacks=[*fit_callbacks(store, save_every=10_000, graceful_stop=False), Chain()])
    except tf.errors.OpError as e:
        names = sorted(os.listdir(store)) if os.path.isdir(store) else []  # none: nothing was ever saved
        saved = [name for name in names if os.path.exists(os.path.join(store, name, "SURVIVORS.json"))]
        record({"failed": type(e).__name__, "survivors": saved})
        sys.exit(1)


def restore(style: str, store: str) -> None:
    strategy = tf.distribute.get_strategy()
    model, optimizer = build(strategy)
    began = time.monotonic()
    if style == "loop":
        loop = TrainLoop(strategy, model, optimizer, loss_fn=loss_fn, global_batch=2 * BATCH,
                         examples=lambda epoch: data(), examples_per_epoch=EXAMPLES, checkpoint_dir=store)
        result = loop.restore()
        position = {"epoch": loop.epoch, "examples_done": loop.examples_done}
    else:
        from tfelastic.trainer.fast_backup import TieredTrainingState

        model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        optimizer.build(model.trainable_variables)
        state = TieredTrainingState(model, store, TrainerEnvironment.from_env(), 2, 3)
        result = state.restore()
        position = {"epoch": int(state._ckpt_saved_epoch.numpy()), "batch": int(state._ckpt_saved_batch.numpy())}
    print(json.dumps({"step": result.step, "tier": result.tier, "checksum": checksum(model, optimizer),
                      "iterations": int(optimizer.iterations.numpy()), "seconds": time.monotonic() - began,
                      **position}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "stall":
        train(sys.argv[2], sys.argv[3], 0.0, sys.argv[5], stall_after=int(sys.argv[4]))
    else:
        restore(sys.argv[2], sys.argv[3])
