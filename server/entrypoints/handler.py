"""What a native session hands each message type to: its request class's handler.

Every request in flight on a session, whatever its class, is in the session's one map
(:attr:`SessionPort.in_flight`, request id to entry): one id space and one in-flight limit across
classes. An entry names the handler that owns it; only that handler adds and removes it.
:meth:`Handler.handle` runs synchronously and returns an awaitable only when the request must
wait (an answer to write, a decode on a pool), so a request that needs none costs no coroutine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from websockets.exceptions import ConnectionClosed

from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import error_message
from chunkline.server.core.tenants import TenantInfo

__all__ = ["RequestId", "Send", "Handler", "InFlight", "SessionPort", "TaskHandler", "Unserved"]

RequestId = int | str
#: sends one message map (the session encodes it)
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Handler(Protocol):
    """One request class's messages on one session."""

    def handle(self, msg: Any, received: float, decoded: float) -> Awaitable[None] | None:
        """Take a parsed request (its id is free, the session has room); await what it returns."""

    def cancel(self, request_id: RequestId) -> None:
        """Withdraw one of this handler's requests in flight (a ``cancel`` message)."""

    @property
    def in_flight(self) -> int:
        """This handler's requests in flight."""

    def close(self) -> Awaitable[Any] | None:
        """The session ended: withdraw every request in flight now; returns what to wait for
        (its tasks), if anything."""


class InFlight(Protocol):
    """An entry of the session's in-flight map."""

    @property
    def handler(self) -> Handler: ...


class SessionPort(Protocol):
    """What handlers use of their session."""

    id: str
    tenant: TenantInfo
    in_flight: dict[RequestId, InFlight]

    async def send_message(self, message: dict[str, Any]) -> None:
        """Encode and send one message map."""


def owned(session: SessionPort, handler: Handler) -> list[InFlight]:
    """``handler``'s entries in its session's in-flight map."""
    return [entry for entry in session.in_flight.values() if entry.handler is handler]


@dataclasses.dataclass(slots=True)
class _Task:
    handler: TaskHandler
    task: asyncio.Task[None]


class TaskHandler:
    """Requests each answered by one task (text ``generate``, ``plan``): ``serve(msg, tenant,
    session id, send)`` answers one; cancelling its task withdraws it (the coroutine answers
    ``cancelled`` while the connection stands).

    Args:
        session: the session.
        serve: the class's exchange.
    """

    def __init__(self, session: SessionPort, serve: Callable[[Any, TenantInfo, str, Send], Awaitable[None]]) -> None:
        self._session = session
        self._serve = serve
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones

    def handle(self, msg: Any, received: float, decoded: float) -> None:
        task = asyncio.get_running_loop().create_task(self._run(msg))
        self._session.in_flight[msg.id] = _Task(self, task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: Any) -> None:
        session = self._session
        try:
            await self._serve(msg, session.tenant, session.id, session.send_message)
        except (asyncio.CancelledError, ConnectionClosed):
            pass
        finally:
            session.in_flight.pop(msg.id, None)

    def cancel(self, request_id: RequestId) -> None:
        entry = self._session.in_flight.get(request_id)
        if isinstance(entry, _Task) and entry.handler is self:
            # On the loop's next turn: a task cancelled before its first step (its request and the
            # cancel in one read) would end without entering its exchange, answering nothing.
            asyncio.get_running_loop().call_soon(entry.task.cancel)

    @property
    def in_flight(self) -> int:
        return len(owned(self._session, self))

    def close(self) -> Awaitable[Any] | None:
        for task in self._tasks:
            task.cancel()
        return asyncio.gather(*self._tasks, return_exceptions=True) if self._tasks else None


class Unserved:
    """A message type whose class this server does not serve: answered ``unknown_model``."""

    def __init__(self, session: SessionPort, message: str) -> None:
        self._session = session
        self._message = message

    def handle(self, msg: Any, received: float, decoded: float) -> Awaitable[None]:
        return self._refuse(msg.id)

    async def _refuse(self, request_id: RequestId) -> None:
        try:
            await self._session.send_message(error_message(ErrorCode.UNKNOWN_MODEL, self._message, request_id))
        except ConnectionClosed:
            pass

    def cancel(self, request_id: RequestId) -> None:
        pass

    @property
    def in_flight(self) -> int:
        return 0

    def close(self) -> None:
        return None
