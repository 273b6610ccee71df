"""One Session stream to the coordinator, as the agent's shell uses it: API messages out, API orders in.

I/O only: what the messages mean is the core's business (:mod:`tfelastic.daemon.agent.core`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from tfelastic.daemon.agent.api import FatalSessionError, SessionLost
from tfelastic.daemon.endpoint import Endpoint, TlsConfig
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.rendezvous import api, convert
from tfelastic.daemon.rendezvous.client import call_metadata, open_channel
from tfelastic.daemon.rpc import rendezvous_pb2 as pb
from tfelastic.daemon.rpc import rendezvous_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # generic only in the stubs
    SessionCall = grpc.aio.StreamStreamCall[pb.AgentMessage, pb.CoordinatorMessage]

# A refusal that retrying cannot fix ends the agent: wrong token, another job's settings, a duplicate node id, a
# message the coordinator cannot accept (exit 78), or a job that has already ended (exit 1).
_FATAL_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: ExitCode.CONFIG,
    grpc.StatusCode.FAILED_PRECONDITION: ExitCode.CONFIG,
    grpc.StatusCode.ALREADY_EXISTS: ExitCode.CONFIG,
    grpc.StatusCode.INVALID_ARGUMENT: ExitCode.CONFIG,
    grpc.StatusCode.ABORTED: ExitCode.FAILED,
}


class CoordinatorSession:
    """Messages queued with :meth:`send` go out in order; :meth:`run` reads orders until the stream ends."""

    def __init__(self, call: SessionCall, clock: Callable[[], float], hang_up_grace: float) -> None:
        self._call, self._clock, self._hang_up_grace = call, clock, hang_up_grace
        self._outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self._ended = asyncio.Event()  # hung up and waited, or dropped
        self._dropped: str | None = None

    def send(self, message: api.AgentMessage) -> None:
        self._outbox.put_nowait(convert.agent_message_to_proto(message, self._clock()))

    def hang_up(self) -> None:
        """Nothing more to send: the coordinator then ends the stream; if it does not within the grace, the
        session ends anyway."""
        self._outbox.put_nowait(None)
        asyncio.get_running_loop().call_later(self._hang_up_grace, self._ended.set)

    def drop(self, reason: str) -> None:
        """Give up on the session at once (the coordinator is silent): :meth:`run` raises SessionLost."""
        self._dropped = reason
        self._ended.set()

    async def run(self, on_message: Callable[[api.CoordinatorMessage], None],
                  alongside: Sequence[asyncio.Task[None]] = ()) -> None:
        """Returns when the stream ended, or the grace after hanging up ran out; raises SessionLost when it broke
        or was dropped, FatalSessionError when the coordinator refused this agent, or what ``alongside`` (tasks
        that live as long as the session) raised."""
        tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read(on_message)),
                 asyncio.create_task(self._ended.wait())]
        try:
            done, _ = await asyncio.wait([*tasks, *alongside], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if self._dropped is not None:
                raise SessionLost(self._dropped)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._call.cancel()

    async def _write(self) -> None:
        try:
            while (message := await self._outbox.get()) is not None:
                await self._call.write(message)
            await self._call.done_writing()
        except grpc.aio.AioRpcError as e:
            raise SessionLost(f"{e.code().name}: {e.details()}") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            raise SessionLost(f"write failed: {e}") from None
        await asyncio.Event().wait()  # hung up: the reader ends the session

    async def _read(self, on_message: Callable[[api.CoordinatorMessage], None]) -> None:
        try:
            async for message in self._call:
                on_message(convert.coordinator_message_from_proto(message))
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in _FATAL_CODES:
                raise FatalSessionError(f"the coordinator refused this agent: {e.details()}",
                                        _FATAL_CODES[code]) from None
            raise SessionLost(f"{code.name}: {e.details()}") from None


@contextlib.asynccontextmanager
async def open_session(endpoint: Endpoint, tls: TlsConfig, token: str | None, clock: Callable[[], float],
                       hang_up_grace: float) -> AsyncIterator[CoordinatorSession]:
    async with open_channel(endpoint, tls) as channel:
        stub = pb_grpc.RendezvousStub(channel)  # type: ignore[no-untyped-call]
        yield CoordinatorSession(stub.Session(metadata=call_metadata(token)), clock, hang_up_grace)
