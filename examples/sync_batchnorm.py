"""SyncBatchNorm across workers: ``tf_keras.layers.BatchNormalization(synchronized=True)``.

Plain BatchNormalization normalises each replica's share of the batch with that share's own mean and variance:
with 2 workers of 32 examples each, a step does not compute what one worker with the whole global batch of 64
computes. With ``synchronized=True`` the mean and variance are all-reduced over the global batch, so a step is
the same on any number of workers. This example trains the CNN of the other examples with a BatchNormalization
after each convolution, in the custom loop (whose global batches are the same examples on any world size), and
prints the first BatchNormalization layer's moving mean: run it on 1 and on 2 workers and the results agree up to
float rounding; ``--no-sync`` shows that they do not without synchronisation. The last line of stdout is a JSON
summary; ``--weights-file`` writes the final weights to compare.

    python examples/sync_batchnorm.py --steps 100
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import mnist_like as common
import numpy as np
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer.data import shuffled
from tfelastic.trainer.export import export_model
from tfelastic.trainer.loop import TrainLoop
from tfelastic.trainer.preemption import Preempted

EXAMPLE = "sync_batchnorm"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    parser.add_argument("--no-sync", action="store_true", help="plain BatchNormalization, for comparison")
    common.add_common_arguments(parser)
    return parser.parse_args(argv)


def batch_norm_state(model: Any) -> dict[str, list[float]]:
    """The first BatchNormalization layer's moving statistics (reading them all-reduces: call on every worker)."""
    layer = next(layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization))
    return {"bn_moving_mean": [round(float(v), 6) for v in np.asarray(layer.moving_mean)],
            "bn_moving_variance": [round(float(v), 6) for v in np.asarray(layer.moving_variance)]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    strategy, env, plan, data = common.set_up(args)
    train = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    with strategy.scope():
        model = common.build_cnn(batch_norm=True, synchronized=not args.no_sync)
        optimizer = keras.optimizers.Adam(common.learning_rate_schedule(plan.learning_rate, args.steps))
    loop = TrainLoop(strategy, model, optimizer, loss_fn=common.per_example_loss, global_batch=plan.global_batch,
                     examples=lambda epoch: shuffled(train, epoch, args.seed, len(data.x_train)),
                     examples_per_epoch=len(data.x_train), checkpoint_dir=args.backup_dir or env.backup_path(EXAMPLE),
                     save_every=args.save_every,
                     on_step=(lambda step, loss: time.sleep(args.step_seconds)) if args.step_seconds else None)
    loop.restore()
    fields: dict[str, Any] = {"world_size": env.world_size, "target_step": args.steps, "initial_step": loop.step,
                              "synchronized": not args.no_sync, **plan.as_dict()}
    try:
        result = loop.run(args.steps)
    except Preempted as stop:
        common.emit_summary(args, EXAMPLE, preempted=True, final_step=stop.step, **fields)
        raise
    assert loop.last_checkpoint is not None  # run() ends with a save
    accuracy = common.evaluate_checkpoint(loop.last_checkpoint, data, batch_norm=True)
    exported = export_model(model, args.export_dir, strategy) if args.export_dir else None
    common.emit_summary(args, EXAMPLE, preempted=False, final_step=result.step, train_loss=result.loss,
                        accuracy=accuracy, exported=exported, weights_digest=common.final_weights(model, args),
                        **batch_norm_state(model), **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
