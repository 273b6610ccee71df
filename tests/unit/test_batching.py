"""The batch policy when the replica count changes (pure code, no TensorFlow)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tfelastic.trainer.batching import BatchError, BatchPolicy, check_divisible, epoch_steps, plan_batches


def test_keep_global_splits_the_global_batch_and_keeps_the_learning_rate() -> None:
    plan = plan_batches(4, BatchPolicy.KEEP_GLOBAL, global_batch=256, learning_rate=0.1)
    assert (plan.global_batch, plan.per_replica_batch, plan.learning_rate) == (256, 64, 0.1)


def test_keep_global_from_a_per_replica_batch_fixes_the_global_batch_at_the_reference_count() -> None:
    plan = plan_batches(4, "keep-global", per_replica_batch=32, reference_replicas=2, learning_rate=0.1)
    assert (plan.global_batch, plan.per_replica_batch) == (64, 16)


def test_keep_per_replica_grows_the_global_batch_and_scales_the_learning_rate_linearly() -> None:
    plan = plan_batches(6, BatchPolicy.KEEP_PER_REPLICA, per_replica_batch=32, reference_replicas=2,
                        learning_rate=0.01)
    assert (plan.global_batch, plan.per_replica_batch) == (192, 32)
    assert plan.learning_rate == pytest.approx(0.03)


def test_keep_per_replica_from_a_global_batch_divides_it_at_the_reference_count() -> None:
    plan = plan_batches(1, "keep_per_replica", global_batch=128, reference_replicas=4, learning_rate=0.4)
    assert (plan.global_batch, plan.per_replica_batch) == (32, 32)
    assert plan.learning_rate == pytest.approx(0.1)


def test_a_global_batch_that_does_not_split_names_the_values_and_the_fixes() -> None:
    with pytest.raises(BatchError) as caught:
        plan_batches(3, BatchPolicy.KEEP_GLOBAL, global_batch=100, learning_rate=0.1)
    message = str(caught.value)
    assert "global batch 100 is not divisible by 3 replicas" in message
    assert "99 or 102" in message and "keep-per-replica" in message


def test_a_global_batch_smaller_than_the_replica_count_suggests_the_count() -> None:
    with pytest.raises(BatchError, match=r"multiple of 8 \(e.g. 8\)"):
        check_divisible(4, 8)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"global_batch": 64, "per_replica_batch": 32}, "exactly one of global_batch and per_replica_batch"),
    ({}, "exactly one of global_batch and per_replica_batch"),
    ({"global_batch": 0}, "global_batch=0 must be a positive integer"),
    ({"per_replica_batch": -1}, "per_replica_batch=-1 must be a positive integer"),
    ({"global_batch": 64, "reference_replicas": 0}, "reference_replicas=0"),
])
def test_bad_batch_arguments_are_named(kwargs: dict[str, int], fragment: str) -> None:
    with pytest.raises(BatchError, match=re.escape(fragment)):
        plan_batches(2, "keep-global", learning_rate=0.1, **kwargs)


def test_bad_replica_count_learning_rate_and_policy_are_named() -> None:
    with pytest.raises(BatchError, match="replicas=0"):
        plan_batches(0, global_batch=8, learning_rate=0.1)
    with pytest.raises(BatchError, match="learning_rate=0"):
        plan_batches(2, global_batch=8, learning_rate=0)
    with pytest.raises(BatchError, match="'keep-both' is not one of keep-global, keep-per-replica"):
        BatchPolicy.parse("keep-both")


def test_epoch_steps_counts_full_batches_left() -> None:
    assert epoch_steps(1000, 64) == 15
    assert epoch_steps(1000, 64, examples_done=960) == 0
    assert epoch_steps(1000, 96, examples_done=128) == 9  # after a resize: the batch boundaries moved
    with pytest.raises(BatchError, match="examples_done=1001 is outside the epoch of 1000 examples"):
        epoch_steps(1000, 64, examples_done=1001)


@given(replicas=st.integers(1, 64), per_replica=st.integers(1, 512), reference=st.integers(1, 64),
       learning_rate=st.floats(1e-6, 10.0))
def test_keep_per_replica_keeps_the_learning_rate_per_example_constant(
        replicas: int, per_replica: int, reference: int, learning_rate: float) -> None:
    plan = plan_batches(replicas, BatchPolicy.KEEP_PER_REPLICA, per_replica_batch=per_replica,
                        reference_replicas=reference, learning_rate=learning_rate)
    assert plan.global_batch == plan.per_replica_batch * replicas
    assert plan.per_replica_batch == per_replica
    reference_global = per_replica * reference
    assert plan.learning_rate / plan.global_batch == pytest.approx(learning_rate / reference_global)


@given(replicas=st.integers(1, 64), global_batch=st.integers(1, 4096))
def test_keep_global_either_splits_evenly_or_refuses(replicas: int, global_batch: int) -> None:
    try:
        plan = plan_batches(replicas, BatchPolicy.KEEP_GLOBAL, global_batch=global_batch, learning_rate=1.0)
    except BatchError:
        assert global_batch % replicas != 0
        return
    assert plan.global_batch == global_batch == plan.per_replica_batch * replicas
    assert plan.learning_rate == 1.0
