"""A WebSocket frame's large payload received straight into its own buffer.

websockets' stream reader appends every read the transport hands it to one ``bytearray`` (a copy,
and reallocations as it grows) and slices each frame's payload out of it (a second copy) before
unmasking it (a third). :class:`PayloadReader` is websockets' reader, except for a read of at least
:data:`DIRECT_MIN_BYTES` (only a frame's payload is that large): it gets a buffer of exactly that
size, into which the rest of the payload arrives.

:class:`DirectReads` goes one step further: it stands between the transport and websockets'
connection as a buffered protocol, so that while a large payload is arriving the event loop reads
the socket straight into its buffer (``recv_into``), with no bytes object per read and no copy out
of it. (The loops read into a buffered protocol only if it is not also an ``asyncio.Protocol``, and
websockets' connections are: hence a protocol of its own, put in with ``transport.set_protocol``.)
A 441 KiB observation then costs the kernel's copy into its buffer and websockets' unmasking into
the message, where websockets alone makes five passes over it (the kernel's, the transport's bytes
object, its stream buffer, the slice, the unmasking).

Sizes still come from websockets' parser, after its ``max_size`` check: nothing here trusts the
wire more than websockets does. A buffer is allocated without being written, so the memory a
client makes the server hold is still what it has sent (the receive budget counts
:attr:`PayloadReader.held`), not what a frame header claims; up to :data:`POOL_BUFFERS` buffers of
at most :data:`POOL_BUFFER_BYTES` are kept for reuse.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Protocol as TypingProtocol

import numpy as np
from websockets.protocol import Protocol
from websockets.streams import StreamReader

__all__ = ["PayloadReader", "DirectReads", "DIRECT_MIN_BYTES", "SCRATCH_BYTES", "install"]

#: Reads at least this large are received into a buffer of their own. Frame headers are at most
#: 14 bytes and handshake lines are read line by line: only payloads reach it.
DIRECT_MIN_BYTES = 64 * 1024
#: Payload buffers kept for the next payloads, per thread (the loop's): at most this many, of at
#: most this size each, so at most 8 MiB kept. A fresh buffer per message is not free: once the
#: allocator hands such sizes out as fresh mappings, every page of every message faults in anew.
POOL_BUFFERS = 8
POOL_BUFFER_BYTES = 1 << 20
#: What :class:`DirectReads` reads between payloads (frame headers, small messages, the start of a
#: large payload): at most this much of a large payload is copied on its way into its buffer.
SCRATCH_BYTES = 64 * 1024

_pools = threading.local()


def _free_buffers() -> list[np.ndarray]:
    try:
        free: list[np.ndarray] = _pools.free
    except AttributeError:
        free = _pools.free = []
    return free


def _take(n: int) -> np.ndarray:
    free = _free_buffers()
    for i, buf in enumerate(free):
        if buf.size >= n:
            return free.pop(i)
    # Not written here: pages are touched only as the peer's bytes arrive.
    return np.empty(n, dtype=np.uint8)


def _give_back(buf: np.ndarray) -> None:
    free = _free_buffers()
    if buf.size <= POOL_BUFFER_BYTES and len(free) < POOL_BUFFERS:
        free.append(buf)


class PayloadReader(StreamReader):
    """websockets' :class:`~websockets.streams.StreamReader`, with a large payload received into a
    buffer of its own.

    A ``read_exact`` of at least :data:`DIRECT_MIN_BYTES` (only a frame's payload is that large)
    gets a buffer of exactly that size: what the stream buffer already holds of it is moved there,
    and what arrives after goes straight in, copied by :meth:`feed_data` or written by the
    transport itself (:class:`DirectReads`).

    Attributes:
        payload: the buffer of the large read in progress (``None`` when none is).
        filled: how many of its bytes have arrived.
    """

    def __init__(self) -> None:
        super().__init__()
        self.payload: memoryview | None = None
        self.filled = 0
        # The buffer of the payload returned last: websockets' server protocol unmasks it into a
        # new ``bytes`` before it reads anything else, so it is free again at the next read.
        self._returned: np.ndarray | None = None

    @property
    def held(self) -> int:
        """Bytes received and not yet returned by a read."""
        return len(self.buffer) + self.filled

    def read_exact(self, n: int) -> Generator[None, None, bytearray]:
        if self._returned is not None:  # tested here: four reads per frame, one call fewer each
            self._recycle()
        if n < DIRECT_MIN_BYTES or len(self.buffer) >= n:
            return (yield from super().read_exact(n))
        buf = _take(n)
        payload = buf.data[:n]
        have = len(self.buffer)
        payload[:have] = self.buffer
        del self.buffer[:]
        self.payload, self.filled = payload, have
        try:
            while self.filled < n:
                if self.eof:
                    raise EOFError(f"stream ends after {self.filled} bytes, expected {n} bytes")
                yield
        except BaseException:
            _give_back(buf)
            raise
        finally:
            self.payload, self.filled = None, 0
        self._returned = buf
        # websockets' parser only unmasks it (a copy into a new ``bytes``): a memoryview serves
        # as well as the bytearray the annotation of the method it overrides promises.
        return payload  # type: ignore[return-value]

    def _recycle(self) -> None:
        returned = self._returned
        if returned is not None:
            self._returned = None
            _give_back(returned)

    def feed_data(self, data: bytes | bytearray | memoryview) -> None:
        payload = self.payload
        if payload is not None and data:
            take = min(len(data), len(payload) - self.filled)
            payload[self.filled:self.filled + take] = memoryview(data)[:take]
            self.filled += take
            data = memoryview(data)[take:]
        super().feed_data(data)  # type: ignore[arg-type]  # the rest (any size: bytearray += takes a buffer)

    def discard(self) -> None:
        self._recycle()
        self.payload, self.filled = None, 0
        super().discard()


def install(protocol: Protocol) -> PayloadReader:
    """Make ``protocol`` (a websockets sans-I/O protocol that has received nothing yet) read
    through a new :class:`PayloadReader`, its parser restarted on it; returns the reader."""
    reader = protocol.reader = PayloadReader()
    protocol.parser = protocol.parse()
    next(protocol.parser)
    return reader


class _Connection(TypingProtocol):
    """What :class:`DirectReads` forwards to: websockets' asyncio connection (an ``asyncio.Protocol``)."""

    def data_received(self, data: bytes) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


def _scratch() -> memoryview:
    try:
        scratch: memoryview = _pools.scratch
    except AttributeError:
        scratch = _pools.scratch = memoryview(bytearray(SCRATCH_BYTES))
    return scratch


class DirectReads(asyncio.BufferedProtocol):
    """The transport's protocol for a websockets connection reading through a :class:`PayloadReader`:
    while a large payload is arriving, the socket is read straight into the payload's buffer.

    Every other read (handshake, frame headers, small messages, the start of a payload) goes into
    a scratch buffer of :data:`SCRATCH_BYTES`, shared by the thread's connections, and on to the
    connection's ``data_received`` as a view, which websockets' reader copies what it keeps from
    before returning. A read into the payload is announced to the connection as an empty
    ``data_received``, so that its parser and the receive budget see each read as before; the
    payload's size is websockets' (after its ``max_size`` check) and a read never goes past it.
    Everything else the transport says goes to the connection unchanged.
    """

    def __init__(self, connection: _Connection, reader: PayloadReader) -> None:
        self._connection = connection
        self._reader = reader
        self._into_payload = False  # what get_buffer handed out last: the payload or the scratch

    def get_buffer(self, sizehint: int) -> memoryview:
        reader = self._reader
        payload = reader.payload
        if payload is not None:
            self._into_payload = True
            return payload[reader.filled:]
        self._into_payload = False
        return _scratch()

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_payload:
            self._reader.filled += nbytes
            self._connection.data_received(b"")
        else:
            # A view of the scratch: websockets' reader copies it into its own buffer (or the
            # payload's) before data_received returns, so the next read may reuse it.
            self._connection.data_received(_scratch()[:nbytes])  # type: ignore[arg-type]

    def eof_received(self) -> bool | None:
        return self._connection.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection.connection_lost(exc)

    def pause_writing(self) -> None:
        self._connection.pause_writing()

    def resume_writing(self) -> None:
        self._connection.resume_writing()
