"""The bytes WebSocket clients make the server hold in messages the session has not taken yet,
bounded per process and per tenant.

``max_message_bytes`` bounds one message, but a client may start a large message and never finish
it: its bytes sit in the connection's read buffer (a frame not yet complete) and in the frames
of a fragmented message not yet ended. Across up to ``max_connections`` sessions that is
gigabytes. :class:`ReceiveBudget` counts those bytes per connection (what websockets' parser
holds: the partial frame in its reader plus the fragments of the current message), and when a
connection's growth would take its tenant past its share, or the process past the total, it
closes the connection holding the most such bytes in that scope (the grower itself when it is
the largest) with **1013** (try again later). Closing the largest holder rather than the grower
keeps a robot's ordinary observation flowing while a client sits on a half-sent huge frame.

Complete messages waiting in websockets' queue for the session count too: a client that sends
faster than its session reads (the session waiting on a slow send, or on an off-loop decode)
would otherwise make the server hold up to ``max_queue`` whole messages per connection (16 of
16 MiB by default) outside any budget. Bytes are released when the session takes the message
(``recv``) or the connection closes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any, Literal, overload

from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame
from websockets.protocol import State
from websockets.typing import Data

from chunkline.client.protocol import CloseCode
from chunkline.server.entrypoints.payload_reader import DirectReads, install

__all__ = ["ReceiveBudget", "BudgetedConnection", "RECEIVE_BUDGET_REASON", "UNAUTHENTICATED"]

log = logging.getLogger("chunkline.server")

#: The tenant a connection's bytes count for before its handshake is authenticated.
UNAUTHENTICATED = ""

_NOTHING = ("", 0)

#: The refusal reason counted in ``chunkline_refusals_total`` when a connection is closed for it.
RECEIVE_BUDGET_REASON = "receive_budget"


class ReceiveBudget:
    """Per-connection counts of bytes held in unfinished messages, with a process total and a
    per-tenant share (sans-I/O: the caller closes the connections it is told to).

    Args:
        total_bytes: most bytes held by every connection together.
        tenant_share: the fraction of ``total_bytes`` one tenant's connections may hold.
        on_refused: called once for every connection closed for the budget (a metric).
    """

    def __init__(self, total_bytes: int, tenant_share: float, on_refused: Callable[[], None] | None = None) -> None:
        if total_bytes < 1 or not 0 < tenant_share <= 1:
            raise ValueError("total_bytes must be positive and tenant_share in (0, 1]")
        self.on_refused = on_refused
        self.total_bytes = total_bytes
        self.tenant_bytes = max(1, int(total_bytes * tenant_share))
        self.held = 0
        # A plain dict, not a Counter: three updates per message received make its Python-level
        # ``__delitem__`` and ``__missing__`` count.
        self._held_by_tenant: dict[str, int] = {}
        self._holders: dict[object, tuple[str, int]] = {}

    def held_by(self, tenant: str) -> int:
        """Bytes held by ``tenant``'s connections."""
        return self._held_by_tenant.get(tenant, 0)

    def update(self, holder: object, tenant: str, held: int) -> list[object]:
        """Set what ``holder`` (a connection of ``tenant``) holds now.

        Returns:
            the holders to close (largest first; their bytes are already released), so that
            the rest fits: empty when it fits as it is. ``holder`` itself may be among them.
        """
        self._set(holder, tenant, held)
        if self.held <= self.tenant_bytes:
            # The usual case, decided without a lookup: no tenant holds more than all of them
            # together, and tenant_bytes <= total_bytes.
            return []
        by_tenant = self._held_by_tenant
        evicted: list[object] = []
        while by_tenant.get(tenant, 0) > self.tenant_bytes or self.held > self.total_bytes:
            scope = tenant if by_tenant.get(tenant, 0) > self.tenant_bytes else None
            victim = max((h for h, (t, _) in self._holders.items() if scope is None or t == scope),
                         key=lambda h: self._holders[h][1])
            self.release(victim)
            evicted.append(victim)
        return evicted

    def release(self, holder: object) -> None:
        """Forget ``holder`` (its message completed or its connection closed)."""
        self._set(holder, "", 0)

    def _set(self, holder: object, tenant: str, held: int) -> None:
        old_tenant, old = self._holders.pop(holder, _NOTHING)
        by_tenant = self._held_by_tenant
        if old:
            self.held -= old
            left = by_tenant[old_tenant] - old
            if left:
                by_tenant[old_tenant] = left
            else:
                del by_tenant[old_tenant]
        if held > 0:
            self._holders[holder] = (tenant, held)
            self.held += held
            by_tenant[tenant] = by_tenant.get(tenant, 0) + held


