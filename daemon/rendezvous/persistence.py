"""Write-ahead of the job's state, for a coordinator that another can replace (etcd).

Every change of the job's state is written (one write per change; progress reports and heartbeats are not
changes). Orders that commit the job to something a successor could not know, a new generation's assignments and
the verdict, go out only once the state that names them is written: a coordinator that dies after sending them
leaves a successor that knows them. Other orders (a stop, a waiting notice) are always safe and go at once, unless
earlier orders still wait, so that every agent sees its orders in order.

While the store does not answer (etcd without quorum), held orders wait and the write is retried: the running
generation trains on, and a failure waits for quorum. A write that finds another leader deposes this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.rendezvous.durable import Deposed, DurableState, JobStore, StoreUnavailable
from tfelastic.daemon.rendezvous.state import Clock, Rendezvous

log = logging.getLogger("tfelastic.coordinator")
RETRY_SECONDS = 0.5


def _commits(send: api.Send) -> bool:
    return isinstance(send.order, (api.Assignment, api.Finished))


def _significant(state: DurableState) -> DurableState:
    """Without what moves with every progress report: those alone are no reason to write."""
    return dataclasses.replace(state, reached_step=-1, checkpoint_step=-1)


class Persistence:
    def __init__(self, store: JobStore, rendezvous: Rendezvous, clock: Clock,
                 deliver: Callable[[Sequence[api.Send]], None], wall_clock: Clock = time.time) -> None:
        self._store, self._rendezvous = store, rendezvous
        # Fixed for the term: recomputed per write, the float noise of the subtraction alone changed the failure
        # times written, and every progress report looked like a change of state.
        self._wall_offset = wall_clock() - clock()
        self._deliver = deliver
        self._held: deque[tuple[int, Sequence[api.Send]]] = deque()
        self._version = 0  # changes so far
        self._recorded = 0  # the changes up to this one are written (or were not worth a write)
        self._saved: DurableState | None = None
        self._changed = asyncio.Event()
        self.problem = ""  # why the last write failed, while it is retried
        self.deposed = asyncio.Event()

    def dispatch(self, sends: Sequence[api.Send]) -> None:
        """Delivers ``sends`` now, or once the state that carries them is written."""
        self._version += 1
        self._changed.set()
        if self._held or any(_commits(send) for send in sends):
            self._held.append((self._version, sends))
        else:
            self._deliver(sends)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @property
    def holding_assignments(self) -> bool:
        """A formed generation waits to be written before it may start."""
        return any(isinstance(send.order, api.Assignment) for _, sends in self._held for send in sends)

    async def flush(self, timeout: float) -> None:
        """Before a leader steps down on purpose: until every change so far is written and the orders it holds
        are delivered (or it is deposed, or ``timeout``). A successor that took over a generation whose members
        were never told of it would count each of them lost, for no fault."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (self._held or self._recorded < self._version) and not self.deposed.is_set() and \
                asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def run(self) -> None:
        """Writes every change; returns when deposed."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            version = self._version
            state = self._rendezvous.durable(self._wall_offset)
            if _significant(state) == self._saved and not self._held:
                self._recorded = version
                continue
            if not await self._write(state):
                return
            self._recorded = version
            while self._held and self._held[0][0] <= version:
                self._deliver(self._held.popleft()[1])

    async def _write(self, state: DurableState) -> bool:
        while True:
            try:
                await self._store.save(state)
            except Deposed as e:
                log.error("%s: stepping down", e)
                self.deposed.set()
                return False
            except StoreUnavailable as e:
                if not self.problem:
                    log.warning("cannot record the job's state in etcd (%s); retrying: the running generation "
                                "trains on, and no new one forms until etcd answers", e)
                self.problem = str(e)
                await asyncio.sleep(RETRY_SECONDS)
                state = self._rendezvous.durable(self._wall_offset)
                continue
            if self.problem:
                log.info("the job's state is recorded in etcd again")
            self.problem = ""
            self._saved = _significant(state)
            return True
