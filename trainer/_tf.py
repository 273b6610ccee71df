"""TensorFlow and tf_keras for the trainer library's modules, which import them from here and never directly.

Invariant: ``TF_USE_LEGACY_KERAS=1`` is set (unless the environment says otherwise) before TensorFlow is first
imported, because TensorFlow picks the Keras behind ``tf.keras`` once, at its import; then
:func:`~tfelastic.trainer.tfkeras.ensure_legacy_keras` raises :class:`~tfelastic.trainer.tfkeras.KerasVersionError`
if ``tf.keras`` is Keras 3 anyway. Importing TensorFlow this way imports tf_keras and the protobuf modules below
too, so re-exporting them costs nothing more.
"""

from tfelastic.trainer.tfkeras import ensure_legacy_keras

ensure_legacy_keras()

import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402
from tensorflow.core.protobuf import trackable_object_graph_pb2  # noqa: E402
from tensorflow.python.eager import context as eager_context  # noqa: E402
from tf_keras.src.distribute.worker_training_state import WorkerTrainingState  # noqa: E402


def _leave_tf_keras_unconverted() -> None:
    """TensorFlow 2.16 lets AutoGraph convert tf_keras' own training code, which 2.21 lists among the modules not
    to convert: a small model's first batch came 20.1 s after ``fit`` started with 2.16 as it is, 0.4 s with this
    rule (2 cores). Adds the rule where it is missing."""
    from tensorflow.python.autograph.core import config

    rules = config.CONVERSION_RULES
    if not any(isinstance(rule, config.DoNotConvert) and rule.matches("tf_keras") for rule in rules):
        config.CONVERSION_RULES = (*rules, config.DoNotConvert("tf_keras"))


_leave_tf_keras_unconverted()

__all__ = ["WorkerTrainingState", "eager_context", "keras", "tf", "trackable_object_graph_pb2"]
