"""A robot-port listener in the test's own event loop: real sockets on loopback, a handler the test
writes, and the tenant named by the client in an ``X-Tenant`` header."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from websockets.http11 import Request, Response

from chunkline.server.entrypoints.connection import BudgetedConnection, ConnectionSettings
from chunkline.server.entrypoints.listener import Listener, ListenerCallbacks
from chunkline.server.entrypoints.receive_budget import ReceiveBudget

MIB = 1 << 20


@contextlib.asynccontextmanager
async def listening(handler: Callable[[BudgetedConnection], Awaitable[None]], budget: ReceiveBudget | None = None,
                    **settings: object) -> AsyncIterator[Listener]:
    def process_request(connection: BudgetedConnection, request: Request) -> Response | None:
        connection.tenant = request.headers.get("X-Tenant", "anyone")
        return None

    callbacks = ListenerCallbacks(handler=handler, process_request=process_request,
                                  process_response=lambda c, q, r: None, select_subprotocol=lambda c, offered: None)
    options: dict[str, object] = {"max_message_bytes": 16 * MIB, "ping_interval_s": None, **settings}
    listener = Listener(callbacks, ConnectionSettings(**options), budget)  # type: ignore[arg-type]
    await listener.start("127.0.0.1", 0)
    try:
        yield listener
    finally:
        listener.close()
        await listener.wait_closed()
