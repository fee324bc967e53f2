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
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, overload

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConcurrencyError, ConnectionClosedOK
from websockets.frames import Frame
from websockets.protocol import State
from websockets.typing import Data

from chunkline.client.protocol import CloseCode
from chunkline.server.entrypoints.frame_reader import FrameReader

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
    """A websockets server connection whose incoming frames are read by a
    :class:`~chunkline.server.entrypoints.frame_reader.FrameReader` (a binary message straight
    into a buffer of its own, unmasked in place; everything else through websockets), and which
    reports the bytes it holds for its session (unfinished messages, and complete ones the
    session has not taken) to the process's :class:`ReceiveBudget` after every read and every
    message taken, and is closed with 1013 when the budget picks it.

    Sessions take messages with :meth:`messages` (a binary message read here comes as a
    read-only ``memoryview`` of its buffer, which arrays decoded from it view); :meth:`recv` keeps
    websockets' contract (``bytes``, at the cost of a copy).

    The server sets :attr:`budget` on the class it hands to ``serve`` and :attr:`tenant` on each
    connection once its handshake authenticated it. Until then its bytes (a frame pipelined
    behind the handshake) count for :data:`UNAUTHENTICATED`, a tenant of its own: unauthenticated
    peers can only crowd out each other.
    """

    budget: ReceiveBudget | None = None
    tenant: str = UNAUTHENTICATED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reader: FrameReader | None = None  # set with the transport
        self._messages: collections.deque[bytes | memoryview] = collections.deque()  # read here, not taken
        self._queued_bytes = 0
        self._waiter: asyncio.Future[None] | None = None  # a session waiting for a message
        self._reads_paused = False  # paused by this connection (not by websockets' own queue)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        protocol = self.protocol
        limits = [s for s in (protocol.max_message_size, protocol.max_fragment_size) if s is not None]
        reader = self._reader = FrameReader(self._deliver, self._forward, self._websockets_idle,
                                            min(limits) if limits else None)
        # The transport reads into a buffered protocol only, which websockets' connection is not.
        transport.set_protocol(_Reads(self, reader))

    # ------------------------------------------------------------------ from the reader

    def _forward(self, data: memoryview) -> None:
        # websockets' own parser takes it (a view of the scratch: its reader copies what it keeps).
        ServerConnection.data_received(self, data)  # type: ignore[arg-type]  # bytes-like is enough

    def _websockets_idle(self) -> bool:
        """Whether a binary frame may be read here: websockets has no message of its own to hand
        over first and the connection is open."""
        protocol = self.protocol
        return protocol.current_size is None and not self.recv_messages.frames.queue and protocol.state is State.OPEN

    def _deliver(self, message: bytes | memoryview) -> None:
        messages = self._messages
        messages.append(message)
        self._queued_bytes += len(message)
        high = self.recv_messages.high
        if high is not None and len(messages) > high and not self._reads_paused:
            self._reads_paused = True
            self.transport.pause_reading()
        self._wake()

    def _after_read(self) -> None:
        """After each read the transport made: what the session may now take, and the budget."""
        if self._waiter is not None and (self.recv_messages.frames.queue or self.protocol.state is not State.OPEN):
            self._wake()
        self._report_held()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------ to the session

    async def next_message(self) -> bytes | memoryview | str:
        """The next message: one read here (``bytes``, or a read-only ``memoryview`` of its own
        buffer), else websockets' (``bytes`` or ``str``), in the order they arrived.

        Raises:
            ConnectionClosed: as websockets' ``recv`` does, at the end of the stream.
        """
        while True:
            messages = self._messages
            if messages:
                message = messages.popleft()
                self._queued_bytes -= len(message)
                low = self.recv_messages.low
                if self._reads_paused and (low is None or len(messages) <= low) and not self.recv_messages.paused:
                    self._reads_paused = False
                    self.transport.resume_reading()
                self._report_held()  # the message is the session's now
                return message
            reader = self._reader
            # websockets' turn: a message of its own (queued before any of ours could be read
            # here), a connection it handles entirely, or the end of the stream.
            if reader is None or reader.blind or self.recv_messages.frames.queue or self.protocol.state is not State.OPEN:
                theirs = await super().recv()
                self._report_held()
                return theirs
            if self._waiter is not None:
                raise ConcurrencyError("another coroutine is already waiting for the next message")
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def messages(self) -> AsyncIterator[bytes | memoryview | str]:
        """Every message until the connection closes normally (a ``ConnectionClosedError`` after
        an abnormal close), as iterating websockets' connection gives them, without its copies."""
        try:
            while True:
                yield await self.next_message()
        except ConnectionClosedOK:
            return

    @overload
    async def recv(self, decode: Literal[True]) -> str: ...

    @overload
    async def recv(self, decode: Literal[False]) -> bytes: ...

    @overload
    async def recv(self, decode: bool | None = None) -> Data: ...

    async def recv(self, decode: bool | None = None) -> Data:
        """websockets' ``recv`` over the same messages as :meth:`next_message` (a message read
        here is copied into the ``bytes`` websockets promises)."""
        message = await self.next_message()
        if isinstance(message, str):
            return message.encode() if decode is False else message
        data = bytes(message)
        return data.decode() if decode else data

    # ------------------------------------------------------------------ the budget

    def held_bytes(self) -> int:
        """What this connection holds for its session: the frames being read (here and in
        websockets' reader), the fragments of the message being received, and the complete
        messages queued (here and in websockets)."""
        protocol = self.protocol
        queue = self.recv_messages.frames.queue
        reader = self._reader
        held = (len(protocol.reader.buffer) + (protocol.current_size or 0) + self._queued_bytes
                + (reader.held if reader is not None else 0)
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
        if self._reader is not None:
            self._reader.discard()
        if self.budget is not None:
            self.budget.release(self)
        super().connection_lost(exc)
        self._wake()

    def refuse_for_budget(self) -> None:
        """Close with 1013 at once, dropping what was buffered (as websockets' own 1009 does)."""
        protocol = self.protocol
        if protocol.state not in (State.CONNECTING, State.OPEN):
            return
        if protocol.state is State.CONNECTING:  # bytes pipelined behind a handshake not yet answered
            log.info("dropping a connection holding %d bytes before its handshake was answered: receive budget full",
                     self.held_bytes())
            self.transport.abort()
            self._count_refusal()
            return
        log.info("closing a session of tenant %s holding %d bytes of messages not taken yet: receive budget full",
                 self.tenant, self.held_bytes())
        protocol.fail(CloseCode.TRY_AGAIN_LATER, "server receive buffer budget full; retry later")
        self.send_data()
        if self.close_deadline is None and self.close_timeout is not None:
            self.close_deadline = self.loop.time() + self.close_timeout
        if self._reader is not None:
            self._reader.discard()  # what it was reading will not be delivered
        self._wake()
        self._count_refusal()

    def _count_refusal(self) -> None:
        if self.budget is not None and self.budget.on_refused is not None:
            self.budget.on_refused()


class _Reads(asyncio.BufferedProtocol):
    """The transport's protocol: its reads go where the connection's frame reader says; what the
    transport says besides goes to the connection."""

    def __init__(self, connection: BudgetedConnection, reader: FrameReader) -> None:
        self._connection = connection
        self._reader = reader

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._reader.buffer_updated(nbytes)
        self._connection._after_read()

    def eof_received(self) -> bool | None:
        self._connection.eof_received()
        self._connection._after_read()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection.connection_lost(exc)

    def pause_writing(self) -> None:
        self._connection.pause_writing()

    def resume_writing(self) -> None:
        self._connection.resume_writing()


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
