"""The time tfelastic's fit callbacks take inside ``model.fit``, measured in the same run (immune to the
run-to-run noise of this machine, where two runs of the same thing differ by up to 2x in steps/s).

Trains examples/keras_fit's CNN for ``--steps`` with ``fit_callbacks`` (BackupAndRestore, progress reports, the
graceful stop) and a live progress socket and step file, timing every hook of tfelastic's own callbacks (not tf_keras'
BackupAndRestore, which a plain script pays too). The implied steps/s ratio in training is 1 - per-step hook
time / fit time without the one-off hooks (the handler's set-up at the start, the final save at the end); the
whole-fit ratio counts those too.

    .venv/bin/python -m bench.callback_cost [--steps 400]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tfelastic.trainer.progress import reset_step_mark

from bench.trainer_overhead import ProgressSink
from tests.cluster import ROOT

HOOKS = ("on_train_begin", "on_train_batch_begin", "on_train_batch_end", "on_epoch_begin", "on_epoch_end",
         "on_train_end")


def timed(callback: Any, totals: dict[str, float]) -> None:
    """Wrap ``callback``'s hooks so their time adds up in ``totals[class name]``."""
    for hook in HOOKS:
        original = getattr(callback, hook)
        name = f"{type(callback).__name__}.{'per_step' if 'batch' in hook else 'once'}"
        totals.setdefault(name, 0.0)

        @functools.wraps(original)
        def wrapper(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - started

        setattr(callback, hook, wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    sink = ProgressSink(str(work / "progress.sock"))
    step_file = str(work / "step")  # as an agent sets it: every batch's step is marked there
    reset_step_mark(step_file)
    os.environ.update(TFELASTIC_PROGRESS_SOCKET=sink.path, TFELASTIC_STEP_FILE=step_file, TFELASTIC_GENERATION="1")
    sys.path.insert(0, str(ROOT / "examples"))
    import mnist_like as common  # type: ignore[import-not-found]
    import tensorflow as tf
    import tf_keras as keras
    from tfelastic.trainer.callbacks import fit_callbacks

    common.seed_everything(1)
    data = common.generate(4096, 256, 1)
    train = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).shuffle(4096, seed=1).repeat()
             .batch(64, drop_remainder=True))
    model = common.build_cnn()
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = fit_callbacks(str(work / "backup"), save_every=100, global_batch_size=64)
    totals: dict[str, float] = {}
    for callback in callbacks[1:]:  # [0] is tf_keras' BackupAndRestore
        timed(callback, totals)
    started = time.perf_counter()
    model.fit(train, epochs=1, steps_per_epoch=args.steps, callbacks=callbacks, verbose=0)
    fit_seconds = time.perf_counter() - started
    per_step = sum(v for k, v in totals.items() if k.endswith("per_step"))
    once = sum(v for k, v in totals.items() if k.endswith("once"))
    print(json.dumps({"steps": args.steps, "fit_seconds": round(fit_seconds, 3),
                      "step_ms": round(1e3 * (fit_seconds - once) / args.steps, 2),
                      "hook_seconds": {k: round(v, 4) for k, v in totals.items()},
                      "per_step_hook_us": round(1e6 * per_step / args.steps, 1),
                      "once_seconds (setup, final save)": round(once, 3),
                      "implied_ratio_per_step": round(1 - per_step / (fit_seconds - once), 5),
                      "implied_ratio_whole_fit": round(1 - (per_step + once) / fit_seconds, 5),
                      "progress_reports": sink.received}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
