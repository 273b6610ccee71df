"""Batch sizes and learning rate when the number of replicas changes (known only at start). Pure: no TensorFlow.

``KEEP_GLOBAL``: the global batch stays; each replica gets ``global / replicas`` (it must divide every replica count
the job may run with), so the optimisation is the same whatever the world size. ``KEEP_PER_REPLICA``: each replica
keeps its batch, the global batch grows with the world, and the learning rate scales linearly,
``lr * replicas / reference_replicas`` (Goyal et al., 2017). :func:`plan_batches` applies a policy;
:func:`epoch_steps` turns an epoch position into a step count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BatchPolicy(enum.Enum):
    KEEP_GLOBAL = "keep-global"
    KEEP_PER_REPLICA = "keep-per-replica"

    @classmethod
    def parse(cls, value: str | BatchPolicy) -> BatchPolicy:
        if isinstance(value, BatchPolicy):
            return value
        normalized = value.strip().lower().replace("_", "-")
        for policy in cls:
            if policy.value == normalized:
                return policy
        raise BatchError(f"batch policy {value!r} is not one of {', '.join(p.value for p in cls)}")


class BatchError(ValueError):
    """A batch configuration that cannot work; the message names the values and the fix."""


@dataclass(frozen=True)
class BatchPlan:
    policy: BatchPolicy
    replicas: int
    global_batch: int
    per_replica_batch: int
    learning_rate: float

    def as_dict(self) -> dict[str, float | int | str]:
        return {"batch_policy": self.policy.value, "replicas": self.replicas, "global_batch": self.global_batch,
                "per_replica_batch": self.per_replica_batch, "learning_rate": self.learning_rate}


def plan_batches(replicas: int, policy: BatchPolicy | str = BatchPolicy.KEEP_GLOBAL, *,
                 global_batch: int | None = None, per_replica_batch: int | None = None,
                 learning_rate: float, reference_replicas: int = 1) -> BatchPlan:
    """The batch sizes and learning rate for ``replicas`` replicas.

    Give exactly one of ``global_batch`` and ``per_replica_batch``: it is the size configured for
    ``reference_replicas`` replicas (the other follows from it there), and ``learning_rate`` is the rate tuned
    for that configuration. Raises :class:`BatchError` naming the values when they cannot work.
    """
    policy = BatchPolicy.parse(policy)
    _positive("replicas", replicas)
    _positive("reference_replicas", reference_replicas)
    if not learning_rate > 0:
        raise BatchError(f"learning_rate={learning_rate!r} must be a positive number")
    reference_global = _reference_global(global_batch, per_replica_batch, reference_replicas)
    if policy is BatchPolicy.KEEP_GLOBAL:
        check_divisible(reference_global, replicas)
        return BatchPlan(policy, replicas, reference_global, reference_global // replicas, learning_rate)
    check_divisible(reference_global, reference_replicas)
    per_replica = reference_global // reference_replicas
    scaled = learning_rate * replicas / reference_replicas
    return BatchPlan(policy, replicas, per_replica * replicas, per_replica, scaled)


def check_divisible(global_batch: int, replicas: int) -> None:
    """Raises :class:`BatchError` unless ``global_batch`` splits evenly over ``replicas`` replicas."""
    _positive("global_batch", global_batch)
    _positive("replicas", replicas)
    if global_batch % replicas:
        below = global_batch - global_batch % replicas
        options = f"{below} or {below + replicas}" if below else f"{replicas}"
        raise BatchError(
            f"global batch {global_batch} is not divisible by {replicas} replicas: every replica must get the same "
            f"number of examples. Choose a global batch that is a multiple of {replicas} (e.g. {options}), or a "
            f"multiple of every replica count the job may run with, or use the keep-per-replica policy")


def epoch_steps(examples_per_epoch: int, global_batch: int, examples_done: int = 0) -> int:
    """Full global batches left in an epoch after ``examples_done`` of its examples were consumed (a partial
    last batch is dropped: every replica must get a full batch)."""
    _positive("examples_per_epoch", examples_per_epoch)
    _positive("global_batch", global_batch)
    if not 0 <= examples_done <= examples_per_epoch:
        raise BatchError(f"examples_done={examples_done} is outside the epoch of {examples_per_epoch} examples")
    return (examples_per_epoch - examples_done) // global_batch


def _reference_global(global_batch: int | None, per_replica_batch: int | None, reference_replicas: int) -> int:
    if (global_batch is None) == (per_replica_batch is None):
        raise BatchError("give exactly one of global_batch and per_replica_batch "
                         f"(got global_batch={global_batch}, per_replica_batch={per_replica_batch})")
    if global_batch is not None:
        _positive("global_batch", global_batch)
        return global_batch
    assert per_replica_batch is not None
    _positive("per_replica_batch", per_replica_batch)
    return per_replica_batch * reference_replicas


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BatchError(f"{name}={value!r} must be a positive integer")
