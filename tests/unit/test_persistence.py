"""The coordinator's write-ahead of the job's state (rendezvous/persistence.py), over an in-memory store that plays
etcd's three answers: written, unavailable (no quorum), refused (another leader). Real etcd: tests/integration."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Sequence

import pytest
from tfelastic.daemon.rendezvous import persistence
from tfelastic.daemon.rendezvous.api import (
    Assignment,
    JobState,
    Join,
    RestartReason,
    Send,
    StopWorkers,
    WorkerProgress,
)
from tfelastic.daemon.rendezvous.cluster_status import while_unrecorded
from tfelastic.daemon.rendezvous.durable import Deposed, DurableState, StoreUnavailable, Takeover
from tfelastic.daemon.rendezvous.host import create_server
from tfelastic.daemon.rendezvous.persistence import Persistence
from tfelastic.daemon.rendezvous.server import RendezvousServicer, _Session
from tfelastic.daemon.rpc import rendezvous_pb2 as pb

from tests.fakes import FakeClock
from tests.unit.test_rendezvous_state import SETTINGS, SPEC, info, rejoin_all, running


class InMemoryStore:
    def __init__(self) -> None:
        self.saved: list[DurableState] = []
        self.unavailable = False
        self.other_leader = False

    async def save(self, state: DurableState) -> None:
        if self.other_leader:
            raise Deposed("another coordinator leads the job")
        if self.unavailable:
            raise StoreUnavailable("no quorum")
        self.saved.append(state)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def kinds(delivered: list[Sequence[Send]]) -> list[str]:
    return [type(send.order).__name__ for sends in delivered for send in sends]


async def failure_then_rejoin(store: InMemoryStore) -> tuple[Persistence, list[Sequence[Send]]]:
    """A running job whose worker fails: the stops are dispatched, then the next generation's assignments."""
    rv = running(FakeClock(), ["a", "b"], max_nodes=2)
    delivered: list[Sequence[Send]] = []
    writer = Persistence(store, rv, FakeClock(), delivered.append)
    asyncio.get_running_loop().create_task(writer.run())
    writer.dispatch(rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1"))
    writer.dispatch(rejoin_all(rv, "a", "b"))
    await settle()
    return writer, delivered


@pytest.fixture(autouse=True)
def _no_retry_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(persistence, "RETRY_SECONDS", 0.0)


def test_stops_go_at_once_and_assignments_once_the_state_naming_them_is_written() -> None:
    async def scenario() -> None:
        store = InMemoryStore()
        writer, delivered = await failure_then_rejoin(store)
        assert kinds(delivered) == ["StopWorkers", "StopWorkers", "Assignment", "Assignment"]
        assert store.saved[-1].generation == 2 and not writer.problem

    asyncio.run(scenario())


def test_without_quorum_the_stops_go_out_but_the_next_generation_waits_and_says_why() -> None:
    async def scenario() -> None:
        store = InMemoryStore()
        store.unavailable = True
        writer, delivered = await failure_then_rejoin(store)
        assert kinds(delivered) == ["StopWorkers", "StopWorkers"]  # stopping is always safe
        assert writer.problem == "no quorum" and writer.holding_assignments
        store.unavailable = False  # quorum back
        await settle()
        assert kinds(delivered) == ["StopWorkers", "StopWorkers", "Assignment", "Assignment"]
        assert not writer.problem and not writer.holding
        assert store.saved[-1].generation == 2

    asyncio.run(scenario())


def test_a_refused_write_deposes_the_coordinator_and_nothing_it_held_goes_out() -> None:
    async def scenario() -> None:
        store = InMemoryStore()
        store.other_leader = True
        writer, delivered = await failure_then_rejoin(store)
        assert writer.deposed.is_set()
        assert all(isinstance(send.order, StopWorkers) for sends in delivered for send in sends)
        assert not any(isinstance(send.order, Assignment) for sends in delivered for send in sends)

    asyncio.run(scenario())


def test_progress_after_a_failure_writes_nothing_even_as_the_wall_clock_moves() -> None:
    """Only changes of state are written: the failure times must not be re-derived (and jitter) per write. The
    chief's first report sets where the generation resumed, and its next step ends the start-up, in the goodput
    ledger: those two changes are written once each, and the 17 reports after them nothing."""
    async def scenario() -> None:
        store = InMemoryStore()
        clock = FakeClock()
        rv = running(clock, ["a", "b"], max_nodes=2)
        ticks = iter(range(10_000))
        writer = Persistence(store, rv, clock, lambda sends: None, wall_clock=lambda: 1e9 + next(ticks) * 1e-7)
        asyncio.get_running_loop().create_task(writer.run())
        writer.dispatch(rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1"))
        writer.dispatch(rejoin_all(rv, "a", "b"))
        await settle()
        saved = len(store.saved)
        for step in range(1, 20):
            clock.now += 0.5
            rv.progress("a", 2, WorkerProgress(step=step))
            writer.dispatch([])
            await settle()
        assert len(store.saved) == saved + 2
        assert store.saved[-2].goodput is not None and store.saved[-2].goodput["activity"] == "startup"
        assert store.saved[-2].goodput["lines"][-1]["restored_step"] == 1
        assert store.saved[-1].goodput is not None and store.saved[-1].goodput["activity"] == "training"

    asyncio.run(scenario())


def test_a_coordinator_that_takes_over_a_finished_job_is_finished_at_once() -> None:
    """Nothing would ever deliver an order to set it: a standby that took over after the verdict must still end."""
    async def scenario() -> None:
        rv = running(FakeClock(), ["a", "b"], max_nodes=2)
        rv.worker_succeeded("a", 1)
        rv.worker_succeeded("b", 1)
        recorded = rv.durable(wall_offset=0.0)
        assert recorded.state is JobState.SUCCEEDED
        host = await create_server("127.0.0.1:0", SETTINGS, store=InMemoryStore(), takeover=Takeover(recorded))
        try:
            assert host.finished.is_set()
        finally:
            await host.close()

    asyncio.run(scenario())


class SlowStore(InMemoryStore):
    """etcd answering a write only when the test lets it."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def save(self, state: DurableState) -> None:
        await self.answer.wait()
        await super().save(state)


def test_a_leader_stepping_down_first_delivers_the_generation_it_recorded() -> None:
    """A drained leader that formed a generation must not leave before its members hear of it: its successor
    would count each of them lost (the chaos soak found it)."""
    async def scenario() -> None:
        store = SlowStore()
        writer, delivered = await failure_then_rejoin(store)
        assert kinds(delivered) == ["StopWorkers", "StopWorkers"] and writer.holding_assignments
        flushing = asyncio.get_running_loop().create_task(writer.flush(timeout=5.0))
        await settle()
        assert not flushing.done()  # it waits for the write...
        store.answer.set()
        await asyncio.wait_for(flushing, 1.0)
        assert kinds(delivered) == ["StopWorkers", "StopWorkers", "Assignment", "Assignment"]  # ...and delivers

    asyncio.run(scenario())


def test_a_flush_gives_up_after_its_timeout() -> None:
    async def scenario() -> None:
        writer, delivered = await failure_then_rejoin(SlowStore())
        await asyncio.wait_for(writer.flush(timeout=0.05), 1.0)
        assert writer.holding_assignments  # etcd never answered: nothing went out, and the leader may leave
        assert kinds(delivered) == ["StopWorkers", "StopWorkers"]

    asyncio.run(scenario())


def test_a_flush_waits_for_a_write_under_way_even_with_no_order_held() -> None:
    """A stop goes out at once, but the state that records it is still being written: a successor that took over
    before that write would run the stopped generation on."""
    async def scenario() -> None:
        store = SlowStore()
        rv = running(FakeClock(), ["a", "b"], max_nodes=2)
        writer = Persistence(store, rv, FakeClock(), lambda sends: None)
        asyncio.get_running_loop().create_task(writer.run())
        writer.dispatch(rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1"))
        await settle()
        assert not writer.holding
        flushing = asyncio.get_running_loop().create_task(writer.flush(timeout=5.0))
        await settle()
        assert not flushing.done()
        store.answer.set()
        await asyncio.wait_for(flushing, 1.0)
        assert store.saved[-1].generation == 1 and store.saved[-1].state is not JobState.RUNNING

    asyncio.run(scenario())


def test_a_coordinator_that_handed_the_job_over_decides_nothing_more() -> None:
    """The chaos soak found it: a drained leader flushed, then its members' Joins formed one more generation; etcd
    recorded it, the sessions closed before any member heard of it, and the successor counted a member lost."""
    async def scenario() -> None:
        clock = FakeClock()
        rv = running(clock, ["a", "b"], max_nodes=2)
        store = InMemoryStore()
        servicer = RendezvousServicer(rv, clock, 0.5, store=store)
        servicer.start()
        sessions = {node: _Session(peer=node, node_id=node) for node in "ab"}
        servicer._sessions.update(sessions)
        servicer._dispatch(rv.worker_failed("a", 1, RestartReason.WORKER_EXIT, "exit 1"))
        assert servicer.persistence is not None
        await servicer.persistence.flush(timeout=1.0)
        servicer.stop_deciding()
        written = len(store.saved)
        for node, session in sessions.items():  # the two rejoins that would form generation 2
            join = Join(info(node, last_generation=1), rv.spec or SPEC)
            servicer._handle(session, join)
        servicer._end(sessions["a"])
        await settle()
        assert rv.generation == 1 and len(store.saved) == written
        queued = [session.outbox.get_nowait() for session in sessions.values()
                  for _ in range(session.outbox.qsize())]
        assert not any(isinstance(item, pb.CoordinatorMessage) and item.HasField("assignment") for item in queued)
        await servicer.stop()

    asyncio.run(scenario())


class BrokenStore(InMemoryStore):
    """A store whose write fails with what no store should raise: a bug, not an etcd answer."""

    async def save(self, state: DurableState) -> None:
        raise ValueError("Value out of range: 1208925819614629174706177")


def test_a_write_that_fails_with_a_bug_deposes_the_coordinator_and_its_server_still_closes() -> None:
    """The failed write ended the persistence task; closing the coordinator re-raised its error, so its gRPC
    server was never stopped (a `RuntimeError: Event loop is closed` traceback at exit, when the server's
    finalizer ran after the loop) and the candidate that served it died with it, never to campaign again."""
    async def scenario() -> None:
        host = await create_server("127.0.0.1:0", SETTINGS, store=BrokenStore())
        persistence = host._servicer.persistence
        assert persistence is not None
        persistence.dispatch([])  # a change of state: the write fails
        await asyncio.wait_for(persistence.deposed.wait(), 10)
        await host.close()  # does not raise the write's error
        with pytest.raises(OSError):  # the gRPC server is stopped: nothing listens on its port any more
            socket.create_connection(("127.0.0.1", host.port), timeout=2).close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("problem", "holding", "holding_assignments", "state", "reason"), [
    ("", False, False, JobState.RUNNING, "scaled"),  # recorded: the job as it is
    ("no quorum", False, False, JobState.RUNNING, "scaled"),  # etcd failing, but nothing waits for it
    ("no quorum", True, False, JobState.RUNNING, "scaled; waiting for etcd to record the job's state (no quorum)"),
    ("no quorum", True, True, JobState.WAITING,
     "generation 3 formed; waiting for etcd to record the job's state (no quorum)"),  # no worker may start yet
])
def test_status_says_what_waits_for_etcd(problem: str, holding: bool, holding_assignments: bool,
                                         state: JobState, reason: str) -> None:
    snap = dataclasses.replace(running(FakeClock(), ["a", "b"], max_nodes=2).status(), generation=3,
                               reason="scaled")
    shown = while_unrecorded(snap, problem, holding=holding, holding_assignments=holding_assignments)
    assert (shown.state, shown.reason) == (state, reason)
    assert dataclasses.replace(shown, state=snap.state, reason=snap.reason) == snap  # nothing else changes


def test_without_a_reason_status_says_only_what_waits() -> None:
    snap = dataclasses.replace(running(FakeClock(), ["a", "b"], max_nodes=2).status(), reason="")
    shown = while_unrecorded(snap, "etcd unreachable", holding=True, holding_assignments=False)
    assert shown.reason == "waiting for etcd to record the job's state (etcd unreachable)"
