"""Small asyncio helpers that more than one part of the daemon needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def first_of(*waits: Awaitable[object], timeout: float | None = None) -> None:
    """Returns when the first of ``waits`` is done (or after ``timeout``); the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
