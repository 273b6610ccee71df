"""The agent's half of the automatic instrumentation: what to add to a trainer's environment.

With instrumentation on, the directory that holds tfelastic's ``sitecustomize`` goes first on ``PYTHONPATH``,
so every Python program of the worker reports ``model.fit`` progress by itself (see
tfelastic.trainer.instrument). The rest of ``PYTHONPATH`` is kept as it was, empty entries (the working
directory) included. With it off, ``TFELASTIC_INSTRUMENT=0`` is set as well, so that a ``PYTHONPATH`` inherited
with the directory already on it (an agent started from an instrumented trainer) is switched off too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tfelastic.trainer.instrument import ENABLE_ENV, SITE_DIR, enabled


def instrumentation_env(env: Mapping[str, str], instrument: bool) -> dict[str, str]:
    """The variables to set on top of ``env`` (the trainer's environment so far); ``{}`` when nothing changes.

    ``instrument`` is the agent's setting; ``TFELASTIC_INSTRUMENT=0`` in ``env`` (from the agent's environment
    or ``job.env``) switches it off as well.
    """
    if not instrument:
        return {ENABLE_ENV: "0"}
    if not enabled(env):
        return {}
    path = env.get("PYTHONPATH", "")
    if SITE_DIR in path.split(os.pathsep):
        return {}
    return {"PYTHONPATH": SITE_DIR + os.pathsep + path if path else SITE_DIR}
