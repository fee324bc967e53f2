"""One WebSocket connection as the server runs it: websockets' server connection with the
server's own frame reader in front (:mod:`.frame_reader`) and the bytes it holds for its session
counted in the process's receive budget (:mod:`.receive_budget`)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal, overload

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConcurrencyError, ConnectionClosedOK
from websockets.frames import Frame
from websockets.protocol import State
from websockets.typing import Data

from chunkline.client.protocol import CloseCode
from chunkline.server.entrypoints.frame_reader import FrameReader
from chunkline.server.entrypoints.receive_budget import UNAUTHENTICATED, ReceiveBudget

__all__ = ["BudgetedConnection"]

log = logging.getLogger("chunkline.server")


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
