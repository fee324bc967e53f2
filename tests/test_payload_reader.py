"""The server's frame reader (:mod:`chunkline.server.entrypoints.payload_reader`): large payloads
are copied once into a buffer of their own, every message comes out as websockets' own reader
gives it, and what a connection holds is what its peer sent, not what a frame header claims.

Sans-I/O: websockets' server protocol fed bytes cut at arbitrary points, with websockets' own
reader as the oracle."""

from __future__ import annotations

import random

from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from chunkline.bench.overhead import ProtocolFeed
from chunkline.server.entrypoints import payload_reader
from chunkline.server.entrypoints.payload_reader import DIRECT_MIN_BYTES, SCRATCH_BYTES, DirectReads, PayloadReader, install

MAX_SIZE = 16 << 20


def _open_protocol(lean: bool) -> ServerProtocol:
    """A server protocol past its handshake (as after ``101``), reading through the given reader."""
    protocol = ServerProtocol(max_size=MAX_SIZE)
    protocol.state = State.OPEN
    if lean:
        install(protocol)
    else:  # websockets' own reader, the parser restarted in the open state as install() does
        protocol.parser = protocol.parse()
        next(protocol.parser)
    return protocol


def _wire(payload: bytes, opcode: Opcode = Opcode.BINARY, fin: bool = True) -> bytes:
    return Frame(opcode, payload, fin).serialize(mask=True)  # clients mask


def _feed(protocol: ServerProtocol, data: bytes, cuts: list[int]) -> list[Frame]:
    frames: list[Frame] = []
    start = 0
    for end in [*cuts, len(data)]:
        protocol.receive_data(data[start:end])
        start = end
        frames += [e for e in protocol.events_received() if isinstance(e, Frame)]
    return frames


def test_messages_of_every_size_cut_anywhere_come_out_as_websockets_reads_them() -> None:
    rng = random.Random(7)
    sizes = [0, 10, 125, 126, 65535, DIRECT_MIN_BYTES - 1, DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1, 451_000, 3_000_000]
    payloads = [rng.randbytes(n) for n in sizes]
    # A fragmented message too: a large first fragment, then its end.
    stream = b"".join(_wire(p) for p in payloads) + _wire(payloads[-2], fin=False) + _wire(b"end", Opcode.CONT)
    for cut_seed in range(3):
        cut_rng = random.Random(cut_seed)
        cuts = sorted(cut_rng.sample(range(1, len(stream)), 60))  # reads of any size, some 1 byte long
        got = [(f.opcode, f.fin, bytes(f.data)) for f in _feed(_open_protocol(True), stream, cuts)]
        want = [(f.opcode, f.fin, bytes(f.data)) for f in _feed(_open_protocol(False), stream, cuts)]
        assert got == want
        assert [d for _, _, d in got[: len(sizes)]] == payloads


