"""A connection's incoming WebSocket frames, read by the server itself: a final binary frame lands
in a buffer of its own, straight from the socket, unmasked in place, and reaches the session as a
read-only view of that buffer (one copy, the kernel's); every other frame goes, byte for byte, to
websockets' sans-I/O ``ServerProtocol``, which parses, answers and judges it.

Invariants: the reader follows the stream frame by frame from the end of the handshake request on,
so websockets' parser only ever sees whole frames and stays at a frame boundary; a frame is read
here only while ``may_read`` says no message is under way there; a size comes from a header but is
checked against the limit before any buffer is made, and a buffer is written only as the peer's
bytes arrive, so what a connection holds (:attr:`FrameReader.held`, bytes handed to websockets for
a frame it has not completed included) is what it sent, up to the end of the huge page the last
byte lies in for a mapped buffer. Sans-I/O: :mod:`.connection` wires it.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Callable

import numpy as np
from websockets.frames import apply_mask

__all__ = ["FrameReader", "BufferPool", "DIRECT_MIN_BYTES", "HUGE_PAGE_BYTES", "READ_BYTES", "POOL_MAPPED_BYTES", "SCRATCH_BYTES",
           "UNMASK_PASS_BYTES", "huge_page_offset", "mapped_buffer", "mask_arrays", "resident_bytes", "small_pages_end",
           "unmask_in_place"]

#: Payloads at least this large are read from the socket straight into a buffer of their own.
#: Smaller ones are unmasked into a ``bytes`` from the scratch buffer (one copy, in C).
DIRECT_MIN_BYTES = 64 * 1024
#: What the reader reads between payloads (frame headers, small frames, a payload's first bytes).
SCRATCH_BYTES = 64 * 1024
#: The most of a payload one read takes: an ALOHA-sized observation (441 KiB) still arrives in one
#: read, while the readers of huge frames on one loop take turns of at most this many bytes.
READ_BYTES = 512 * 1024
#: Payload buffers kept per thread for reuse: at most this many, of at most this size each (8 MiB
#: kept at most). A fresh buffer per message is not free: once the allocator hands such sizes out
#: as fresh mappings, every page of every message faults in anew.
POOL_BUFFERS = 8
POOL_BUFFER_BYTES = 1 << 20
#: Payload mappings (larger than :data:`POOL_BUFFER_BYTES`) kept per thread for reuse, in all:
#: a fresh mapping's pages are zeroed by the kernel as the peer's bytes first touch them, which
#: costs a loop thread several times the read itself; a kept one's pages are resident already.
#: Each is a whole number of huge pages, so messages of nearby sizes share one.
POOL_MAPPED_BYTES = 64 << 20
#: The transparent huge page a large payload's mapping asks for past its first ones: a fresh
#: mapping's pages fault in 512 times fewer (and free as fast). A frame's first bytes (those a body
#: gate peeks at) stay on small pages, so a frame held after them holds a few pages, not a huge one.
HUGE_PAGE_BYTES = 2 * 1024 * 1024
#: A large payload is unmasked in passes over what has arrived, each of at least this many bytes
#: (and the rest once it is complete): one pass for an observation of up to this size, whatever
#: the reads it came in. A pass per read cost the reply's critical path 11.8 us more on a 441 KiB
#: observation read in two (in-process A/B: numpy's call per piece, a head and a tail of a few bytes
#: each, and the first read's 64 KiB unmasked apart), while the passes stay within a core's cache.
UNMASK_PASS_BYTES = 1 << 20

_FIN_BINARY = 0x82  # FIN, no reserved bits, opcode 2
_MASKED = 0x80
_LEN16, _LEN64 = 126, 127


def mask_arrays(mask: bytes) -> tuple[np.ndarray, np.uint64]:
    """A frame's 4-byte mask as :func:`unmask_in_place` takes it: the mask three times over
    (bytes from any phase, up to 8 of them) and the mask twice as one 8-byte word."""
    tiled = np.frombuffer(mask * 3, np.uint8)
    return tiled, tiled[:8].view(np.uint64)[0]


def unmask_in_place(buf: np.ndarray, start: int, end: int, tiled: np.ndarray, word: np.uint64) -> None:
    """XOR ``buf[start:end]`` (uint8, the bytes at those offsets of a payload starting at offset 0)
    with the frame's mask (:func:`mask_arrays`), in place: 8 bytes at a time between 8-aligned
    offsets."""
    if end <= start:
        return
    head_end = min(end, (start + 7) & ~7)
    if head_end > start:
        phase = start & 3
        buf[start:head_end] ^= tiled[phase:phase + head_end - start]
    body_end = end & ~7
    if body_end > head_end:  # an 8-aligned offset is a multiple of 4: the mask's phase is 0
        words = buf[head_end:body_end].view(np.uint64)
        np.bitwise_xor(words, word, out=words)
    tail_start = max(head_end, body_end)
    if end > tail_start:
        buf[tail_start:end] ^= tiled[:end - tail_start]


def mapped_buffer(n: int) -> np.ndarray:
    """``n`` bytes of their own private anonymous mapping, given back to the system when the last
    view of them goes: a buffer larger than the pool keeps never lands in the allocator's heap,
    where a freed one would stay (glibc also raises its mapping threshold to the largest size it
    freed, so later buffers up to that size would land there too). Private, not shared (no shmem
    file to fill and truncate); past :func:`small_pages_end`, advised to use huge pages where the
    system allows it (:func:`resident_bytes` counts what that makes resident)."""
    mapping = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
    buf = np.frombuffer(mapping, np.uint8)
    small = small_pages_end(huge_page_offset(buf))
    if _MADV_HUGEPAGE is not None and n > small:
        try:
            mapping.madvise(_MADV_HUGEPAGE, small, n - small)
        except OSError:  # huge pages disabled: small pages then
            pass
    return buf


def huge_page_offset(buf: np.ndarray) -> int:
    """Where ``buf`` starts within its huge page."""
    address: int = buf.__array_interface__["data"][0]
    return address % HUGE_PAGE_BYTES


def small_pages_end(offset: int) -> int:
    """Where a mapped buffer starting ``offset`` bytes into a huge page may start using huge pages:
    the second huge page boundary from its start, at least :data:`HUGE_PAGE_BYTES` in."""
    return -(-(offset + HUGE_PAGE_BYTES) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES - offset


def resident_bytes(offset: int, size: int, filled: int) -> int:
    """What a mapped buffer (:func:`mapped_buffer`) of ``size`` bytes starting ``offset`` bytes
    into a huge page, written from its start up to ``filled``, may hold resident: what was written
    on its small pages, up to the end of the huge page its last written byte lies in past them."""
    if filled <= small_pages_end(offset):
        return filled
    return min(size, -(-(offset + filled) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES - offset)


_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


class BufferPool:
    """Payload buffers of one thread, reused once nothing refers to them any more, and the
    thread's scratch buffer.

    A delivered message is a view of its buffer, and so is every array decoded from it: a buffer
    is handed out again only when the pool's own reference is the last one (CPython's reference
    count), so a request still queued or running, or a policy keeping an observation, never sees
    its bytes overwritten. Buffers up to ``buffer_bytes`` come from the allocator (at most
    ``buffers`` kept); larger ones are mappings (:func:`mapped_buffer`), kept while their sizes
    add up to at most ``mapped_bytes``. The scratch (:attr:`scratch`) is where a read lands between
    payloads; its bytes are sorted before the read's callback returns, so the connections of one
    thread (one event loop) share it, and the sink (:attr:`sink`), where a dropped payload's bytes land.
    """

    def __init__(self, buffers: int = POOL_BUFFERS, buffer_bytes: int = POOL_BUFFER_BYTES,
                 mapped_bytes: int = POOL_MAPPED_BYTES) -> None:
        self.buffers = buffers
        self.buffer_bytes = buffer_bytes
        self.mapped_bytes = mapped_bytes
        self._kept: list[np.ndarray] = []
        self._mapped: list[np.ndarray] = []
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))
        self.sink = memoryview(bytearray(READ_BYTES))

    @property
    def kept_mapped_bytes(self) -> int:
        """The sizes of the mappings kept for reuse, in use or not."""
        return sum(buf.size for buf in self._mapped)

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes that nothing else refers to (contents undefined)."""
        if n > self.buffer_bytes:
            return self._take_mapped(n)
        kept = self._kept
        for i in range(len(kept)):
            # Two references when unused: the list's and getrefcount's argument.
            if kept[i].size >= n and sys.getrefcount(kept[i]) == 2:
                return kept[i]
        # Not written here: pages are touched only as the peer's bytes arrive.
        buf = np.empty(n, np.uint8)
        if len(kept) < self.buffers:
            kept.append(buf)
        else:  # every kept buffer in use or too small: replace the smallest unused one, if any
            unused = [i for i in range(len(kept)) if sys.getrefcount(kept[i]) == 2]
            if unused:
                kept[min(unused, key=lambda i: kept[i].size)] = buf
        return buf

    def _take_mapped(self, n: int) -> np.ndarray:
        """The smallest unused kept mapping of at least ``n`` bytes, else a fresh one of whole huge
        pages, kept if it fits beside the others (unused ones give way, largest first)."""
        mapped = self._mapped
        unused = [i for i in range(len(mapped)) if sys.getrefcount(mapped[i]) == 2]
        fitting = [i for i in unused if mapped[i].size >= n]
        if fitting:
            return mapped[min(fitting, key=lambda i: mapped[i].size)]
        size = -(-n // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        room = self.mapped_bytes - self.kept_mapped_bytes
        unused.sort(key=lambda i: mapped[i].size, reverse=True)
        if room + sum(mapped[i].size for i in unused) < size:
            return mapped_buffer(n)  # not kept: the mappings in use fill the pool
        dropped = set()
        for i in unused:
            if room >= size:
                break
            room += mapped[i].size
            dropped.add(i)
        buf = mapped_buffer(size)
        self._mapped = [b for i, b in enumerate(mapped) if i not in dropped] + [buf]
        return buf


_pools = threading.local()


def thread_pool() -> BufferPool:
    """The calling thread's buffer pool (a connection's reads all run on its loop's thread)."""
    try:
        pool: BufferPool = _pools.pool
    except AttributeError:
        pool = _pools.pool = BufferPool()
    return pool


# What the reader is doing with the bytes of the frame under way (_DROP: reading a dropped payload's rest).
_HEADER, _FORWARD, _SMALL, _LARGE, _DROP = range(5)
# Where get_buffer pointed the last read: the scratch, the payload's buffer, the sink.
_INTO_SCRATCH, _INTO_PAYLOAD, _INTO_SINK = range(3)
# The handshake: bytes go to websockets until the request's head has ended; CLOSED: dropped.
_HANDSHAKE, _FRAMES, _CLOSED = range(3)


class FrameReader:
    """One connection's frames: the transport's reads go where :meth:`get_buffer` says, and
    :meth:`buffer_updated` sorts them into messages read here and bytes for websockets.

    Its attributes are one frame's parse state (header, mask, payload, fill) and the callbacks and
    buffers it sorts reads into: the per-read hot path, kept on one object so each read touches one.

    Args:
        deliver: called with each complete binary message read here: a ``bytes`` (small) or a
            read-only ``memoryview`` of its buffer.
        forward: called with bytes websockets must parse (a view valid during the call only); the
            handshake request's bytes are answered before it returns.
        may_read: whether the next binary frame may be read here: the connection open and no
            fragmented message under way (asked at each frame's header).
        max_size: the largest frame payload websockets accepts (``None``: no limit; then only
            frames smaller than :data:`DIRECT_MIN_BYTES` are read here).
        pool: where payload buffers come from (the thread's pool by default).
        unmask_pass_bytes: the least a pass of the unmasking covers before the payload is
            complete (:data:`UNMASK_PASS_BYTES`).
        read_bytes: the most of a payload one read takes (:data:`READ_BYTES`).
        peeked: called with a large payload's first :attr:`peek_bytes` (unmasked, a view valid
            during the call) and its length, before any more of it is read; the connection may
            pause reading then (see :mod:`.peek`). Nothing is peeked while :attr:`peek_bytes` is 0.
    """

    def __init__(self, deliver: Callable[[bytes | memoryview], None], forward: Callable[[memoryview], None],
                 may_read: Callable[[], bool], max_size: int | None, pool: BufferPool | None = None,
                 unmask_pass_bytes: int = UNMASK_PASS_BYTES, read_bytes: int = READ_BYTES,
                 peeked: Callable[[memoryview, int], None] | None = None) -> None:
        self._deliver = deliver
        self._peeked = peeked
        self.peek_bytes = 0
        self._peek_at = 0  # _LARGE: the payload's bytes to read before peeked is called (0: none)
        self._peeked_bytes = 0  # _LARGE: how many of the payload's first bytes peeked was called with
        self._read_bytes = read_bytes
        self._unmask_pass = unmask_pass_bytes
        self._forward = forward
        self._may_read = may_read
        self._max_size = max_size
        self._pool = pool if pool is not None else thread_pool()
        self._scratch = self._pool.scratch
        self._stage = _HANDSHAKE
        self._tail = b""  # the handshake's last bytes, for a "\r\n\r\n" split between reads
        self._state = _HEADER
        self._head = bytearray()  # a header split between reads
        self._left = 0  # bytes of the current frame's payload still to come (_FORWARD, _SMALL)
        self._mask = b""
        self._tiled, self._word = mask_arrays(b"\0\0\0\0")  # _LARGE: the mask as unmask_in_place takes it
        self._small = bytearray()  # a small payload split between reads (masked)
        self._payload: memoryview | None = None  # _LARGE: the buffer's bytes for this payload
        self._buf: np.ndarray | None = None
        self._filled = 0
        self._huge_offset = -1  # _LARGE in a mapped buffer: where it starts in its huge page (held counts those)
        self._payload_size = 0
        self._unmasked = 0  # _LARGE: the payload's bytes unmasked so far (the first ones)
        self._into = _INTO_SCRATCH  # what get_buffer handed out last
        self._pending = 0  # bytes handed to websockets of a frame (or the request) not yet complete

    @property
    def held(self) -> int:
        """Bytes of frames being read here that have not been delivered yet."""
        filled = self._filled
        if self._huge_offset >= 0:
            filled = resident_bytes(self._huge_offset, self._payload_size, filled)
        return len(self._head) + len(self._small) + filled + self._pending

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        payload = self._payload
        if payload is not None:
            # At most READ_BYTES of the payload per read: an observation of that size in one read,
            # and no connection's huge frame takes more than that of the loop's turn from the others.
            self._into = _INTO_PAYLOAD
            filled = self._filled
            if self._peek_at:
                return payload[filled:self._peek_at]
            return payload[filled:filled + self._read_bytes]
        if self._state == _DROP:
            self._into = _INTO_SINK
            return self._pool.sink[:min(self._left, self._read_bytes)]
        self._into = _INTO_SCRATCH
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        into = self._into
        if into == _INTO_PAYLOAD:
            self._filled += nbytes
            self._payload_grew()
            return
        if into == _INTO_SINK:
            self._left -= nbytes
            if not self._left:
                self._state = _HEADER
            return
        data = self._scratch[:nbytes]
        if self._stage == _FRAMES:
            self._frames(data)
        elif self._stage == _HANDSHAKE:
            self._handshake(data)

    def peek_again(self) -> None:
        """Call ``peeked`` (again) with the first bytes of the large payload under way: the answer
        may have changed since it was read on (a retry window opened meanwhile). One with fewer
        than :attr:`peek_bytes` of them read is peeked at once they are."""
        payload = self._payload
        if payload is None or not self.peek_bytes or self._peeked is None:
            return
        if not self._peeked_bytes:
            peek_at = min(self.peek_bytes, len(payload))
            if self._filled < peek_at:
                self._peek_at = peek_at
                return
            self._peeked_bytes = self._filled
            self._unmask_to(self._filled)
        self._peeked(payload[:self._peeked_bytes], len(payload))

    def drop_payload(self) -> None:
        """Deliver nothing of the large payload under way (asked by ``peeked``, whose caller has
        answered the message from its first bytes): its buffer goes now, and its rest is read
        into the thread's sink as it arrives, holding nothing, up to the next frame."""
        payload = self._payload
        if payload is None:
            return
        self._left = len(payload) - self._filled
        self._release_payload()
        self._state = _DROP if self._left else _HEADER

    def discard(self) -> None:
        """Drop what is under way (the connection is gone): nothing more is delivered."""
        self._release_payload()
        self._into = _INTO_SCRATCH
        self._state = _HEADER
        self._left = 0
        self._head.clear()
        self._small.clear()
        self._pending = 0
        self._stage = _CLOSED

    # ------------------------------------------------------------------ the handshake

    def _handshake(self, data: memoryview) -> None:
        """Bytes of the request to websockets, up to its end; the frames behind it are read as frames
        (websockets has answered the request by the time ``forward`` returns)."""
        tail = self._tail
        seen = tail + bytes(data)
        end = seen.find(b"\r\n\r\n")
        if end < 0:
            self._tail = seen[-3:]
            self._pending += len(data)
            self._forward(data)
            return
        request_end = end + 4 - len(tail)
        self._tail = b""
        self._pending = 0
        self._stage = _FRAMES
        self._forward(data[:request_end])
        if request_end < len(data) and self._stage == _FRAMES:
            self._frames(data[request_end:])

    # ------------------------------------------------------------------ frames

    def _frames(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        while pos < n and self._stage == _FRAMES:  # a delivery may close the connection
            state = self._state
            if state == _HEADER:
                pos = self._header(data, pos)
            elif state == _FORWARD:
                take = min(self._left, n - pos)
                self._left -= take
                if self._left == 0:
                    self._state = _HEADER
                    self._pending = 0
                else:
                    self._pending += take
                self._forward(data[pos:pos + take])
                pos += take
            elif state == _DROP:
                take = min(self._left, n - pos)
                self._left -= take
                pos += take
                if not self._left:
                    self._state = _HEADER
            elif state == _SMALL:
                take = min(self._left, n - pos)
                self._small += data[pos:pos + take]
                self._left -= take
                pos += take
                if self._left == 0:
                    message = apply_mask(self._small, self._mask)
                    self._small.clear()
                    self._state = _HEADER
                    self._deliver(message)
            else:  # _LARGE: the start of a payload that arrived with its header
                payload = self._payload
                assert payload is not None
                take = min(len(payload) - self._filled, n - pos)
                start = self._filled
                payload[start:start + take] = data[pos:pos + take]
                self._filled += take
                pos += take
                self._payload_grew()

    def _header(self, data: memoryview, pos: int) -> int:
        """Read a frame header from ``data[pos:]`` (and the bytes of it kept from the last
        read); returns where the data after it starts, or ``len(data)`` when it is incomplete."""
        head = self._head
        n = len(data)
        view: bytes | memoryview
        if head:
            take = min(14 - len(head), n - pos)
            view = bytes(head) + bytes(data[pos:pos + take])
            base = -len(head)  # offsets in view, relative to pos
        else:
            view = data[pos:pos + 14]
            base = 0
        if len(view) < 2:
            head += data[pos:n]
            return n
        b0, b1 = view[0], view[1]
        code = b1 & 0x7F
        size = 2 + (2 if code == _LEN16 else 8 if code == _LEN64 else 0) + (4 if b1 & _MASKED else 0)
        if len(view) < size:
            head += data[pos:n]
            return n
        if code == _LEN16:
            length = int.from_bytes(view[2:4], "big")
        elif code == _LEN64:
            length = int.from_bytes(view[2:10], "big")
        else:
            length = code
        after = pos + size + base  # where this frame's payload starts in data
        header = bytes(view[:size])
        head.clear()
        max_size = self._max_size
        # No size limit (websockets' max_size None): nothing large is read here, so no buffer is
        # ever sized by a header alone.
        too_large = length > max_size if max_size is not None else length >= DIRECT_MIN_BYTES
        if b0 != _FIN_BINARY or not b1 & _MASKED or too_large or not self._may_read():
            # websockets' frame: it parses (and judges) the header and everything up to the next one.
            self._left = length
            self._state = _FORWARD if length else _HEADER
            self._pending = size if length else 0
            self._forward(memoryview(header))
            return after
        self._mask = header[-4:]
        if length < DIRECT_MIN_BYTES:
            if n - after >= length:  # the whole payload is in this read: unmask it straight out
                self._deliver(apply_mask(data[after:after + length], self._mask))
                return after + length
            self._left = length
            self._state = _SMALL
            return after
        buf = self._pool.take(length)
        self._tiled, self._word = mask_arrays(self._mask)
        self._buf = buf
        self._payload = memoryview(buf)[:length]  # type: ignore[arg-type]  # numpy arrays export buffers
        self._payload_size = length
        self._huge_offset = huge_page_offset(buf) if buf.size > self._pool.buffer_bytes else -1
        self._filled = self._unmasked = self._peeked_bytes = 0
        self._peek_at = min(self.peek_bytes, length) if self._peeked is not None else 0
        self._state = _LARGE
        return after

    def _payload_grew(self) -> None:
        """After a large payload's bytes arrived: delivered once complete, else unmasked in a
        pass once a pass's worth of them waits."""
        filled = self._filled
        payload = self._payload
        assert payload is not None
        peek_at = self._peek_at
        if peek_at and filled >= peek_at:
            self._peek_at = 0
            self._peeked_bytes = filled
            self._unmask_to(filled)
            assert self._peeked is not None
            self._peeked(payload[:filled], len(payload))
            if self._payload is not payload:
                return  # dropped (drop_payload)
        if filled == len(payload):
            self._finish_large()
        elif filled - self._unmasked >= self._unmask_pass:
            self._unmask_to(filled)

    def _unmask_to(self, end: int) -> None:
        """Unmask the payload's bytes that arrived since the last pass, up to ``end``."""
        assert self._buf is not None
        unmask_in_place(self._buf, self._unmasked, end, self._tiled, self._word)
        self._unmasked = end

    def _finish_large(self) -> None:
        payload = self._payload
        assert payload is not None
        self._unmask_to(self._filled)
        self._release_payload()
        self._state = _HEADER
        self._deliver(payload.toreadonly())

    def _release_payload(self) -> None:
        """Forget the large payload under way (its buffer, fill, unmasking and peek)."""
        self._payload = self._buf = None
        self._filled = self._unmasked = self._peek_at = self._peeked_bytes = 0
        self._huge_offset = -1
