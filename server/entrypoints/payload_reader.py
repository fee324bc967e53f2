"""A WebSocket frame's large payload received straight into its own buffer.

websockets' stream reader appends every read the transport hands it to one ``bytearray`` (a copy,
and reallocations as it grows) and slices each frame's payload out of it (a second copy) before
unmasking it (a third). :class:`PayloadReader` is websockets' reader, except for a read of at least
:data:`DIRECT_MIN_BYTES` (only a frame's payload is that large): it gets a buffer of exactly that
size, and the reads that arrive meanwhile are copied straight into it. A 441 KiB observation is
then copied twice in the server's own code, not three times.

(A buffered protocol, reading the socket straight into that buffer, would save the transport's copy
too, but uvloop reads into a buffered protocol only if it is not also an ``asyncio.Protocol``, and
websockets' connections are.)

Sizes still come from websockets' parser, after its ``max_size`` check: nothing here trusts the
wire more than websockets does. The buffer is allocated without being written, so the memory a
client makes the server hold is still what it has sent (the receive budget counts
:attr:`PayloadReader.held`), not what a frame header claims.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np
from websockets.protocol import Protocol
from websockets.streams import StreamReader

__all__ = ["PayloadReader", "DIRECT_MIN_BYTES", "install"]

#: Reads at least this large are received into a buffer of their own. Frame headers are at most
#: 14 bytes and handshake lines are read line by line: only payloads reach it.
DIRECT_MIN_BYTES = 64 * 1024


class PayloadReader(StreamReader):
    """websockets' :class:`~websockets.streams.StreamReader`, with large reads filled in place.

    Attributes:
        payload: the buffer of the large read in progress (``None`` when none is).
        filled: how many of its bytes have arrived.
    """

    def __init__(self) -> None:
        super().__init__()
        self.payload: memoryview | None = None
        self.filled = 0

    @property
    def held(self) -> int:
        """Bytes received and not yet returned by a read."""
        return len(self.buffer) + self.filled

    def read_exact(self, n: int) -> Generator[None, None, bytearray]:
        if n < DIRECT_MIN_BYTES or len(self.buffer) >= n:
            return (yield from super().read_exact(n))
        # Not written here: pages are touched only as the peer's bytes arrive.
        payload = np.empty(n, dtype=np.uint8).data
        have = len(self.buffer)
        payload[:have] = self.buffer
        del self.buffer[:]
        self.payload, self.filled = payload, have
        try:
            while self.filled < n:
                if self.eof:
                    raise EOFError(f"stream ends after {self.filled} bytes, expected {n} bytes")
                yield
        finally:
            self.payload, self.filled = None, 0
        # websockets' parser only unmasks it (a copy into a new ``bytes``): a memoryview serves
        # as well as the bytearray the annotation of the method it overrides promises.
        return payload  # type: ignore[return-value]

    def feed_data(self, data: bytes | bytearray | memoryview) -> None:
        payload = self.payload
        if payload is not None and data:
            take = min(len(data), len(payload) - self.filled)
            payload[self.filled:self.filled + take] = memoryview(data)[:take]
            self.filled += take
            data = memoryview(data)[take:]
        super().feed_data(data)  # type: ignore[arg-type]  # the rest (any size: bytearray += takes a buffer)

    def discard(self) -> None:
        self.payload, self.filled = None, 0
        super().discard()


def install(protocol: Protocol) -> PayloadReader:
    """Make ``protocol`` (a websockets sans-I/O protocol that has received nothing yet) read
    through a new :class:`PayloadReader`, its parser restarted on it; returns the reader."""
    reader = protocol.reader = PayloadReader()
    protocol.parser = protocol.parse()
    next(protocol.parser)
    return reader