class BudgetedConnection(ServerConnection):
    """A websockets server connection that reports the bytes it holds for its session (unfinished
    messages, and complete ones the session has not taken) to the process's
    :class:`ReceiveBudget` after every read and every message taken, and is closed with 1013 when
    the budget picks it.

    Its parser reads through a :class:`~chunkline.server.entrypoints.payload_reader.PayloadReader`,
    which copies a large frame's payload once into a buffer of its own as it arrives, and the transport
    reads such a payload straight into that buffer (:class:`~chunkline.server.entrypoints.payload_reader.DirectReads`).

    The server sets :attr:`budget` on the class it hands to ``serve`` and :attr:`tenant` on each
    connection once its handshake authenticated it. Until then its bytes (a frame pipelined
    behind the handshake) count for :data:`UNAUTHENTICATED`, a tenant of its own: unauthenticated
    peers can only crowd out each other.
    """

    budget: ReceiveBudget | None = None
    tenant: str = UNAUTHENTICATED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._payload_reader = install(self.protocol)  # before any byte arrives

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # Reads of a large payload land in its buffer (see DirectReads); the transport reads
        # into a buffered protocol only, which websockets' connection is not.
        transport.set_protocol(DirectReads(self, self._payload_reader))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._report_held()

    @overload
    async def recv(self, decode: Literal[True]) -> str: ...

    @overload
    async def recv(self, decode: Literal[False]) -> bytes: ...

    @overload
    async def recv(self, decode: bool | None = None) -> Data: ...

    async def recv(self, decode: bool | None = None) -> Data:
        message = await super().recv(decode)
        self._report_held()  # the message is the session's now, out of websockets' queue
        return message

    def held_bytes(self) -> int:
        """What this connection holds for its session: the partial frame in the reader, the
        fragments of the message being received, and the complete messages queued."""
        protocol = self.protocol
        queue = self.recv_messages.frames.queue
        held = (self._payload_reader.held + (protocol.current_size or 0)
                + (_complete_queued_bytes(queue) if queue else 0))  # the usual case: the session keeps up
        # The state (a property) is read only when there is something to count: held or not, a
        # closing connection reports nothing.
        if held and protocol.state not in (State.CONNECTING, State.OPEN):
            return 0
        return held

    def _report_held(self) -> None:
        budget = self.budget
        if budget is None:
            return
        for victim in budget.update(self, self.tenant, self.held_bytes()):
            assert isinstance(victim, BudgetedConnection)
            victim.refuse_for_budget()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.budget is not None:
            self.budget.release(self)
        super().connection_lost(exc)

    def refuse_for_budget(self) -> None:
        """Close with 1013 at once, dropping what was buffered (as websockets' own 1009 does)."""
        protocol = self.protocol
        if protocol.state not in (State.CONNECTING, State.OPEN):
            return
        if protocol.state is State.CONNECTING:  # bytes pipelined behind a handshake not yet answered
            log.info("dropping a connection holding %d bytes before its handshake was answered: receive budget full",
                     self._payload_reader.held)
            self.transport.abort()
            self._count_refusal()
            return
        log.info("closing a session of tenant %s holding %d bytes of messages not taken yet: receive budget full",
                 self.tenant, self.held_bytes())
        protocol.fail(CloseCode.TRY_AGAIN_LATER, "server receive buffer budget full; retry later")
        self.send_data()
        if self.close_deadline is None and self.close_timeout is not None:
            self.close_deadline = self.loop.time() + self.close_timeout
        self._count_refusal()

    def _count_refusal(self) -> None:
        if self.budget is not None and self.budget.on_refused is not None:
            self.budget.on_refused()


def _complete_queued_bytes(frames: collections.deque[Frame]) -> int:
    """Bytes of the complete messages in websockets' frame queue. Frames after the last final
    frame belong to the message still arriving, which the protocol's ``current_size`` counts."""
    total = 0
    complete = 0
    for frame in frames:
        total += len(frame.data)
        if frame.fin:
            complete = total
    return complete
