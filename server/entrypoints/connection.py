"""One WebSocket connection: the server's own asyncio protocol owns the socket, its frame reader
(:mod:`.frame_reader`) takes final binary frames, and websockets' public sans-I/O
``ServerProtocol`` handles the handshake and every other frame (``receive_data``,
``events_received``, ``data_to_send``, ``send_*``, ``fail``).

Invariants: messages reach the session in the order they arrived, from one queue; every byte held
for the client (partial frames, fragments, queued messages, reserved decoded arrays) is reported to
the process's :class:`ReceiveBudget` after every read and every message taken; reading pauses while
the queue is at its allowance or while held back for a retry time (:meth:`~BudgetedConnection.hold_reading`,
which a body gate may ask for after a large frame's first bytes, :mod:`.peek`, and asks again as
the hold ends), and resumes once neither holds, closing ending both; whatever websockets has to
write is flushed right after each call into it, so a reply written here never overtakes a pong or a close; the
server's end of stream is a lingering close (half-close, then read and drop until the peer's end of
stream or the close timeout), so a peer still sending reads the close frame, not a reset.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from websockets.exceptions import ConcurrencyError, ConnectionClosed, ConnectionClosedOK
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from chunkline.client.wire.errors import CloseCode
from chunkline.server.entrypoints.frame_reader import READ_BYTES, FrameReader
from chunkline.server.entrypoints.peek import PEEK_BYTES, BodyGate, ReadingHold
from chunkline.server.entrypoints.receive_budget import UNAUTHENTICATED, ReceiveBudget, Reservation
from chunkline.server.entrypoints.reply_writer import frame_header

__all__ = ["BudgetedConnection", "ConnectionSettings", "Hooks", "MESSAGE_OVERHEAD_BYTES", "Reservation", "protocol_factory"]

log = logging.getLogger("chunkline.server")

#: What a queued message costs beyond its payload (object headers, the queue's slot): counted so
#: that a flood of empty messages is bounded too.
MESSAGE_OVERHEAD_BYTES = 128
_OPEN, _CONNECTING = State.OPEN, State.CONNECTING
Message = bytes | memoryview | str


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """A listener's limits, the same for every connection."""

    max_message_bytes: int | None
    max_queued_messages: int = 16
    max_queued_bytes: int | None = None  # None: max_message_bytes
    open_timeout_s: float | None = 10.0
    ping_interval_s: float | None = 20.0
    close_timeout_s: float = 10.0
    write_limit_bytes: int = 4 * 1024 * 1024
    subprotocols: tuple[str, ...] = ()


class Hooks(Protocol):
    """What the listener supplies: the handshake's decisions and the session."""

    def process_request(self, connection: BudgetedConnection, request: Request) -> Response | None: ...
    def select_subprotocol(self, connection: BudgetedConnection, offered: list[str]) -> str | None: ...
    def process_response(self, connection: BudgetedConnection, request: Request, response: Response) -> None: ...
    def handler(self, connection: BudgetedConnection) -> Awaitable[None]: ...
    def forget(self, connection: BudgetedConnection) -> None: ...


