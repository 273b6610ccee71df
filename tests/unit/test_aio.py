"""The daemon's asyncio helpers (daemon/aio.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from tfelastic.daemon.aio import within


async def _loop_until_cancelled(wait: Callable[[Awaitable[object], float], Awaitable[object]]) -> bool:
    """A ticker that sleeps on an event between turns, cancelled in the very turn the event is set: does the
    cancel end it (the coordinator's stop waited forever for one that ran on)?"""
    event = asyncio.Event()

    async def ticker() -> None:
        while True:
            event.clear()
            await wait(event.wait(), 10.0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
    ended = task.done()
    task.cancel()  # a ticker that lost its cancel: end it for this test
    await asyncio.wait({task}, timeout=1.0)
    return ended


def test_a_cancel_that_comes_as_the_wait_ends_is_not_lost() -> None:
    assert asyncio.run(_loop_until_cancelled(within))


def test_within_says_whether_it_finished_and_raises_what_it_raised() -> None:
    async def scenario() -> None:
        assert await within(asyncio.sleep(0), 1.0)
        assert not await within(asyncio.sleep(10), 0.01)
        with pytest.raises(ValueError, match="bad"):
            await within(_fail(), 1.0)

    async def _fail() -> None:
        raise ValueError("bad")

    asyncio.run(scenario())
