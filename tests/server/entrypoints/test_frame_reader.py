"""The server's own frame reader (:mod:`chunkline.server.entrypoints.frame_reader`): binary messages
read straight into buffers of their own and unmasked in place, everything else handed to
websockets, and what comes out is exactly what websockets alone makes of the same bytes.

Sans-I/O: the reader in front of websockets' server protocol, as the connection wires them, fed
a client's bytes (handshake, then frames) in reads of any size, against websockets' protocol fed
the same bytes alone as the oracle."""

from __future__ import annotations

import mmap
import random
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode, apply_mask
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from chunkline.client.wire.codec import Encoder, decode
from chunkline.server.entrypoints.frame_reader import (
    DIRECT_MIN_BYTES,
    HUGE_PAGE_BYTES,
    READ_BYTES,
    SCRATCH_BYTES,
    UNMASK_PASS_BYTES,
    BufferPool,
    FrameReader,
    huge_page_offset,
    mask_arrays,
    resident_bytes,
    small_pages_end,
    unmask_in_place,
)

MAX_SIZE = 4 << 20
Event = tuple[str, bytes]


def _handshake() -> bytes:
    client = ClientProtocol(parse_uri("ws://example.test/"))
    client.send_request(client.connect())
    return b"".join(client.data_to_send())


def _frame(opcode: Opcode, payload: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, payload, fin).serialize(mask=True)  # clients mask


class _Oracle:
    """websockets' server protocol alone: the handshake accepted, then every message (fragments
    joined) and control frame it makes of the bytes, in order."""

    def __init__(self, max_size: int = MAX_SIZE) -> None:
        self.protocol = ServerProtocol(max_size=max_size)
        self.events: list[Event] = []
        self._fragments: list[bytes] = []
        self._kind = ""

    def receive(self, data: bytes) -> None:
        self.protocol.receive_data(data)
        self._collect()

    def _collect(self) -> None:
        for event in self.protocol.events_received():
            if isinstance(event, Request):
                self.protocol.send_response(self.protocol.accept(event))
            elif event.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                if event.opcode is not Opcode.CONT:
                    self._kind = "text" if event.opcode is Opcode.TEXT else "binary"
                self._fragments.append(bytes(event.data))
                if event.fin:
                    self.events.append((self._kind, b"".join(self._fragments)))
                    self._fragments = []
            else:
                self.events.append((event.opcode.name.lower(), bytes(event.data)))

    def idle(self) -> bool:
        """The connection's test: open, no fragmented message under way."""
        return self.protocol.state is State.OPEN and not self._fragments


class _Wired(_Oracle):
    """The reader in front of websockets' protocol, as the server's connection wires them."""

    def __init__(self, max_size: int = MAX_SIZE, pool: BufferPool | None = None, unmask_pass_bytes: int = UNMASK_PASS_BYTES) -> None:
        super().__init__(max_size)
        self.delivered: list[bytes | memoryview] = []
        self.reader = FrameReader(self._deliver, self._forward, self.idle, max_size, pool or BufferPool(), unmask_pass_bytes)
        self.scratch_bytes = 0  # bytes that came through the scratch buffer

    def _deliver(self, message: bytes | memoryview) -> None:
        self.delivered.append(message)
        self.events.append(("binary", bytes(message)))

    def _forward(self, data: memoryview) -> None:
        self.receive(bytes(data))

    def open(self) -> _Wired:
        """The handshake, alone in its read (a client waits for the ``101`` before sending)."""
        handshake = _handshake()
        self.read(handshake, [len(handshake)])
        return self

    def read(self, stream: bytes, sizes: list[int]) -> None:
        """The transport's side of a buffered protocol: each read fills part of what get_buffer
        handed out (sizes cycle)."""
        pos, i = 0, 0
        while pos < len(stream):
            buf = self.reader.get_buffer(-1)
            n = min(len(buf), len(stream) - pos, sizes[i % len(sizes)])
            i += 1
            buf[:n] = stream[pos:pos + n]
            if not isinstance(buf.obj, np.ndarray):  # the scratch, not a payload's buffer
                self.scratch_bytes += n
            pos += n
            self.reader.buffer_updated(n)


