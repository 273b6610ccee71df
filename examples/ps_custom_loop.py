"""The mnist_like CNN trained by a parameter-server job (ParameterServerStrategy) with a custom loop: one file for
every task. ``serve_unless_chief()`` turns the ps and worker tasks into TensorFlow servers that never return; the
chief creates the model on the parameter servers, restores the newest checkpoint, schedules one step at a time on
the workers with ``ClusterCoordinator.schedule`` (tfelastic's ``make_train_step``), checkpoints every
``--save-every`` steps after waiting for the steps in flight, reports progress, and evaluates the final checkpoint
in a model built without any strategy. A worker killed and relaunched at its address is re-attached; a restarted
chief resumes from its checkpoint. The last line of the chief's stdout is a JSON summary.

Needs TF_CONFIG with a chief, ps and workers: ``tfelastic run --strategy parameter-server --ps 1`` sets it (see
examples/README.md)::

    python examples/ps_custom_loop.py --steps 600 --save-every 100
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

import mnist_like as common
import tensorflow as tf
import tf_keras as keras
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.loop import make_train_step
from tfelastic.trainer.preemption import Preempted
from tfelastic.trainer.ps import PsTrainLoop, parameter_server_strategy, serve_unless_chief

EXAMPLE = "ps_custom_loop"


def add_ps_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags both parameter-server examples take (a subset of mnist_like's: no collective, no batch policy,
    which only mean something when the workers train in lockstep)."""
    parser.add_argument("--batch-size", type=int, default=64, help="the batch of one step on one worker (64)")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="Adam's learning rate (default 0.002)")
    parser.add_argument("--train-examples", type=int, default=2048, help="generated training examples")
    parser.add_argument("--test-examples", type=int, default=512, help="generated test examples")
    parser.add_argument("--seed", type=int, default=1, help="seed of the data and the initial weights")
    parser.add_argument("--backup-dir", help="checkpoint directory (default: under TFELASTIC_BACKUP_DIR, or "
                                             "./tfelastic-backup/JOB without an agent)")
    parser.add_argument("--summary-file", help="the chief also appends its JSON summary line to this file")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="the chief waits this long after scheduling each step, to stand in for a heavier model")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train (default 300)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default 50)")
    parser.add_argument("--wedge-at-step", type=int, default=0,
                        help="the chief of the first generation hangs, alive, once it scheduled this many steps "
                             "(tests use it: only hang detection catches it)")
    add_ps_arguments(parser)
    return parser.parse_args(argv)


def chief_wedged_in_its_step() -> None:
    """A live hang in the user's own code: the process, its threads and its servers' heartbeats go on."""
    print("wedged", flush=True)
    while True:
        time.sleep(3600)


def train_dataset(data: common.Data, batch_size: int) -> Any:
    """Each worker's own endless shuffled stream: under this strategy workers do not split a global batch."""
    return (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).shuffle(len(data.x_train)).repeat()
            .batch(batch_size, drop_remainder=True).prefetch(2))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    serve_unless_chief()  # ps and worker tasks serve from here on, and never return
    strategy = parameter_server_strategy()
    env = TrainerEnvironment.from_env()
    keras.utils.set_random_seed(args.seed)
    data = common.generate(args.train_examples, args.test_examples, args.seed)
    with strategy.scope():
        model = common.build_cnn()
        optimizer = keras.optimizers.Adam(args.learning_rate)
    loop = PsTrainLoop(strategy, model, optimizer, checkpoint_dir=args.backup_dir or env.backup_path(EXAMPLE),
                       save_every=args.save_every, examples_per_step=args.batch_size)
    restored = loop.restore()
    print(f"starting at step {loop.step}", flush=True)
    fields: dict[str, Any] = {"world_size": env.world_size, "workers": len(env.cluster["worker"]),
                              "ps": len(env.ps), "target_step": args.steps, "initial_step": loop.step,
                              "restored_from": restored.path}

    def per_worker_dataset() -> Any:
        return strategy.distribute_datasets_from_function(lambda context: train_dataset(data, args.batch_size))

    iterator = iter(loop.coordinator.create_per_worker_dataset(per_worker_dataset))
    wedge_after = args.wedge_at_step if env.generation == 1 else 0  # steps this process schedules, then it hangs
    scheduled_here = itertools.count(1)
    train_step = make_train_step(strategy, model, optimizer, common.per_example_loss, args.batch_size)

    def schedule() -> Any:
        scheduled = loop.coordinator.schedule(train_step, args=(iterator,))
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if next(scheduled_here) == wedge_after:
            chief_wedged_in_its_step()
        return scheduled

    try:
        result = loop.run(schedule, args.steps)
    except Preempted as stop:
        common.emit_summary(args, EXAMPLE, preempted=True, final_step=stop.step, checkpoint=loop.last_checkpoint,
                            **fields)
        raise
    assert result.checkpoint is not None  # run() ends with a save
    common.emit_summary(args, EXAMPLE, preempted=False, final_step=result.step, train_loss=result.loss,
                        checkpoint=result.checkpoint, accuracy=common.evaluate_checkpoint(result.checkpoint, data),
                        **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
