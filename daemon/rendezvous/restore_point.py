"""The snapshot step a new generation restores: the newest step every member can restore, and, in the log, whose
newer snapshots it does not restore (that work is redone)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

log = logging.getLogger("tfelastic.coordinator")

NEWER_SNAPSHOTS_LOGGED = 10  # members named one by one when their newer snapshots are not restored


def common_restore_step(reported: Iterable[Iterable[int]], shared: Iterable[int] = ()) -> int | None:
    """The snapshot step a generation restores: the newest step that every member reported it can restore (the
    ``restorable_steps`` of its latest Join: its local tier or the shared backup dir), a step in the backup dir
    that any member reported (``shared``) counting as every member's: the backup dir is shared storage, and a
    member that joined before a survivor of a peer's failure wrote its step there did not see it. None when the
    members have no step in common that way (one reported none, and no step is in the backup dir), or when there
    are no members; the trainers then restore their own newest shared checkpoint. A member's steps newer than
    the one chosen are redone."""
    everyone = set(shared)
    common: set[int] | None = None
    for steps in reported:
        mine = everyone.union(steps)
        common = mine if common is None else common.intersection(mine)
        if not common:
            return None
    return max(common) if common else None


def log_restore_step(generation: int, step: int | None, newest: Mapping[str, int]) -> None:
    """Which snapshot ``step`` the new generation restores, and whose newer snapshots it does not (``newest``: each
    member's newest step, -1 for none): the first members one by one, then how many more."""
    if step is not None:
        log.info("generation %d restores step %d (common to all %d members)", generation, step, len(newest))
    else:
        log.info("generation %d: no snapshot step common to all %d members%s", generation, len(newest),
                 "" if any(s >= 0 for s in newest.values()) else " (none reported a snapshot)")
    newer = [(n, s) for n, s in newest.items() if s > (-1 if step is None else step)]
    for node_id, latest in newer[:NEWER_SNAPSHOTS_LOGGED]:
        if step is None:
            log.info("generation %d: node %s has a snapshot of step %d that not every member has; it is not "
                     "restored, its newer work is redone", generation, node_id, latest)
        else:
            log.info("generation %d: node %s has a newer snapshot (step %d) than step %d; its newer work is "
                     "redone", generation, node_id, latest, step)
    if len(newer) > NEWER_SNAPSHOTS_LOGGED:
        log.info("generation %d: %d more members have newer snapshots; their newer work is redone", generation,
                 len(newer) - NEWER_SNAPSHOTS_LOGGED)