class BudgetedConnection(asyncio.BufferedProtocol):
    """One client's WebSocket, from accept to close (see the module's docstring).

    Its attributes are the asyncio protocol's transport state, websockets' ``ServerProtocol``, the
    frame reader, the receive budget's account and the session's queues: asyncio calls one protocol
    object, so the callbacks' state lives on it.

    The session takes messages with :meth:`messages` (a large binary message comes as a read-only
    ``memoryview`` of its own buffer), sends with :meth:`send` or :meth:`send_now`, and ends with
    :meth:`close`. ``tenant`` is set by the handshake once authenticated; until then the bytes count
    for :data:`UNAUTHENTICATED`.
    """

    def __init__(self, hooks: Hooks, settings: ConnectionSettings, budget: ReceiveBudget | None = None) -> None:
        self._hooks = hooks
        self._settings = settings
        self.budget = budget
        self._tenant = UNAUTHENTICATED
        self.protocol = ServerProtocol(subprotocols=[Subprotocol(s) for s in settings.subprotocols] or None,
                                       select_subprotocol=lambda _, offered: self._select(offered), max_size=settings.max_message_bytes)
        self._reader = FrameReader(self._deliver, self._forward, self._may_read, settings.max_message_bytes, peeked=self._peeked)
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.request: Request | None = None
        self.response: Response | None = None
        self.remote_address: Any = None
        self._messages: collections.deque[Message] = collections.deque()
        self._queued_bytes = 0
        self._fragments = bytearray()  # the message being received in fragments
        self._assembling = False
        self._fragment_text = False
        self._reserved = 0
        self._queue_limit_bytes = settings.max_queued_bytes or settings.max_message_bytes or (1 << 62)
        # Why reading is paused; _update_reading makes the transport follow them (one owner).
        self._reading_paused = False  # the queue is at its allowance
        self._hold = ReadingHold(self.loop, self._hold_changed)  # until a retry time (hold_reading)
        self._gate: BodyGate | None = None  # asked before a large frame's body (set_body_gate)
        self._yielding = False  # a large read: the loop's other readers go first (_yield_turn)
        self._transport_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._writing_paused = False
        self._closed: asyncio.Future[None] = self.loop.create_future()
        self._eof_sent = False
        self._timer: asyncio.TimerHandle | None = None  # the handshake's or the close's timeout
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping: bytes | None = None
        self.task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ state the sessions read

    @property
    def tenant(self) -> str:
        return self._tenant

    @tenant.setter
    def tenant(self, name: str) -> None:
        self._tenant = name
        self._report()

    @property
    def state(self) -> State:
        return self.protocol.state

    @property
    def subprotocol(self) -> str | None:
        return self.protocol.subprotocol

    @property
    def close_code(self) -> int | None:
        return self.protocol.close_code

    @property
    def reading_paused(self) -> bool:
        return self._reading_paused

    @property
    def queued_messages(self) -> int:
        """Messages read whole that the session has not taken yet."""
        return len(self._messages)

    @property
    def reading_held(self) -> bool:
        """Whether reading is held back by :meth:`hold_reading` now."""
        return self._hold.active

    def hold_reading(self, seconds: float) -> None:
        """Read nothing more from this peer for ``seconds`` (a longer hold under way is kept): a
        client that sends inside the retry window it was given is held back by TCP flow control
        until the window ends, instead of costing the server a read of every message it sends.
        Messages already read are still delivered; closing ends the hold (the close is read)."""
        if self.protocol.state is _OPEN and seconds > 0:
            self._hold.hold(seconds)

    def set_body_gate(self, gate: BodyGate | None) -> None:
        """Ask ``gate`` before reading each large frame's body (:mod:`.peek`); ``None``: read on."""
        self._gate = gate
        self._reader.peek_bytes = PEEK_BYTES if gate is not None else 0

    def ask_gate_again(self) -> None:
        """Ask the body gate again about the large frame under way (one it let through before a
        retry window opened is held now, the rest of its body unread). A hold's end asks too."""
        self._reader.peek_again()

    def drop_body(self) -> None:
        """Deliver nothing of the large frame the body gate is asked about: its caller answered it
        from its first bytes. Its rest is read and dropped as it arrives, holding nothing."""
        self._reader.drop_payload()
        self._report()

    def held_bytes(self) -> int:
        """Every byte held for this client now (nothing once it is closing)."""
        held = (self._reader.held + len(self._fragments) + self._queued_bytes
                + MESSAGE_OVERHEAD_BYTES * len(self._messages) + self._reserved)
        if held and self.protocol.state is not _OPEN:  # the state is read only when something is held
            return held if self.protocol.state is _CONNECTING else 0
        return held

    def reserve(self, nbytes: int, share: float = 1.0) -> Reservation | None:
        """Count ``nbytes`` (arrays about to be decoded, or held while a request runs) for this
        connection until released, or ``None`` when they do not fit within ``share`` of its
        tenant's share (refuse the request then)."""
        budget = self.budget
        if budget is not None and not budget.fits(self._tenant, nbytes, share):
            return None
        self._reserved += nbytes
        self._report()
        return Reservation(self._unreserve, nbytes)

    def _unreserve(self, nbytes: int) -> None:
        self._reserved -= nbytes
        self._report()

    # ------------------------------------------------------------------ asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.remote_address = transport.get_extra_info("peername")
        limit = self._settings.write_limit_bytes
        transport.set_write_buffer_limits(limit, limit // 4)  # type: ignore[attr-defined]
        if self._settings.open_timeout_s is not None:
            self._timer = self.loop.call_later(self._settings.open_timeout_s, self._open_timed_out)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._reader.buffer_updated(nbytes)
        self._report()
        if nbytes >= READ_BYTES:
            self._yield_turn()

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        self._flush()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.receive_eof()  # idempotent: the protocol ends in CLOSED
        self._reader.discard()
        self._drop_fragments()
        for timer in (self._timer, self._ping_timer):
            if timer is not None:
                timer.cancel()
        self._hold.cancel()
        if self.budget is not None:
            self.budget.release(self)
        if not self._closed.done():
            self._closed.set_result(None)
        self._wake()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self.task is None:
            self._hooks.forget(self)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ------------------------------------------------------------------ from the frame reader

    def _may_read(self) -> bool:
        """Whether the next binary frame may be read here: open, and no fragmented message under way."""
        return self.protocol.state is _OPEN and not self._assembling

    def _peeked(self, head: memoryview, length: int) -> None:
        gate = self._gate
        if gate is not None and self.protocol.state is _OPEN:
            self.hold_reading(gate(head, length))

    def _deliver(self, message: Message) -> None:
        if self.protocol.state is not _OPEN:
            return  # closing: the session takes no more messages, and nothing more is held
        self._messages.append(message)
        self._queued_bytes += len(message)
        if not self._reading_paused and (len(self._messages) >= self._settings.max_queued_messages
                                         or self._queued_bytes >= self._queue_limit_bytes):
            self._reading_paused = True
            self._update_reading()
        self._wake()

    def _forward(self, data: memoryview) -> None:
        protocol = self.protocol
        protocol.receive_data(data)  # type: ignore[arg-type]  # any bytes-like: its reader copies
        for event in protocol.events_received():
            if isinstance(event, Frame):
                self._frame(event)
            else:
                self._handshake(event)
        self._flush()

    def _frame(self, frame: Frame) -> None:
        opcode = frame.opcode
        if opcode is Opcode.BINARY or opcode is Opcode.TEXT or opcode is Opcode.CONT:
            if opcode is not Opcode.CONT:
                self._fragment_text = opcode is Opcode.TEXT
            if not frame.fin:
                self._assembling = True
                self._fragments += frame.data
                return
            if self._assembling:
                self._fragments += frame.data
                data = bytes(self._fragments)
                self._drop_fragments()
            else:
                data = bytes(frame.data)
            text, self._fragment_text = self._fragment_text, False
            if not text:
                self._deliver(data)
                return
            try:
                self._deliver(data.decode())
            except UnicodeDecodeError as exc:
                self.protocol.fail(CloseCode.INVALID_DATA, f"{exc.reason} at position {exc.start}")
        elif opcode is Opcode.PONG and self._ping is not None and frame.data == self._ping:
            self._ping = None
            if self._ping_timer is not None:
                self._ping_timer.cancel()  # the timeout
            self._arm_keepalive()
        elif opcode is Opcode.CLOSE:
            self._wake()

    def _flush(self) -> None:
        """Write what websockets has to send; its end of stream starts the lingering close."""
        for data in self.protocol.data_to_send():
            if self._eof_sent:
                continue  # nothing follows the end of stream (websockets sends nothing after it)
            if data:
                self.transport.write(data)
            else:
                self._end_stream()
        if self.protocol.close_expected() and self._timer is None and not self.transport.is_closing():
            self._timer = self.loop.call_later(self._settings.close_timeout_s, self._abort)
            if self._ping_timer is not None:
                self._ping_timer.cancel()
            # The peer's close frame (or end of stream) must be read.
            self._reading_paused = self._yielding = False
            self._hold.cancel()
            self._update_reading()

    def _end_stream(self) -> None:
        """The server's end of stream: a lingering close. Half-close (the close frame and what
        precedes it still go out), then read and drop whatever the peer sends until its own end of
        stream (``eof_received`` closes the transport) or the close timeout (``_abort``). Closing at
        once would leave the peer's unread bytes in the kernel's queue, which answers them with a
        reset: a peer still sending, say a refused frame, would lose the close frame. Without
        half-close (TLS), or once the peer has ended its stream, the transport closes now."""
        self._eof_sent = True
        transport = self.transport
        self._reader.discard()  # websockets discards everything after its end of stream too
        self._report()
        if self.protocol.state is State.CLOSED or not transport.can_write_eof():
            transport.close()
        else:
            transport.write_eof()

    # ------------------------------------------------------------------ the handshake

    def _select(self, offered: Any) -> Subprotocol | None:
        chosen = self._hooks.select_subprotocol(self, list(offered))
        return None if chosen is None else Subprotocol(chosen)

    def _handshake(self, request: Any) -> None:
        assert isinstance(request, Request)
        self.request = request
        protocol = self.protocol
        try:
            response = self._hooks.process_request(self, request)
            if response is None:
                response = protocol.accept(request)
            self._hooks.process_response(self, request, response)
        except Exception:
            log.exception("opening handshake failed")
            response = protocol.reject(500, "Failed to open a WebSocket connection.\n")
        self.response = response
        protocol.send_response(response)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if protocol.state is _OPEN:
            self.task = self.loop.create_task(self._run())
            self._arm_keepalive()

    async def _run(self) -> None:
        try:
            await self._hooks.handler(self)
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("session handler failed")
            self._close_now(CloseCode.INTERNAL_ERROR, "")
        self._close_now(CloseCode.NORMAL, "")
        try:
            await self.wait_closed()
        finally:
            self._hooks.forget(self)

    # ------------------------------------------------------------------ to the session

    async def next_message(self) -> Message:
        """The next message, in arrival order.

        Raises:
            ConnectionClosed: once the connection is closed and every message was taken.
        """
        while True:
            messages = self._messages
            if messages:
                message = messages.popleft()
                self._queued_bytes -= len(message)
                if self._reading_paused and len(messages) < self._settings.max_queued_messages \
                        and self._queued_bytes < self._queue_limit_bytes:
                    self._reading_paused = False
                    self._update_reading()
                self._report()
                return message
            if self._closed.done():
                raise self.protocol.close_exc
            if self._waiter is not None:
                raise ConcurrencyError("another coroutine is already waiting for the next message")
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def messages(self) -> AsyncIterator[Message]:
        """Every message until the connection closes normally (``ConnectionClosedError`` otherwise)."""
        try:
            while True:
                yield await self.next_message()
        except ConnectionClosedOK:
            return

    async def recv(self) -> Message:
        return await self.next_message()

    def send_now(self, data: bytes) -> bool:
        """Write ``data`` as one binary frame now when the connection is open and the write buffer
        has room below ``write_limit_bytes``; returns whether it was written (else :meth:`send`)."""
        transport = self.transport
        if (self.protocol.state is not _OPEN or self._writing_paused or transport.is_closing()
                or transport.get_write_buffer_size() + len(data) > self._settings.write_limit_bytes):
            return False
        length = len(data)
        if length < 65536:
            transport.write(frame_header(length) + data)
        else:
            transport.writelines((frame_header(length), data))
        return True

    async def send(self, data: bytes | str) -> None:
        """Send one message, waiting while the peer does not read (the caller bounds the wait).

        Raises:
            ConnectionClosed: the connection is closed.
        """
        if self.protocol.state is not _OPEN:
            await self.wait_closed()  # closing: once closed, the reason is known
            raise self.protocol.close_exc
        if isinstance(data, str):
            self.protocol.send_text(data.encode())
            self._flush()
        elif not self.send_now(data):
            self.protocol.send_binary(data)
            self._flush()
        while self._writing_paused and not self.transport.is_closing():
            if self._drain is None or self._drain.done():
                self._drain = self.loop.create_future()
            await asyncio.shield(self._drain)  # shared by every sender waiting
        if self._closed.done():
            raise self.protocol.close_exc

    async def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        """Start the closing handshake (if open) and wait for the connection to end."""
        self._close_now(code, reason)
        await self.wait_closed()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def going_away(self) -> None:
        """The server is stopping: close with 1001 (or drop a handshake under way)."""
        if self.protocol.state is _CONNECTING and self.transport is not None:
            self.transport.close()
        self._close_now(CloseCode.GOING_AWAY, "")

    def refuse_for_budget(self) -> None:
        """Close with 1013 at once, dropping what was buffered; the budget released it already."""
        state = self.protocol.state
        if state is _CONNECTING:
            log.info("dropping a connection holding bytes before its handshake was answered: receive budget full")
            self.transport.abort()
        elif state is _OPEN:
            log.info("closing a session of tenant %s: receive budget full", self._tenant)
            self.protocol.fail(CloseCode.TRY_AGAIN_LATER, "server receive buffer budget full; retry later")
            self._reader.discard()
            self._messages.clear()
            self._queued_bytes = 0
            self._drop_fragments()
            self._flush()
            self._wake()
        else:
            return
        if self.budget is not None and self.budget.on_refused is not None:
            self.budget.on_refused()

    # ------------------------------------------------------------------ internals

    def _drop_fragments(self) -> None:
        self._fragments = bytearray()  # a fresh one: clear() would keep the old one's capacity
        self._assembling = False

    def _close_now(self, code: int, reason: str) -> None:
        if self.protocol.state is _OPEN:
            self.protocol.send_close(code, reason)
            self._flush()
            self._wake()

    def _report(self) -> None:
        budget = self.budget
        if budget is None:
            return
        for victim in budget.update(self, self._tenant, self.held_bytes()):
            assert isinstance(victim, BudgetedConnection)
            victim.refuse_for_budget()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _update_reading(self) -> None:
        """Pause or resume the transport's reading to match the reasons to pause (see __init__)."""
        pause = self._reading_paused or self._hold.active or self._yielding
        if pause is not self._transport_paused and not self.transport.is_closing():
            self._transport_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _hold_changed(self) -> None:
        """A hold started or ended; at its end the body gate is asked again about the frame it
        held (the answer may have changed with the time, the budget) before reading goes on."""
        if not self._hold.active and self.protocol.state is _OPEN:
            self._reader.peek_again()
        self._update_reading()

    def _yield_turn(self) -> None:
        """After a read of :data:`READ_BYTES`: no more reads until the loop's next turn. uvloop
        (libuv) reads a ready socket up to 32 times in a row, so a few peers sending huge frames
        would otherwise take tens of megabytes of reads each per turn from everyone else."""
        if not self._yielding:
            self._yielding = True
            self._update_reading()
            self.loop.call_soon(self._end_turn)

    def _end_turn(self) -> None:
        self._yielding = False
        self._update_reading()

    def _abort(self) -> None:
        self._timer = None
        self.transport.abort()

    def _open_timed_out(self) -> None:
        self._timer = None
        if self.protocol.state is _CONNECTING:
            self.transport.abort()

    def _arm_keepalive(self) -> None:
        interval = self._settings.ping_interval_s
        if interval is not None and self.protocol.state is _OPEN:
            self._ping_timer = self.loop.call_later(interval, self._send_ping)

    def _send_ping(self) -> None:
        self._ping_timer = None
        if self.protocol.state is not _OPEN:
            return
        self._ping = os.urandom(4)
        self.protocol.send_ping(self._ping)
        self._flush()
        self._ping_timer = self.loop.call_later(self._settings.ping_interval_s or 20.0, self._ping_timed_out)

    def _ping_timed_out(self) -> None:
        self._ping_timer = None
        if self._ping is not None and self.protocol.state is _OPEN:
            self.protocol.fail(CloseCode.INTERNAL_ERROR, "keepalive ping timeout")
            self._flush()
            self._wake()


def protocol_factory(hooks: Hooks, settings: ConnectionSettings, budget: ReceiveBudget | None) -> Callable[[], BudgetedConnection]:
    """The protocol factory ``loop.create_server`` takes."""
    return lambda: BudgetedConnection(hooks, settings, budget)