def _compare(frames: bytes, sizes: list[int], unmask_pass_bytes: int = UNMASK_PASS_BYTES) -> _Wired:
    """The frames after an opening handshake, read in reads of ``sizes`` by the reader in front of
    websockets (unmasking large payloads in passes of ``unmask_pass_bytes``), against websockets alone."""
    wired, oracle = _Wired(unmask_pass_bytes=unmask_pass_bytes).open(), _Oracle()
    wired.read(frames, sizes)
    oracle.receive(_handshake())
    oracle.receive(frames)
    assert wired.events == oracle.events
    assert wired.protocol.state is oracle.protocol.state
    assert wired.reader.held == 0
    return wired


_SIZES = [0, 1, 125, 126, 127, 65535, 65536, DIRECT_MIN_BYTES - 1, DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1,
          262_147, 451_000]


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int], int]:
    """Frames of every kind a client sends, reads of any size, and the unmasking's pass size
    (passes that start and end anywhere in a payload, or one pass per payload)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    size = st.one_of(st.sampled_from(_SIZES), st.integers(0, 300_000))
    frames: list[bytes] = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["binary", "binary", "binary", "text", "fragmented", "ping", "pong"]))
        if kind == "binary":
            frames.append(_frame(Opcode.BINARY, rng.randbytes(draw(size))))
        elif kind == "text":
            frames.append(_frame(Opcode.TEXT, "é".encode() * draw(st.integers(0, 200))))
        elif kind == "fragmented":
            parts = [rng.randbytes(draw(size)) for _ in range(draw(st.integers(2, 3)))]
            frames.append(_frame(Opcode.BINARY, parts[0], fin=False))
            frames += [_frame(Opcode.CONT, p, fin=i == len(parts) - 2) for i, p in enumerate(parts[1:])]
        else:
            frames.append(_frame(Opcode.PING if kind == "ping" else Opcode.PONG, rng.randbytes(draw(st.integers(0, 125)))))
    if draw(st.booleans()):  # a close, and frames after it (which websockets ignores)
        frames.append(_frame(Opcode.CLOSE, b"\x03\xe8bye"))
        frames.append(_frame(Opcode.BINARY, rng.randbytes(draw(size))))
    sizes = draw(st.lists(st.one_of(st.integers(1, 20), st.integers(1, 400_000)), min_size=1, max_size=12))
    unmask_pass = draw(st.one_of(st.sampled_from([1, 7, 8, UNMASK_PASS_BYTES]), st.integers(1, 300_000)))
    return b"".join(frames), sizes, unmask_pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_streams())
@example((_frame(Opcode.BINARY, bytes(451_000)) + _frame(Opcode.PING, b"p") + _frame(Opcode.BINARY, b"x"), [1 << 30],
          UNMASK_PASS_BYTES))
@example((_frame(Opcode.BINARY, bytes(range(256)) * 1763), [65_536, 3, 100_000], 5))
def test_every_stream_cut_anywhere_comes_out_as_websockets_alone_makes_it(case: tuple[bytes, list[int], int]) -> None:
    stream, sizes, unmask_pass = case
    _compare(stream, sizes, unmask_pass)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_streams(), min_size=2, max_size=3), st.lists(st.integers(0, 2), min_size=1, max_size=40))
def test_connections_of_one_thread_share_its_scratch_and_read_in_any_interleaving(cases: list[tuple[bytes, list[int], int]],
                                                                               turns: list[int]) -> None:
    # One pool (one thread's loop) for every connection: each read's bytes are sorted before the
    # next connection's read lands in the same scratch.
    pool = BufferPool()
    wired = [_Wired(pool=pool, unmask_pass_bytes=unmask_pass).open() for _, _, unmask_pass in cases]
    assert len({id(w.reader.get_buffer(-1).obj) for w in wired}) == 1
    positions, reads = [0] * len(cases), [0] * len(cases)
    order = [t % len(cases) for t in turns]
    while any(positions[i] < len(case[0]) for i, case in enumerate(cases)):
        for i in order + list(range(len(cases))):
            stream, sizes, _ = cases[i]
            if positions[i] < len(stream):
                n = min(len(wired[i].reader.get_buffer(-1)), sizes[reads[i] % len(sizes)], len(stream) - positions[i])
                wired[i].read(stream[positions[i]:positions[i] + n], [n])
                positions[i] += n
                reads[i] += 1
    for (stream, _, _), w in zip(cases, wired, strict=True):
        oracle = _Oracle()
        oracle.receive(_handshake())
        oracle.receive(stream)
        assert w.events == oracle.events and w.reader.held == 0


def test_a_huge_payload_is_read_in_turns_of_at_most_read_bytes_and_an_observation_in_one() -> None:
    rng = random.Random(3)
    huge, observation = rng.randbytes(3 * READ_BYTES + 5), rng.randbytes(451_000)
    wired = _Wired().open()
    offered: list[int] = []
    stream = _frame(Opcode.BINARY, huge) + _frame(Opcode.BINARY, observation)
    pos = 0
    while pos < len(stream):  # a socket that always has the rest of the stream
        buf = wired.reader.get_buffer(-1)
        offered.append(len(buf))
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        pos += n
        wired.reader.buffer_updated(n)
    assert max(offered) == READ_BYTES
    assert [bytes(m) for m in wired.delivered] == [huge, observation]
    assert offered[-1] >= 451_000 - SCRATCH_BYTES  # the observation's rest in one read


def test_a_buffer_larger_than_the_pool_keeps_is_a_mapping_of_its_own_returned_when_unused() -> None:
    pool = BufferPool(buffers=2, buffer_bytes=1 << 20, mapped_bytes=0)
    big = pool.take(3 << 20)
    assert isinstance(big.base, memoryview) and isinstance(big.base.obj, mmap.mmap)
    assert big.size == 3 << 20 and big.flags.writeable
    mapping = weakref.ref(big.base.obj)
    view = memoryview(big)[:5].toreadonly()
    del big
    assert mapping() is not None  # a delivered message keeps its mapping
    del view
    assert mapping() is None  # unmapped once nothing refers to it: none are kept
    assert pool.take(500_000).base is None  # the pool's own sizes: kept and reused


def test_a_mapping_is_handed_out_again_once_unused_and_those_kept_stay_within_their_bytes() -> None:
    pool = BufferPool(buffers=2, buffer_bytes=1 << 20, mapped_bytes=16 << 20)
    first = pool.take(5_000_000)
    assert first.size == 6 << 20  # whole huge pages: a message of a nearby size reuses it
    address = first.__array_interface__["data"][0]
    view = memoryview(first)[:10].toreadonly()
    del first
    second = pool.take(5_000_000)
    assert second.__array_interface__["data"][0] != address  # the view keeps the first in use
    del view
    again = pool.take(4_500_000)
    assert again.__array_interface__["data"][0] == address  # unused again: its pages are resident already
    assert pool.kept_mapped_bytes == 12 << 20
    third = pool.take(5_000_000)  # the kept ones in use, no room for a third: a fresh one, not kept
    assert pool.kept_mapped_bytes == 12 << 20 and third.size == 5_000_000
    del again, second, third
    big = pool.take(10 << 20)  # room is made: unused ones give way
    assert pool.kept_mapped_bytes <= 16 << 20 and big.size == 10 << 20
    assert pool.take((16 << 20) + 1).size == (16 << 20) + 1  # larger than every kept mapping together: never kept
    assert pool.kept_mapped_bytes <= 16 << 20


def test_consecutive_large_messages_of_a_connection_reuse_one_mapping() -> None:
    rng = random.Random(2)
    payloads = [rng.randbytes(3_000_000), rng.randbytes(2_900_000)]
    taken: list[weakref.ref[np.ndarray]] = []  # weak: the test's own reference would keep a buffer in use
    pool = BufferPool()
    take = pool.take
    pool.take = lambda n: (buf := take(n), taken.append(weakref.ref(buf)))[0]  # type: ignore[method-assign]
    wired = _Wired(pool=pool).open()
    for payload in payloads:
        wired.read(_frame(Opcode.BINARY, payload), [READ_BYTES])
        (message,) = wired.delivered
        assert bytes(message) == payload  # nothing of the message before it shows through
        wired.delivered.clear()
        del message
    assert len(taken) == 2 and taken[1]() is taken[0]() is not None


def test_large_binary_messages_are_read_straight_into_their_own_buffers_and_come_out_read_only() -> None:
    rng = random.Random(1)
    payloads = [rng.randbytes(n) for n in (451_000, DIRECT_MIN_BYTES, 3_000_000)]
    wired = _compare(b"".join(_frame(Opcode.BINARY, p) for p in payloads), [1 << 30])
    assert [bytes(m) for m in wired.delivered] == payloads
    for message in wired.delivered:
        assert isinstance(message, memoryview) and message.readonly
        assert isinstance(message.obj, np.ndarray)  # the buffer the socket was read into
    # Only each frame's first read went through the scratch buffer: the rest was read in place.
    assert wired.scratch_bytes <= len(_handshake()) + 3 * SCRATCH_BYTES


def test_small_binary_messages_come_out_as_bytes() -> None:
    wired = _compare(_frame(Opcode.BINARY, b"hello") + _frame(Opcode.BINARY, b""), [7])
    assert wired.delivered == [b"hello", b""]


def test_a_ping_between_large_frames_is_answered_by_websockets() -> None:
    stream = _frame(Opcode.BINARY, bytes(200_000)) + _frame(Opcode.PING, b"hi") + _frame(Opcode.BINARY, bytes(70_000))
    wired = _Wired().open()
    wired.protocol.data_to_send()  # the 101
    wired.read(stream, [65_536])
    sent = b"".join(wired.protocol.data_to_send())
    assert Frame(Opcode.PONG, b"hi").serialize(mask=False) in sent
    assert [kind for kind, _ in wired.events] == ["binary", "ping", "binary"]


def test_after_a_fragmented_message_binary_frames_are_read_here_again() -> None:
    stream = (_frame(Opcode.BINARY, bytes(100_000), fin=False) + _frame(Opcode.CONT, b"end")
              + _frame(Opcode.BINARY, bytes(100_000)))
    wired = _compare(stream, [4096])
    assert len(wired.delivered) == 1 and isinstance(wired.delivered[0], memoryview)


def test_frames_pipelined_behind_the_handshake_are_read_here_too() -> None:
    # The request is answered before the reader goes on: frames in the same read as its end are
    # read as frames, wherever the read ends.
    stream = _handshake() + _frame(Opcode.BINARY, bytes(100_000)) + _frame(Opcode.BINARY, b"two")
    for first_read in (len(_handshake()) - 2, len(_handshake()), len(_handshake()) + 1, len(_handshake()) + 5,
                       len(_handshake()) + 70_000, len(stream)):
        wired, oracle = _Wired(), _Oracle()
        wired.read(stream, [first_read, 1 << 20])
        oracle.receive(stream)
        assert len(wired.delivered) == 2 and wired.events == oracle.events
        assert wired.reader.held == 0


def test_a_large_claimed_frame_holds_what_was_sent_not_what_was_claimed() -> None:
    wired = _Wired(max_size=16 << 20).open()
    claimed = 16 << 20
    head = _frame(Opcode.BINARY, bytes(claimed))[:14]  # 2 + 8 length bytes + 4 mask bytes
    sent = 1 << 20
    wired.read(head + bytes(sent // 2), [1 << 30])
    wired.read(bytes(sent // 2), [1 << 30])
    # What was sent, up to the end of the huge page it lies in (its mapping's pages come in those).
    assert sent <= wired.reader.held <= sent + HUGE_PAGE_BYTES < claimed
    assert wired.events == [] and wired.protocol.state is State.OPEN


def _mappings(start: int, end: int) -> list[dict[str, str]]:
    """The ``/proc/self/smaps`` entries (field name to value) of the mappings overlapping
    ``start`` to ``end``."""
    entries: list[dict[str, str]] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low < end and start < high
            if inside:
                entries.append({"perms": line.split()[1]})
        elif inside:
            name, _, value = line.partition(":")
            entries[-1][name] = value.strip()
    return entries


def _resident(start: int, end: int) -> int:
    """Bytes of ``start`` to ``end`` (page-aligned) resident now, by ``/proc/self/pagemap``
    (a page's present bit): exactly the span, not the whole mappings around it."""
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // page * 8)
        entries = np.frombuffer(f.read((end - start) // page * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum()) * page


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc")
def test_a_mapped_payload_buffer_is_private_asks_for_huge_pages_past_its_first_and_holds_no_more_than_it_counts() -> None:
    taken: list[np.ndarray] = []
    pool = BufferPool()
    take = pool.take
    pool.take = lambda n: taken.append(take(n)) or taken[-1]  # type: ignore[method-assign]
    wired = _Wired(max_size=16 << 20, pool=pool).open()
    wired.read(_frame(Opcode.BINARY, bytes(12 << 20))[:14], [1 << 30])  # the header alone: nothing written yet
    (buf,) = taken
    start = buf.__array_interface__["data"][0]
    span = (start, start + buf.size)
    before = _resident(*span)
    wired.read(bytes(SCRATCH_BYTES), [SCRATCH_BYTES])  # a gate's peek: small pages only
    assert _resident(*span) - before <= wired.reader.held <= SCRATCH_BYTES + 14
    wired.read(bytes(5 << 20), [READ_BYTES])
    after = _mappings(*span)
    assert all(e["perms"].endswith("p") for e in after)  # private: no shared-memory file behind it
    if "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert "hg" in after[-1]["VmFlags"].split()  # past the first pages, advised to use huge pages
    assert _resident(*span) - before <= wired.reader.held  # every page made resident is counted for the peer
    offset = huge_page_offset(buf)
    assert resident_bytes(offset, buf.size, small_pages_end(offset) + 1) <= small_pages_end(offset) + HUGE_PAGE_BYTES


def test_a_frame_over_max_size_goes_to_websockets_which_refuses_it_before_anything_is_buffered() -> None:
    wired = _Wired().open()
    wired.read(_frame(Opcode.BINARY, bytes(MAX_SIZE + 1))[:14], [1 << 30])
    assert wired.reader.held == 14  # the header websockets was handed, no payload
    assert wired.protocol.close_sent is not None and wired.protocol.close_sent.code == 1009  # message too big


def test_the_stream_ending_inside_a_payload_ends_the_connection_as_websockets_does() -> None:
    cut = _frame(Opcode.BINARY, bytes(451_000))[:200_000]
    wired, oracle = _Wired().open(), _Oracle()
    wired.read(cut, [1 << 30])
    wired.reader.discard()  # the connection's eof: what was under way is dropped, websockets told
    wired.protocol.receive_eof()
    oracle.receive(_handshake())
    oracle.receive(cut)
    oracle.protocol.receive_eof()
    assert wired.reader.held == 0 and wired.events == oracle.events == []
    assert (wired.protocol.state, type(wired.protocol.parser_exc)) == (oracle.protocol.state, type(oracle.protocol.parser_exc))


def test_a_buffer_is_handed_out_again_only_once_nothing_refers_to_it() -> None:
    pool = BufferPool(buffers=2, buffer_bytes=1 << 20)
    first = pool.take(500_000)
    view = memoryview(first)[:10].toreadonly()
    del first
    second = pool.take(500_000)
    assert second is not view.obj  # the view keeps the first buffer in use
    del second
    del view
    again = pool.take(400_000)
    assert again.size == 500_000  # one of the two, free again
    # A pool full of buffers in use: a fresh one, not kept.
    held = [again, pool.take(500_000)]
    extra = pool.take(500_000)
    assert all(extra is not h for h in held)
    assert pool.take(2 << 20).size == 2 << 20  # larger than the pool keeps


def test_arrays_decoded_from_a_message_keep_its_buffer_from_being_reused() -> None:
    obs = {"image": np.arange(300_000, dtype=np.uint8).reshape(100, 3000), "state": np.arange(7, dtype=np.float32)}
    frame = Encoder().encode_oob({"type": "infer", "id": 1, "obs": obs})
    pool = BufferPool(buffers=1, buffer_bytes=1 << 20)
    wired = _Wired(pool=pool).open()
    wired.read(_frame(Opcode.BINARY, frame), [1 << 30])
    (message,) = wired.delivered
    arrays = decode(message)["obs"]
    wired.delivered.clear()
    wired.events.clear()
    del message
    wired.read(_frame(Opcode.BINARY, bytes(len(frame))), [1 << 30])  # the next message, same size
    np.testing.assert_array_equal(arrays["image"], obs["image"])  # not overwritten
    np.testing.assert_array_equal(arrays["state"], obs["state"])
    assert not arrays["image"].flags.writeable


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(0, 200), st.binary(min_size=4, max_size=4), st.integers(0, 2**32))
def test_unmasking_in_place_is_websockets_unmasking(start: int, length: int, mask: bytes, seed: int) -> None:
    data = random.Random(seed).randbytes(start + length + 3)
    masked = apply_mask(data, mask)
    buf = np.frombuffer(masked, np.uint8).copy()
    unmask_in_place(buf, start, start + length, *mask_arrays(mask))
    expected = bytearray(masked)
    expected[start:start + length] = data[start:start + length]
    assert buf.tobytes() == bytes(expected)


def test_without_a_size_limit_no_buffer_is_sized_by_a_header() -> None:
    # websockets' max_size None: a header may claim anything; such frames are websockets' to read.
    delivered: list[bytes | memoryview] = []
    forwarded: list[bytes] = []
    reader = FrameReader(delivered.append, lambda data: forwarded.append(bytes(data)), lambda: True, None, BufferPool())
    handshake = b"GET / HTTP/1.1\r\n\r\n"
    claim = bytes([0x82, 0x80 | 127]) + (1 << 62).to_bytes(8, "big") + b"mask"  # a final binary frame of 4 EiB
    for data in (handshake, _frame(Opcode.BINARY, b"small"), claim):
        buf = reader.get_buffer(-1)
        buf[:len(data)] = data
        reader.buffer_updated(len(data))
    assert delivered == [b"small"] and reader.held == len(claim)  # the header handed on, no buffer
    assert forwarded[-1] == claim  # the claim went to websockets


def test_a_payload_larger_than_a_pass_is_unmasked_in_passes_as_it_arrives() -> None:
    # Passes keep the unmasking within a core's cache: the bytes that arrived are unmasked once a
    # pass's worth of them is in, not all at the end.
    payload = bytes(range(256)) * 400  # 102 400 bytes
    wired = _Wired(unmask_pass_bytes=10_000).open()
    frame = _frame(Opcode.BINARY, payload)
    wired.read(frame[:40_000], [40_000])
    buf = wired.reader._buf
    assert buf is not None and not wired.delivered
    arrived = 40_000 - 14  # after the 14-byte header
    assert bytes(buf[:arrived]) == payload[:arrived]  # already unmasked
    wired.read(frame[40_000:], [20_000])
    assert [bytes(m) for m in wired.delivered] == [payload]


def _peeked_reading(frame: bytes, first_read: int) -> tuple[list[tuple[bytes, int, int]], _Wired]:
    """``frame`` read by a reader that peeks at 4 096 bytes, ``first_read`` bytes in the first read
    and as much as it asks for after; the peeks as (head, length, bytes read by then)."""
    wired = _Wired()
    peeks: list[tuple[bytes, int, int]] = []
    read = 0
    wired.reader = FrameReader(wired._deliver, wired._forward, wired.idle, MAX_SIZE, BufferPool(),
                               peeked=lambda head, length: peeks.append((bytes(head), length, read)))
    wired.reader.peek_bytes = 4096
    wired.open()
    while read < len(frame):
        buf = wired.reader.get_buffer(-1)
        n = min(len(buf), len(frame) - read, first_read if read == 0 else len(frame))
        buf[:n] = frame[read:read + n]
        read += n
        wired.reader.buffer_updated(n)
    return peeks, wired


def test_a_large_payloads_first_bytes_are_peeked_at_unmasked_before_any_more_of_it_is_read() -> None:
    # The body gate (server/entrypoints/peek.py) decides from these bytes whether the rest is read now.
    payload = random.Random(5).randbytes(3 * READ_BYTES)
    frame = _frame(Opcode.BINARY, payload)
    header = len(frame) - len(payload)
    for first_read in (header, SCRATCH_BYTES):  # the header alone, or with the payload's first bytes
        peeks, wired = _peeked_reading(frame, first_read)
        ((head, length, read_then),) = peeks
        assert length == len(payload) and head == payload[:len(head)]
        assert len(head) == (4096 if first_read == header else SCRATCH_BYTES - header)
        assert read_then == header + len(head)  # asked before any more was read
        assert [bytes(m) for m in wired.delivered] == [payload]
    unpeeked = _Wired()  # peek_bytes 0: nothing is peeked, reads are as before
    unpeeked.reader = FrameReader(unpeeked._deliver, unpeeked._forward, unpeeked.idle, MAX_SIZE, BufferPool(),
                                  peeked=lambda head, length: peeks.append((b"", 0, 0)))
    unpeeked.open().read(frame, [len(frame)])
    assert len(peeks) == 1 and [bytes(m) for m in unpeeked.delivered] == [payload]


def test_a_payload_under_way_is_peeked_at_again_on_request_and_one_delivered_is_not() -> None:
    payload = random.Random(6).randbytes(2 * READ_BYTES)
    frame = _frame(Opcode.BINARY, payload)
    peeks: list[bytes] = []
    wired = _Wired()
    wired.reader = FrameReader(wired._deliver, wired._forward, wired.idle, MAX_SIZE, BufferPool(),
                               peeked=lambda head, length: peeks.append(bytes(head)))
    wired.reader.peek_bytes = 4096
    wired.open()
    wired.reader.peek_again()  # nothing under way
    wired.read(frame[:READ_BYTES], [READ_BYTES])
    wired.reader.peek_again()
    assert len(peeks) == 2 and peeks[0] == peeks[1] == payload[:len(peeks[0])]
    wired.read(frame[READ_BYTES:], [READ_BYTES])
    wired.reader.peek_again()  # delivered: nothing under way
    assert len(peeks) == 2 and [bytes(m) for m in wired.delivered] == [payload]

    late = _Wired()  # peeking turned on while a payload is under way: peeked at as it is asked
    late.reader = FrameReader(late._deliver, late._forward, late.idle, MAX_SIZE, BufferPool(),
                              peeked=lambda head, length: peeks.append(bytes(head)))
    late.open().read(frame[:READ_BYTES], [READ_BYTES])
    late.reader.peek_bytes = 4096
    late.reader.peek_again()
    assert len(peeks) == 3 and len(peeks[2]) == READ_BYTES - (len(frame) - len(payload)) and payload.startswith(peeks[2])
    late.read(frame[READ_BYTES:], [READ_BYTES])
    assert [bytes(m) for m in late.delivered] == [payload]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.one_of(st.integers(1, 20), st.integers(1, 700_000)), min_size=1, max_size=12))
