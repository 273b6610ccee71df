"""Small asyncio helpers that more than one part of the daemon needs."""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Awaitable


async def first_of(*waits: Awaitable[object], timeout: float | None = None) -> None:
    """Returns when the first of ``waits`` is done (or after ``timeout``); the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def within(awaitable: Awaitable[object], timeout: float) -> bool:
    """Awaits ``awaitable`` for at most ``timeout`` seconds: True if it finished (raising what it raised), False
    if the time ran out (it is then cancelled). Unlike ``asyncio.wait_for`` in Python 3.11, a cancellation of the
    caller that comes as ``awaitable`` finishes is never lost (python/cpython#86296): a loop around wait_for that
    lost one ran on forever, and the coordinator's stop waited for it forever (the chaos soak's drained leader)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            task.cancel()
    if done:
        task.result()
    return bool(done)


def stacks() -> str:
    """Where every asyncio task of the running loop and every thread waits: for an operator asking why an agent
    does not move on (SIGUSR1). Call it on the loop's thread."""
    lines = [f"task {task.get_name()}: {' > '.join(_awaiting(task.get_coro()))}\n" for task in asyncio.all_tasks()]
    return "".join(lines) + thread_stacks()


def thread_stacks() -> str:
    """Where every thread is (any thread may call it)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "".join(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)[-3:])
                   for ident, frame in sys._current_frames().items())


def _awaiting(coro: object) -> list[str]:
    """The chain of awaits a coroutine is suspended in, outermost first (a task's own stack has only the first)."""
    chain: list[str] = []
    while coro is not None and len(chain) < 32:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain or [repr(coro)]
