"""tfelastic.trainer: what runs inside the trainer process.

Importing this package does not import TensorFlow. :mod:`tfelastic.trainer.progress` reports training progress
to the local agent, which uses it for hang detection, ``tfelastic status`` and metrics.
"""

from tfelastic.trainer.progress import ProgressReporter, report

__all__ = ["ProgressReporter", "report"]