def test_a_large_payload_fills_its_own_buffer_and_holds_what_was_sent_not_what_was_claimed() -> None:
    protocol = _open_protocol(True)
    reader = protocol.reader
    assert isinstance(reader, PayloadReader)
    claimed = MAX_SIZE  # a header claiming the largest message allowed...
    head = _wire(bytes(claimed))[:14]  # 2 + 8 length bytes + 4 mask bytes
    sent = 1 << 20  # ... of which 1 MiB arrives
    protocol.receive_data(head + bytes(sent // 2))
    protocol.receive_data(bytes(sent // 2))
    assert reader.payload is not None and len(reader.payload) == claimed
    assert len(reader.buffer) == 0  # not appended to websockets' stream buffer
    assert reader.held == sent
    assert protocol.events_received() == [] and protocol.state is State.OPEN


def test_a_frame_over_max_size_is_refused_before_any_buffer_is_made() -> None:
    protocol = _open_protocol(True)
    reader = protocol.reader
    assert isinstance(reader, PayloadReader)
    protocol.receive_data(_wire(bytes(MAX_SIZE + 1))[:14])
    assert reader.payload is None and reader.held == 0
    assert protocol.close_sent is not None and protocol.close_sent.code == 1009  # message too big


def test_the_stream_ending_inside_a_payload_ends_the_connection_as_websockets_does() -> None:
    outcomes = []
    for lean in (True, False):
        protocol = _open_protocol(lean)
        protocol.receive_data(_wire(bytes(451_000))[:200_000])
        protocol.receive_eof()
        assert protocol.events_received() == []
        outcomes.append((protocol.state, type(protocol.parser_exc)))
        if isinstance(protocol.reader, PayloadReader):
            assert protocol.reader.payload is None and protocol.reader.held == 0  # nothing left held
    assert outcomes[0] == outcomes[1] == (State.CLOSED, EOFError)


def test_payload_buffers_are_reused_only_once_the_message_before_was_copied_out() -> None:
    protocol = _open_protocol(True)
    first, second = b"\x01" * 451_000, b"\x02" * 451_000
    wire = _wire(first) + _wire(second) + _wire(b"small")
    cuts = [100_000, 300_000, 500_000, 700_000]
    frames = _feed(protocol, wire, cuts)
    # The second payload was received into the buffer the first one used (given back at the
    # second frame's first read), yet the first message is intact: it had been copied out.
    assert [bytes(f.data) for f in frames] == [first, second, b"small"]
    assert len(payload_reader._free_buffers()) >= 1


def test_frames_arriving_one_read_each_are_parsed_as_they_arrive() -> None:
    # Each frame complete in the reads that brought it: the parser takes it at once, without
    # waiting for more bytes, and holds nothing after it.
    rng = random.Random(3)
    payloads = [rng.randbytes(n) for n in (100_000, 10, DIRECT_MIN_BYTES, 451_000, 70_000)]
    protocol = _open_protocol(True)
    reader = protocol.reader
    assert isinstance(reader, PayloadReader)
    for payload in payloads:
        wire = _wire(payload)
        frames = _feed(protocol, wire, [262_144] if len(wire) > 262_144 else [])
        assert [bytes(f.data) for f in frames] == [payload]
        assert reader.held == 0


class _Connection(ProtocolFeed):
    """What DirectReads forwards to, sans-I/O: bytes into the protocol, its frames collected."""

    def __init__(self, protocol: ServerProtocol) -> None:
        super().__init__(protocol)
        self.frames: list[Frame] = []
        self.eof = self.lost = False
        self.announced: list[int] = []  # len() of every data_received

    def data_received(self, data: bytes) -> None:
        self.announced.append(len(data))
        super().data_received(data)
        self.frames += [e for e in self.protocol.events_received() if isinstance(e, Frame)]

    def eof_received(self) -> bool | None:
        self.eof = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def _read_into(reads: DirectReads, stream: bytes, rng: random.Random) -> None:
    """The transport's side of a buffered protocol: each read fills part of what get_buffer gave."""
    pos = 0
    while pos < len(stream):
        buf = reads.get_buffer(-1)
        n = min(len(buf), len(stream) - pos, rng.choice([1, 13, 1000, 65_536, 300_000, 1 << 22]))
        buf[:n] = stream[pos:pos + n]
        pos += n
        reads.buffer_updated(n)


def test_direct_reads_give_every_message_as_websockets_reads_them_and_fill_large_payloads_in_place() -> None:
    rng = random.Random(11)
    sizes = [0, 10, 126, 65535, DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1, 451_000, 3_000_000]
    payloads = [rng.randbytes(n) for n in sizes]
    stream = b"".join(_wire(p) for p in payloads) + _wire(payloads[-2], fin=False) + _wire(b"end", Opcode.CONT)
    want = [(f.opcode, f.fin, bytes(f.data)) for f in _feed(_open_protocol(False), stream, [])]
    for seed in range(3):
        protocol = _open_protocol(True)
        reader = protocol.reader
        assert isinstance(reader, PayloadReader)
        conn = _Connection(protocol)
        reads = DirectReads(conn, reader)
        _read_into(reads, stream, random.Random(seed))
        assert [(f.opcode, f.fin, bytes(f.data)) for f in conn.frames] == want
        assert reader.held == 0
        # Large payloads went into their own buffers: most of the stream never passed through the
        # scratch buffer (announced empty), and no scratch read was larger than the scratch.
        assert sum(conn.announced) < len(stream) // 4
        assert max(conn.announced) <= SCRATCH_BYTES


def test_direct_reads_never_read_past_a_payload_and_pass_on_what_the_transport_says() -> None:
    protocol = _open_protocol(True)
    reader = protocol.reader
    assert isinstance(reader, PayloadReader)
    conn = _Connection(protocol)
    reads = DirectReads(conn, reader)
    wire = _wire(b"\x07" * 451_000) + _wire(b"next")
    head = reads.get_buffer(-1)
    head[:1000] = wire[:1000]
    reads.buffer_updated(1000)
    assert reader.payload is not None
    into = reads.get_buffer(-1)
    assert len(into) == len(reader.payload) - reader.filled  # exactly the rest of this payload
    into[:] = wire[1000:1000 + len(into)]
    reads.buffer_updated(len(into))
    assert [bytes(f.data) for f in conn.frames] == [b"\x07" * 451_000]
    _read_into(reads, wire[1000 + len(into):], random.Random(0))
    assert [bytes(f.data) for f in conn.frames][-1] == b"next"
    reads.eof_received()
    reads.connection_lost(None)
    assert conn.eof and conn.lost
