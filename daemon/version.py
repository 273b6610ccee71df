"""tfelastic's version, and the version of the protocol between agents and coordinators.

The protocol's version changes only when a message changes in a way an older peer would misread; fields added
to a message do not change it (protobuf ignores fields it does not know, and their defaults mean "not said"). A
coordinator takes agents of every protocol from :data:`OLDEST_PROTOCOL` to :data:`PROTOCOL`; so does a rolling
upgrade between two releases whose protocols it lists (docs/operations.md, "Upgrades").
"""

from __future__ import annotations

VERSION = "0.3.0"  # also the package's (pyproject.toml reads it from here)
PROTOCOL = 1
OLDEST_PROTOCOL = 1  # an agent older than the field says 0, which is protocol 1


def describe() -> str:
    return f"tfelastic {VERSION} (protocol {PROTOCOL})"


def protocol_of(said: int) -> int:
    """A peer's protocol: what it says, or 1 for one older than the field."""
    return said or 1


def speaks(protocol: int) -> bool:
    return OLDEST_PROTOCOL <= protocol_of(protocol) <= PROTOCOL
