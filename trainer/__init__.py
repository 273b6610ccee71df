"""tfelastic.trainer: what runs inside the trainer process.

Importing this package does not import TensorFlow: :mod:`~tfelastic.trainer.progress` (progress reports to the
local agent, for hang detection, ``tfelastic status`` and metrics), :mod:`~tfelastic.trainer.stacks` (the
stack dump the agent asks a hung trainer for), :mod:`~tfelastic.trainer.environment` (what
the agent set), :mod:`~tfelastic.trainer.batching` (batch sizes and learning rate when the world size changes),
:mod:`~tfelastic.trainer.tfkeras` (the tf_keras guard) and :mod:`~tfelastic.trainer.exit_codes` are pure.

The modules that need TensorFlow import it through :mod:`~tfelastic.trainer._tf`, which sets
``TF_USE_LEGACY_KERAS=1`` first: ``strategy`` (``make_strategy``), ``callbacks`` (``fit_callbacks`` for
``model.fit``), ``loop`` (a custom training loop), ``checkpoint``, ``data``, ``preemption`` (the graceful stop,
exit 42) and ``export``. See docs/trainer.md.
"""

from tfelastic.trainer.progress import Phase, ProgressReporter, report
from tfelastic.trainer.stacks import register_stack_dump

register_stack_dump()  # under an agent: where this trainer hangs, if it ever does (trainer/stacks.py)

__all__ = ["Phase", "ProgressReporter", "report"]
