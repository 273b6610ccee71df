"""The suite's own ports (tests/ports.py): one slice per pytest-xdist worker, none shared, none in the range the
daemon picks its own from."""

from __future__ import annotations

import pytest
from tfelastic.daemon import netutil

from tests import ports


def slices(monkeypatch: pytest.MonkeyPatch, count: int) -> list[range]:
    found = []
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        found.append(ports.worker_slice())
    return found


@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_the_workers_slices_are_disjoint_and_below_the_daemons_picks(monkeypatch: pytest.MonkeyPatch,
                                                                     count: int) -> None:
    found = slices(monkeypatch, count)
    taken = [port for s in found for port in s]
    assert len(taken) == len(set(taken)) and all(len(s) > 100 for s in found)
    assert max(taken) < netutil.daemon_ports().start  # the daemon's own picks start there


def test_a_port_comes_from_this_workers_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    assert ports.free_port() in ports.worker_slice()


def test_ports_picked_together_are_never_the_same_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice of two ports picked twice in a row: random picks repeat often, the pairs must not."""
    monkeypatch.setattr(ports, "worker_slice", lambda: range(20000, 20002))
    pairs = [ports.free_ports(2) for _ in range(50)]
    assert all(sorted(pair) == [20000, 20001] for pair in pairs)


def test_ports_picked_one_after_another_come_round_the_slice_before_repeating(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test picks a coordinator's port, then an etcd member's, before it starts either: no repeat within a slice."""
    start = next(p for p in range(20000, 30000, 10) if all(netutil.can_bind("127.0.0.1", q) for q in range(p, p + 10)))
    monkeypatch.setattr(ports, "worker_slice", lambda: range(start, start + 10))  # ten ports free a moment ago
    picks = [ports.free_port() for _ in range(10)]
    assert sorted(picks) == list(range(start, start + 10))
    assert ports.free_port() == picks[0]  # and then round again, in the same order


def test_no_ports_asked_for_are_none() -> None:
    """A worker alone has no peers: a hand-made TF_CONFIG asks for no other port."""
    assert ports.free_ports(0) == []
