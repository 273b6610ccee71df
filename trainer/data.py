"""Input for a custom loop whose position in the data is restored exactly.

The recipe: the examples of epoch ``e`` come in an order that depends on ``e`` only (a shuffle seeded with a
value derived from ``e``; :func:`shuffled` does that). A checkpoint stores the epoch and how many examples of it
were consumed; on restart :func:`distribute_epoch` rebuilds the epoch, skips those examples, and batches the
rest. Restored this way, a run sees exactly the batches an uninterrupted run would have seen: the same examples
in the same global batches when the global batch is unchanged (``KEEP_GLOBAL``, any world size), and every
example of the epoch exactly once when it changed (``KEEP_PER_REPLICA`` after a resize; the batch boundaries
move).

Each global batch is split between the workers by position (worker ``i`` of ``P`` takes rows
``[i*G/P, (i+1)*G/P)``), not by TensorFlow's auto-sharding, so a global batch is the same set of examples
whatever the world size. The price: every worker reads the whole epoch (like ``AutoShardPolicy.DATA``) and
``skip`` reads the skipped examples once; both are cheap for in-memory arrays and fine for moderate files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tfelastic.trainer._tf import tf
from tfelastic.trainer.batching import check_divisible

ExamplesFn = Callable[[int], Any]  # epoch -> tf.data.Dataset of single examples, deterministic for a given epoch


def shuffled(dataset: Any, epoch: int, seed: int, buffer_size: int) -> Any:
    """``dataset`` shuffled in an order that depends only on ``seed`` and ``epoch``."""
    return dataset.shuffle(buffer_size, seed=_epoch_seed(seed, epoch), reshuffle_each_iteration=False)


def distribute_epoch(strategy: Any, examples: ExamplesFn, *, epoch: int, global_batch: int, skip: int = 0) -> Any:
    """The distributed dataset of epoch ``epoch`` from example ``skip`` on, in global batches of
    ``global_batch`` (a partial last batch is dropped), each replica getting its ``global_batch / replicas``."""
    check_divisible(global_batch, strategy.num_replicas_in_sync)

    def per_worker(context: tf.distribute.InputContext) -> Any:
        check_divisible(global_batch, context.num_input_pipelines)
        share = global_batch // context.num_input_pipelines
        start = share * context.input_pipeline_id
        batches = examples(epoch).skip(skip).batch(global_batch, drop_remainder=True)
        mine = batches.map(lambda *batch: _rows(batch, start, share))
        per_replica = context.get_per_replica_batch_size(global_batch)
        if per_replica != share:  # several replicas on this worker: consecutive slices go to them in order
            mine = mine.unbatch().batch(per_replica, drop_remainder=True)
        return mine.prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(per_worker)


def _rows(batch: tuple[Any, ...], start: int, size: int) -> Any:
    structure = batch[0] if len(batch) == 1 else batch
    return tf.nest.map_structure(lambda t: t[start:start + size], structure)


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch) % (2**31 - 1)
