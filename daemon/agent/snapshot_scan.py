"""The node's side of the fast checkpoint tier (trainer/snapshots.py): the snapshot steps it can restore, which
every Join reports, and the removal of its local tier once the job succeeded. The agent shell owns one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil

from tfelastic.daemon.agent.api import RestorableSteps
from tfelastic.trainer import snapshots

log = logging.getLogger("tfelastic.agent")

SCAN_SECONDS = 5.0  # reading the restorable snapshot steps; longer (a hung mount): the Join reports none


class SnapshotScan:
    def __init__(self, local_tier: str | None, backup_dir: str) -> None:
        self.local_tier = local_tier  # this node's tier of the job (ROOT/JOB/NODE); None: the tier is off
        self._tiers = [t for t in (local_tier, backup_dir) if t]  # the backup dir last: _read_steps
        self._scanning: asyncio.Future[RestorableSteps] | None = None  # the last read

    async def restorable(self) -> RestorableSteps:
        """The steps of the complete snapshots in the local tier and the backup dir, newest first, and those in the
        backup dir. Read off the loop, and bounded: the backup dir is on a shared file system. Empty after a
        timeout, and while an earlier read still hangs."""
        tiers = self._tiers
        steps = RestorableSteps()
        if self._scanning is not None and not self._scanning.done():  # one thread hangs already: not another
            log.debug("the last read of the snapshots has not returned: this Join reports none")
        else:
            self._scanning = asyncio.ensure_future(asyncio.to_thread(_read_steps, tiers))
            self._scanning.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if it ends late
            try:
                steps = await asyncio.wait_for(asyncio.shield(self._scanning), SCAN_SECONDS)
            except asyncio.TimeoutError:
                log.warning("reading the snapshots in %s took longer than %gs (a hung mount?): this Join reports "
                            "none", " and ".join(tiers), SCAN_SECONDS)
            except Exception as e:  # a bug here must not keep the node out of the job: it just reports no step
                log.warning("cannot read the snapshots in %s: %s: %s", " and ".join(tiers), type(e).__name__, e)
        log.debug("snapshot steps this node can restore: %s (in the backup dir: %s)",
                  ", ".join(map(str, steps.steps)) or "none", ", ".join(map(str, steps.shared)) or "none")
        return steps

    def remove_local_tier(self) -> None:
        """After the job succeeded: this node's local snapshots of it (after a failure or a drain they stay, so a
        restarted job resumes from them)."""
        tier = self.local_tier
        if tier is None or not os.path.isdir(tier):
            return
        shutil.rmtree(tier, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(tier))  # the job's directory, once no other node on this host has one there
        if os.path.exists(tier):
            log.warning("the job succeeded; could not remove all of this node's local snapshots in %s", tier)
        else:
            log.info("the job succeeded: removed this node's local snapshots (%s)", tier)


def _read_steps(tiers: list[str]) -> RestorableSteps:
    """What SnapshotScan.restorable reports, read from ``tiers`` (the backup dir last)."""
    per_tier = [snapshots.restorable_steps([tier]) for tier in tiers]
    steps = sorted(set().union(*per_tier), reverse=True)[:snapshots.MAX_REPORTED]
    return RestorableSteps(tuple(steps), tuple(per_tier[-1]) if per_tier else ())
