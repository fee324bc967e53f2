"""The robot port's listener: ``loop.create_server`` with one :class:`BudgetedConnection` per client,
the handshake decided by the server's callbacks (probes, auth, caps, subprotocol) before any
payload is read, and a session task per accepted connection.

Invariant: every connection the listener made is either still handshaking, running a session, or
forgotten once its transport is gone; :meth:`Listener.close` ends them all with 1001.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from websockets.http11 import Request, Response

from chunkline.server.entrypoints.connection import BudgetedConnection, ConnectionSettings, protocol_factory
from chunkline.server.entrypoints.receive_budget import ReceiveBudget

__all__ = ["Listener", "ListenerCallbacks"]


@dataclass(frozen=True, slots=True)
class ListenerCallbacks:
    """The server's decisions: ``process_request`` answers a request itself (a probe, a refusal) or
    returns ``None`` to accept it; ``process_response`` sees the response about to be sent."""

    handler: Callable[[BudgetedConnection], Awaitable[None]]
    process_request: Callable[[BudgetedConnection, Request], Response | None]
    process_response: Callable[[BudgetedConnection, Request, Response], None]
    select_subprotocol: Callable[[BudgetedConnection, list[str]], str | None]


class Listener:
    """WebSocket connections on one port (see the module's docstring)."""

    def __init__(self, callbacks: ListenerCallbacks, settings: ConnectionSettings,
                 budget: ReceiveBudget | None = None) -> None:
        self._callbacks = callbacks
        self._settings = settings
        self._budget = budget
        self._server: asyncio.Server | None = None
        self.connections: set[BudgetedConnection] = set()

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        make = protocol_factory(self, self._settings, self._budget)

        def factory() -> BudgetedConnection:
            connection = make()
            self.connections.add(connection)
            return connection

        self._server = await asyncio.get_running_loop().create_server(factory, host, port, ssl=ssl_context)

    @property
    def sockets(self) -> tuple[object, ...]:
        assert self._server is not None
        return tuple(self._server.sockets)

    @property
    def port(self) -> int:
        return int(self.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop accepting and close every connection with 1001 (going away)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.going_away()

    async def wait_closed(self) -> None:
        """Until every connection has ended (each within its close timeout)."""
        connections = list(self.connections)
        await asyncio.gather(*(c.wait_closed() for c in connections))
        tasks = [c.task for c in connections if c.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------------ the connections' hooks

    def process_request(self, connection: BudgetedConnection, request: Request) -> Response | None:
        return self._callbacks.process_request(connection, request)

    def select_subprotocol(self, connection: BudgetedConnection, offered: list[str]) -> str | None:
        return self._callbacks.select_subprotocol(connection, offered)

    def process_response(self, connection: BudgetedConnection, request: Request, response: Response) -> None:
        self._callbacks.process_response(connection, request, response)

    def handler(self, connection: BudgetedConnection) -> Awaitable[None]:
        return self._callbacks.handler(connection)

    def forget(self, connection: BudgetedConnection) -> None:
        self.connections.discard(connection)
