"""The distribution strategy, built from what the agent set.

:func:`make_strategy` returns a ``MultiWorkerMirroredStrategy``: across the workers of ``TF_CONFIG`` under the
agent, and a single worker over the local devices without ``TF_CONFIG`` (TensorFlow's own rule), so one script
runs both ways with the same checkpoints. It checks that tf_keras will run (not Keras 3), picks the collective
implementation, and installs the SIGTERM handling of :mod:`tfelastic.trainer.preemption` (MWMS installs a C++
SIGTERM handler that only records the signal; ours replaces it).
"""

from __future__ import annotations

from typing import Any

from tfelastic.trainer._tf import tf
from tfelastic.trainer.environment import TrainerEnvironment, parse_collective
from tfelastic.trainer.preemption import STOP
from tfelastic.trainer.tfkeras import check_keras


def make_strategy(collective: str | None = None) -> Any:
    """``collective``: AUTO, RING or NCCL (default: ``TFELASTIC_COLLECTIVE``, else AUTO: NCCL on GPUs)."""
    check_keras()
    TrainerEnvironment.from_env()  # fails early, naming the variable, on a bad TF_CONFIG or TFELASTIC_* value
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, parse_collective(collective))
    options = tf.distribute.experimental.CommunicationOptions(implementation=implementation)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    STOP.install()
    return strategy


def is_chief(strategy: Any) -> bool:
    """Whether this worker writes what is shared (checkpoints, TensorBoard, the exported model)."""
    return bool(strategy.extended.should_checkpoint)

