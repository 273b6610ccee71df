"""The keras_fit CNN trained with a custom loop: ``strategy.run``, the loss averaged over the global batch, a
snapshot every ``--save-every`` steps (or ``auto``) on the fast tier, persisted to shared storage by the chief, an
exact restore (model, optimizer, step, epoch and position in the epoch), a distributed test loop, and the final
checkpoint evaluated again in a model built without any strategy.

Deterministic for a given ``--seed``: a run interrupted (killed, or stopped by SIGTERM with exit 42) and resumed
ends with the same weights as an uninterrupted one at the same world size; the summary's ``weights_digest``
shows it. The last line of stdout is a JSON summary.

    python examples/custom_loop.py --steps 200 --save-every 50 --export-dir /tmp/cnn
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import mnist_like as common
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer.data import distribute_epoch, shuffled
from tfelastic.trainer.export import export_model
from tfelastic.trainer.loop import TrainLoop, make_eval_step
from tfelastic.trainer.preemption import Preempted

EXAMPLE = "custom_loop"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train (default 300)")
    parser.add_argument("--max-to-keep", type=int, default=3, help="checkpoints kept (default 3)")
    common.add_common_arguments(parser)
    return parser.parse_args(argv)


def evaluate(loop: TrainLoop, data: common.Data, global_batch: int) -> tuple[float, float]:
    """The distributed test loop: mean loss and accuracy over the test set (a partial last batch is dropped)."""
    strategy, model = loop.strategy, loop.model
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    step = make_eval_step(strategy, model, common.per_example_loss, global_batch, [accuracy])
    test = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test))
    iterator = iter(distribute_epoch(strategy, lambda epoch: test, epoch=0, global_batch=global_batch))
    batches = len(data.x_test) // global_batch
    total = 0.0
    for _ in range(batches):
        total += float(step(iterator))
        loop.report_alive()
    return total / max(1, batches), float(accuracy.result())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    strategy, env, plan, data = common.set_up(args)
    train = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    with strategy.scope():
        model = common.build_cnn()
        optimizer = keras.optimizers.Adam(common.learning_rate_schedule(plan.learning_rate, args.steps))
        train_accuracy = keras.metrics.SparseCategoricalAccuracy()
    loop = TrainLoop(strategy, model, optimizer, loss_fn=common.per_example_loss, global_batch=plan.global_batch,
                     examples=lambda epoch: shuffled(train, epoch, args.seed, len(data.x_train)),
                     examples_per_epoch=len(data.x_train), checkpoint_dir=args.backup_dir or env.backup_path(EXAMPLE),
                     save_every=args.save_every, metrics=[train_accuracy], max_to_keep=args.max_to_keep,
                     survivors_save=args.survivors_save == "on",
                     on_step=(lambda step, loss: time.sleep(args.step_seconds)) if args.step_seconds else None)
    restored = loop.restore()
    print(f"starting at step {loop.step} (epoch {loop.epoch}, {loop.examples_done} examples into it)", flush=True)
    fields: dict[str, Any] = {"world_size": env.world_size, "target_step": args.steps,
                              "initial_step": loop.step, "restored_from": restored.path,
                              "skipped_checkpoints": [path for path, _ in restored.skipped], **plan.as_dict()}
    try:
        result = loop.run(args.steps)
    except Preempted as stop:
        common.emit_summary(args, EXAMPLE, preempted=True, final_step=stop.step, epoch=loop.epoch,
                            examples_in_epoch=loop.examples_done, weights_digest=common.final_weights(model, args),
                            **fields)
        raise
    loss, accuracy = evaluate(loop, data, plan.global_batch)
    final_checkpoint = loop.last_checkpoint
    assert final_checkpoint is not None  # run() ends with a save
    exported = export_model(model, args.export_dir, strategy) if args.export_dir else None
    common.emit_summary(args, EXAMPLE, preempted=False, final_step=result.step, epoch=result.epoch,
                        train_loss=result.loss, train_accuracy=float(train_accuracy.result()), loss=loss,
                        accuracy=accuracy, checkpoint=final_checkpoint,
                        restored_accuracy=common.evaluate_checkpoint(final_checkpoint, data), exported=exported,
                        weights_digest=common.final_weights(model, args), **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
