"""What the examples share: MNIST-like data (generated, or an .npz), the small CNN, flags, and the summary line.

Generated data: 28x28 grayscale images in 10 classes. Each class has a smooth random template; an image is its
class's template, shifted by up to 2 pixels, scaled in brightness, plus Gaussian noise, all from a seed. A CNN
learns it well above chance (10%) in a few hundred steps on a CPU; there is no download (machines may be
offline). ``--data PATH`` reads an ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test`` (the layout of
Keras' ``mnist.npz``: uint8 images of 28x28, integer labels) instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from tfelastic.trainer.batching import BatchPlan, plan_batches
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.tfkeras import ensure_legacy_keras

ensure_legacy_keras()
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402
from tfelastic.trainer.strategy import make_strategy  # noqa: E402

CLASSES = 10
SIDE = 28


@dataclass(frozen=True)
class Data:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def generate(n_train: int, n_test: int, seed: int) -> Data:
    """Seeded synthetic MNIST-like data (see the module docstring)."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((CLASSES, 7, 7)) ** 2  # sparse bright blobs
    templates = np.kron(coarse, np.ones((4, 4)))  # 7x7 -> 28x28

    def images(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, CLASSES, n)
        shifts = rng.integers(-2, 3, (n, 2))
        x = np.stack([np.roll(templates[c], tuple(s), axis=(0, 1)) for c, s in zip(labels, shifts, strict=True)])
        x = x * rng.uniform(0.6, 1.2, (n, 1, 1)) + rng.normal(0.0, 0.35, x.shape)
        return np.clip(x, 0.0, 1.0).astype(np.float32)[..., None], labels.astype(np.int64)

    x_train, y_train = images(n_train)
    x_test, y_test = images(n_test)
    return Data(x_train, y_train, x_test, y_test)


