"""Errors that end a tfelastic process with a message for its user, never with a traceback."""

from __future__ import annotations


class ConfigError(Exception):
    """A value the user gave cannot work. The message names the option and the fix; the process exits 78
    (:data:`tfelastic.daemon.exit_codes.EX_CONFIG`) before anything starts."""