def test_a_payload_dropped_at_its_peek_is_read_to_its_end_holding_nothing_and_the_frames_after_it_come_out(sizes: list[int]) -> None:
    # A body gate that answers a message from its first bytes drops the rest (server/entrypoints/peek.py).
    rng = random.Random(7)
    dropped = [b"DROP" + rng.randbytes(3 * READ_BYTES + 5), b"DROP" + rng.randbytes(DIRECT_MIN_BYTES - 4)]
    kept = [rng.randbytes(100), b"KEEP" + rng.randbytes(2 * READ_BYTES), b"x"]
    stream = b"".join([_frame(Opcode.BINARY, dropped[0]), _frame(Opcode.PING, b"p"), _frame(Opcode.BINARY, kept[0]),
                       _frame(Opcode.BINARY, kept[1]), _frame(Opcode.BINARY, dropped[1]), _frame(Opcode.BINARY, kept[2])])
    wired = _Wired(max_size=16 << 20)

    def peeked(head: memoryview, length: int) -> None:
        if bytes(head[:4]) == b"DROP":
            wired.reader.drop_payload()

    wired.reader = FrameReader(wired._deliver, wired._forward, wired.idle, 16 << 20, BufferPool(), peeked=peeked)
    wired.reader.peek_bytes = 4096
    wired.open()
    pos, i, most_held = 0, 0, 0
    while pos < len(stream):
        buf = wired.reader.get_buffer(-1)
        assert len(buf) <= max(READ_BYTES, SCRATCH_BYTES)
        n = min(len(buf), len(stream) - pos, sizes[i % len(sizes)])
        buf[:n] = stream[pos:pos + n]
        pos, i = pos + n, i + 1
        wired.reader.buffer_updated(n)
        if pos < len(dropped[0]):
            most_held = max(most_held, wired.reader.held)
    assert [bytes(m) for m in wired.delivered] == kept
    oracle = _Oracle(16 << 20)
    oracle.receive(_handshake())
    oracle.receive(stream)
    assert wired.events == [e for e in oracle.events if e[1] not in dropped]  # the ping answered, in order
    assert wired.reader.held == 0 and most_held <= SCRATCH_BYTES