def load_npz(path: str) -> Data:
    """An mnist.npz-like file: uint8 (or float in [0, 1]) images of 28x28 and integer labels."""
    with np.load(path) as f:
        missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
        if missing:
            raise SystemExit(f"--data {path}: missing arrays {sorted(missing)}; expected x_train, y_train, x_test, "
                             "y_test as in Keras' mnist.npz")
        arrays = {k: f[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    for key in ("x_train", "x_test"):
        x = arrays[key]
        if x.shape[1:3] != (SIDE, SIDE):
            raise SystemExit(f"--data {path}: {key} has shape {x.shape}, expected (N, 28, 28) images")
        scale = 255.0 if x.dtype == np.uint8 else 1.0
        arrays[key] = (x.reshape(len(x), SIDE, SIDE, 1) / scale).astype(np.float32)
    return Data(arrays["x_train"], arrays["y_train"].astype(np.int64), arrays["x_test"],
                arrays["y_test"].astype(np.int64))


def load_data(args: argparse.Namespace) -> Data:
    if args.data:
        return load_npz(args.data)
    return generate(args.train_examples, args.test_examples, args.seed)


def build_cnn(batch_norm: bool = False, synchronized: bool = False) -> Any:
    """Conv2D-MaxPooling twice, then Dense: about 17k weights. ``batch_norm``: BatchNormalization after each
    convolution, ``synchronized``: its batch statistics computed over the global batch (SyncBatchNorm)."""

    def norm() -> list[Any]:
        return [keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized)] if batch_norm else []

    def conv(filters: int) -> list[Any]:
        if not batch_norm:
            return [keras.layers.Conv2D(filters, 3, activation="relu")]
        # No bias before BatchNormalization: it cancels out, and Adam would turn its zero gradient's rounding
        # noise into steps of the full learning rate.
        return [keras.layers.Conv2D(filters, 3, use_bias=False), *norm(), keras.layers.ReLU()]

    return keras.Sequential([
        keras.layers.Input((SIDE, SIDE, 1)),
        *conv(8),
        keras.layers.MaxPooling2D(),
        *conv(16),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


def evaluate_checkpoint(checkpoint_path: str, data: Data, batch_norm: bool = False) -> float:
    """Test accuracy of the model in a checkpoint, rebuilt outside any strategy: the checkpoint is usable alone
    (no collectives, no other worker)."""
    model = build_cnn(batch_norm=batch_norm)
    tf.train.Checkpoint(model=model).restore(checkpoint_path).expect_partial()
    correct = 0
    for start in range(0, len(data.x_test), 256):
        logits = model(data.x_test[start:start + 256], training=False)
        correct += int(np.sum(np.argmax(logits, axis=1) == data.y_test[start:start + 256]))
    return correct / max(1, len(data.x_test))


def per_example_loss(labels: Any, logits: Any) -> Any:
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def learning_rate_schedule(base: float, total_steps: int) -> Any:
    """Cosine decay to a tenth of ``base`` over the run: a function of the optimizer step, so restored exactly."""
    return keras.optimizers.schedules.CosineDecay(base, decay_steps=max(1, total_steps), alpha=0.1)


def seed_everything(seed: int) -> None:
    """Same seed, same run: Python, NumPy and TensorFlow seeds, and deterministic TensorFlow kernels."""
    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()


def final_weights(model: Any, args: argparse.Namespace) -> str:
    """The SHA-256 (16 hex digits) of every weight's bytes, in order (equal digests: bit-identical models); the
    chief also writes them to ``--weights-file`` (an .npz, arrays w0, w1, ...). Reading a sync-on-read variable
    all-reduces it: every worker must call this."""
    weights = model.get_weights()
    digest = hashlib.sha256()
    for weight in weights:
        digest.update(np.ascontiguousarray(weight).tobytes())
    if args.weights_file and TrainerEnvironment.from_env().is_chief:
        np.savez(args.weights_file, **{f"w{i}": w for i, w in enumerate(weights)})
    return digest.hexdigest()[:16]


def save_interval(value: str) -> int | None:
    """``--save-every``: a positive number of steps, or 'auto' (None: the fast tier's adaptive interval)."""
    if value == "auto":
        return None
    try:
        steps = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a number of steps nor 'auto'") from None
    if steps < 1:
        raise argparse.ArgumentTypeError(f"{steps} must be a positive number of steps, or 'auto'")
    return steps


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-every", type=save_interval, default=50,
                        help="steps between checkpoints, or 'auto': as often as 1 %% of training time allows "
                             "(the fast tier's default; default here 50)")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, help="global batch size (default 64)")
    batch.add_argument("--per-replica-batch", type=int, help="batch size of each replica")
    parser.add_argument("--batch-policy", choices=["keep-global", "keep-per-replica"], default="keep-global",
                        help="when the world size changes: keep the global batch, or keep the per-replica batch "
                             "and scale the learning rate linearly (default keep-global)")
    parser.add_argument("--learning-rate", type=float, default=2e-3,
                        help="learning rate for --reference-replicas replicas (default 0.002)")
    parser.add_argument("--reference-replicas", type=int, default=1,
                        help="replica count the batch size and learning rate were tuned for (default 1)")
    parser.add_argument("--data", help="an .npz like mnist.npz (x_train, y_train, x_test, y_test); default: "
                                       "generated data")
    parser.add_argument("--train-examples", type=int, default=4096, help="generated training examples")
    parser.add_argument("--test-examples", type=int, default=1024, help="generated test examples")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data, the weights and the order")
    parser.add_argument("--backup-dir", help="checkpoint directory (default: under TFELASTIC_BACKUP_DIR, or "
                                             "./tfelastic-backup/JOB without an agent)")
    parser.add_argument("--export-dir", help="where the chief exports the final model (.keras: one file; "
                                             "otherwise a SavedModel directory)")
    parser.add_argument("--collective", choices=["auto", "ring", "nccl"], help="collective implementation "
                        "(default: TFELASTIC_COLLECTIVE, else auto)")
    parser.add_argument("--summary-file", help="also append the JSON summary line to this file")
    parser.add_argument("--weights-file", help="the chief writes the final weights to this .npz")
    parser.add_argument("--survivors-save", choices=["on", "off"], default="on",
                        help="a mirrored job: after a peer's failure, ranks 0 and 1 save the step they hold "
                        "(default on)")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="sleep this long after each step, to stand in for a heavier model (tests)")


def batch_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``plan_batches`` from the flags."""
    if args.per_replica_batch is not None:
        return {"per_replica_batch": args.per_replica_batch}
    return {"global_batch": args.global_batch if args.global_batch is not None else 64}


def set_up(args: argparse.Namespace) -> tuple[Any, TrainerEnvironment, BatchPlan, Data]:
    """What every example does first: seeds, the strategy, the batch plan (announced) and the data."""
    seed_everything(args.seed)
    strategy = make_strategy(args.collective)
    plan = plan_batches(strategy.num_replicas_in_sync, args.batch_policy, learning_rate=args.learning_rate,
                        reference_replicas=args.reference_replicas, **batch_arguments(args))
    announce(plan)
    return strategy, TrainerEnvironment.from_env(), plan, load_data(args)


def announce(plan: BatchPlan) -> None:
    """One line with the world and the batch plan, at start (the agents' logs show it per generation)."""
    env = TrainerEnvironment.from_env()
    print(f"world size {env.world_size}, {plan.replicas} replicas: global batch {plan.global_batch}, "
          f"{plan.per_replica_batch} per replica, learning rate {plan.learning_rate:g} ({plan.policy.value})",
          flush=True)


def emit_summary(args: argparse.Namespace, example: str, **fields: Any) -> dict[str, Any]:
    """Prints the one-line JSON summary (the last line of stdout) and appends it to ``--summary-file``."""
    env = TrainerEnvironment.from_env()
    record = {"example": example, "rank": env.rank, "generation": env.generation, "pid": os.getpid(),
              "time": time.time(), **fields}
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if args.summary_file:
        with open(args.summary_file, "a") as f:  # one write of one line: appends from workers do not interleave
            f.write(line + "\n")
    return record
