"""The mnist_like CNN trained by a parameter-server job (ParameterServerStrategy) with ``Model.fit``: one file for
every task. ``serve_unless_chief()`` turns the ps and worker tasks into TensorFlow servers that never return; the
chief compiles the model on the parameter servers and runs ``fit`` on a ``DatasetCreator`` (each worker builds its
own input pipeline) with ``ps_fit_callbacks``: a checkpoint every ``--save-every`` steps (or ``epoch``), resumed at
the batch after it by a restarted chief, progress reports, and the graceful stop (SIGTERM: save, exit 42). The
final checkpoint is evaluated in a model built without any strategy. The last line of the chief's stdout is a JSON
summary.

Needs TF_CONFIG with a chief, ps and workers: ``tfelastic run --strategy parameter-server --ps 1`` sets it (see
examples/README.md)::

    python examples/ps_keras_fit.py --epochs 4 --steps-per-epoch 100 --save-every 50
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import mnist_like as common
import tf_keras as keras
from ps_custom_loop import add_ps_arguments, train_dataset
from tfelastic.trainer.environment import TrainerEnvironment
from tfelastic.trainer.preemption import Preempted
from tfelastic.trainer.ps import PsBackupAndRestore, parameter_server_strategy, ps_fit_callbacks, serve_unless_chief

EXAMPLE = "ps_keras_fit"


def save_interval(value: str) -> int | str:
    return "epoch" if value == "epoch" else int(value)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="steps of an epoch (default 100)")
    parser.add_argument("--save-every", type=save_interval, default=50,
                        help="steps between checkpoints, or 'epoch' (default 50)")
    add_ps_arguments(parser)
    return parser.parse_args(argv)


class StepProbe(keras.callbacks.Callback):  # type: ignore[misc]
    """Prints the step fit resumed at, and waits ``--step-seconds`` after each step is scheduled."""

    def __init__(self, step_seconds: float) -> None:
        super().__init__()
        self.step_seconds = step_seconds
        self.initial_step = 0
        self._supports_tf_logs = True  # a batch-level callback must take RemoteValue logs under this strategy

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_step = int(self.model.optimizer.iterations.numpy())
        print(f"starting at step {self.initial_step}", flush=True)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.step_seconds:
            time.sleep(self.step_seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    serve_unless_chief()  # ps and worker tasks serve from here on, and never return
    strategy = parameter_server_strategy()
    env = TrainerEnvironment.from_env()
    keras.utils.set_random_seed(args.seed)
    data = common.generate(args.train_examples, args.test_examples, args.seed)
    with strategy.scope():
        model = common.build_cnn()
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = ps_fit_callbacks(args.backup_dir or env.backup_path(EXAMPLE), save_every=args.save_every,
                                 global_batch_size=args.batch_size)
    backup = next(c for c in callbacks if isinstance(c, PsBackupAndRestore))
    probe = StepProbe(args.step_seconds)
    target = args.epochs * args.steps_per_epoch
    fields: dict[str, Any] = {"world_size": env.world_size, "workers": len(env.cluster["worker"]),
                              "ps": len(env.ps), "target_step": target}
    dataset = keras.utils.experimental.DatasetCreator(lambda context: train_dataset(data, args.batch_size))
    try:
        history = model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                            callbacks=[*callbacks, probe], verbose=0)
    except Preempted as stop:
        common.emit_summary(args, EXAMPLE, preempted=True, final_step=stop.step, initial_step=probe.initial_step,
                            checkpoint=backup.latest_checkpoint, **fields)
        raise
    checkpoint = backup.latest_checkpoint
    assert checkpoint is not None  # fit ends with a save
    common.emit_summary(args, EXAMPLE, preempted=False, final_step=int(model.optimizer.iterations.numpy()),
                        initial_step=probe.initial_step, train_loss=(history.history.get("loss") or [None])[-1],
                        checkpoint=checkpoint, accuracy=common.evaluate_checkpoint(checkpoint, data), **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
