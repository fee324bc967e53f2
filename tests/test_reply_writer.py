"""The server's reply writer (:mod:`chunkline.server.entrypoints.reply_writer`): a binary reply
written straight to the transport is byte for byte what websockets writes, and any connection
state websockets would treat differently (closing, extensions, a fragmented send, a full or
paused buffer, pending writes) takes websockets' own path.

websockets' real connection object over a recording transport, with websockets itself as the
oracle; then a live server in this process with real clients, pings both ways."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import websockets
from helpers import aloha_obs
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import ServerConnection
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from chunkline.client import AsyncClient
from chunkline.client.codec import decode, encode
from chunkline.server.config import PolicyConfig, ServerConfig
from chunkline.server.entrypoints import reply_writer, sessions
from chunkline.server.entrypoints.app import ChunklineServer
from chunkline.server.entrypoints.reply_writer import DIRECT_WRITES, JOIN_MAX_BYTES, frame_header, verified_version, write_binary
from chunkline.server.entrypoints.sessions import Session

WRITE_LIMIT = 1 << 20
#: Sizes on both sides of every length encoding's edge and of the join/two-buffer edge.
EDGES = [0, 1, 124, 125, 126, 127, 65534, 65535, 65536, 65537, JOIN_MAX_BYTES - 1, JOIN_MAX_BYTES, JOIN_MAX_BYTES + 1, 300_000]


class RecordingTransport:
    """What websockets' connection needs of a transport, recording what is written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.written.append(b"".join(bytes(p) for p in parts))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closing = True

    def wire(self) -> bytes:
        data, self.written = b"".join(self.written), []
        return data


def _open_connection() -> tuple[ServerConnection, RecordingTransport]:
    """websockets' server connection past its handshake (call in a running loop)."""
    ws = ServerConnection(ServerProtocol(), None, ping_interval=None, write_limit=WRITE_LIMIT)  # type: ignore[arg-type]
    transport = RecordingTransport()
    Connection.connection_made(ws, transport)  # type: ignore[arg-type]  # without the server's handler task
    protocol = ws.protocol
    protocol.state = State.OPEN
    protocol.parser = protocol.parse()  # reading frames, as after its handshake
    next(protocol.parser)
    return ws, transport


def test_the_direct_path_is_on_for_the_websockets_it_was_checked_against() -> None:
    # Fails when websockets moves to another major version: re-read its send path, then widen.
    assert DIRECT_WRITES and verified_version(websockets.__version__)
    assert not verified_version("18.0") and not verified_version("16.1")


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from(EDGES) | st.integers(0, 70_000), fill=st.binary(min_size=1, max_size=64))
def test_frames_are_websockets_own_bytes(size: int, fill: bytes) -> None:
    payload = (fill * (size // len(fill) + 1))[:size]
    want = Frame(Opcode.BINARY, payload).serialize(mask=False)
    assert frame_header(size) + payload == want

    async def both() -> tuple[bytes, bytes]:
        ws, transport = _open_connection()
        assert write_binary(ws, payload)
        ours = transport.wire()
        await ws.send(payload)
        return ours, transport.wire()

    ours, theirs = asyncio.run(both())
    assert ours == want == theirs


def _close_frame_from_client() -> bytes:
    return Frame(Opcode.CLOSE, b"\x03\xe8").serialize(mask=True)


def _refused(setup: str) -> tuple[bool, bytes]:
    """Put a fresh connection in the state ``setup`` names; whether write_binary wrote, and what."""

    async def go() -> tuple[bool, bytes]:
        ws, transport = _open_connection()
        protocol = ws.protocol
        if setup == "close_sent":
            protocol.send_close(1000)
        elif setup == "close_received":
            protocol.receive_data(_close_frame_from_client())
        elif setup == "failed":
            protocol.fail(1011, "x")
        elif setup == "deflate":
            protocol.extensions = [PerMessageDeflate(False, False, 15, 15)]
        elif setup == "fragment":
            protocol.send_binary(b"first", fin=False)
        elif setup == "send_in_progress":
            ws.send_in_progress = asyncio.get_running_loop().create_future()
        elif setup == "paused":
            ws.pause_writing()
        elif setup == "debug":
            protocol.debug = True
        elif setup == "transport_closing":
            transport.closing = True
        if setup != "pending_write":
            ws.send_data()  # websockets flushes as it goes: only the state is left
        else:
            protocol.send_ping(b"ping")
        transport.wire()
        wrote = write_binary(ws, b"reply")
        return wrote, transport.wire()

    return asyncio.run(go())


@pytest.mark.parametrize("setup", ["close_sent", "close_received", "failed", "deflate", "fragment", "send_in_progress", "paused",
                                   "debug", "transport_closing", "pending_write"])
def test_any_state_websockets_would_treat_otherwise_is_left_to_it(setup: str) -> None:
    wrote, written = _refused(setup)
    assert not wrote and written == b""


def test_a_pending_write_goes_first_on_the_fallback() -> None:
    async def go() -> bytes:
        ws, transport = _open_connection()
        ws.protocol.send_ping(b"ping")  # not flushed yet
        assert not write_binary(ws, b"reply")
        await ws.send(b"reply")
        return transport.wire()

    assert asyncio.run(go()) == Frame(Opcode.PING, b"ping").serialize(mask=False) + Frame(Opcode.BINARY, b"reply").serialize(mask=False)


def _session(ws: ServerConnection, send_timeout_s: float = 5.0) -> Session:
    config = SimpleNamespace(write_limit_bytes=WRITE_LIMIT, send_timeout_s=send_timeout_s)
    return Session(SimpleNamespace(robot=None, config=config), ws, None)  # type: ignore[arg-type]


class _SendSpy:
    def __init__(self) -> None:
        self.sent: list[bytes | str] = []

    async def __call__(self, data: bytes | str) -> None:
        self.sent.append(data)


@pytest.mark.parametrize("case", ["direct", "closing", "buffer_full", "text"])
def test_session_send_writes_directly_only_when_it_may(case: str) -> None:
    async def go() -> tuple[list[bytes | str], bytes]:
        ws, transport = _open_connection()
        spy = _SendSpy()
        ws.send = spy  # type: ignore[method-assign]
        session = _session(ws)
        data: bytes | str = b"x" * 3000
        if case == "closing":
            ws.protocol.send_close(1000)
            ws.send_data()
            transport.wire()
        elif case == "buffer_full":
            transport.buffered = WRITE_LIMIT - 100  # the reply does not fit: websockets' path, under the send timeout
        elif case == "text":
            data = "an openpi error"
        await session.send(data)
        return spy.sent, transport.wire()

    sent, written = asyncio.run(go())
    if case == "direct":
        assert sent == [] and written == Frame(Opcode.BINARY, b"x" * 3000).serialize(mask=False)
    else:
        assert len(sent) == 1 and written == b""


def test_a_peer_that_does_not_read_is_still_cut_after_the_send_timeout() -> None:
    """The buffer-full path keeps its timeout and abort (websockets' drain waits on a paused
    transport until resumed, which never happens here)."""

    async def go() -> bool:
        ws, transport = _open_connection()
        transport.buffered = WRITE_LIMIT
        ws.pause_writing()
        with pytest.raises(websockets.ConnectionClosed):
            await _session(ws, send_timeout_s=0.05).send(b"reply")
        return transport.closing

    assert asyncio.run(go())


def test_live_round_trips_with_pings_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server in this process (keepalive pings every 20 ms), the native client and a raw
    openpi-style client pinging between requests: every reply arrives, pings are answered both
    ways, and the replies went out through the direct path."""
    direct = []

    def counting(ws: ServerConnection, data: bytes) -> bool:
        wrote = reply_writer.write_binary(ws, data)
        direct.append(wrote)
        return wrote

    monkeypatch.setattr(sessions, "write_binary", counting)
    config = ServerConfig(policies=[PolicyConfig(ref="noop")], port=0, no_auth=True, ledger=None, ping_interval_s=0.02)

    async def go() -> tuple[list[float], list[Any]]:
        server = ChunklineServer(config)
        await server.start()
        try:
            uri = f"ws://127.0.0.1:{server.port}"
            async with AsyncClient(uri) as client:
                native = []
                for i in range(15):
                    native.append((await client.infer(aloha_obs(i), obs_time=float(i))).t0)
                    await asyncio.sleep(0.01)  # let keepalive pings interleave with replies
            compat = []
            async with connect(uri, compression=None) as ws:
                decode(await ws.recv())  # metadata
                for i in range(10):
                    await ws.send(encode(aloha_obs(i)))
                    compat.append(decode(await ws.recv()))
                    await asyncio.wait_for(await ws.ping(), 5)  # the server answers our ping
                    await asyncio.sleep(0.01)
                assert server._server is not None
                latencies = [c.latency for c in server._server.connections]
            return [*native, *latencies], compat
        finally:
            await server.shutdown()

    got, compat = asyncio.run(go())
    native, latencies = got[:15], got[15:]
    assert len(native) == 15 and all(isinstance(t, float) for t in native)
    assert all(np.asarray(r["actions"]).shape == (50, 14) for r in compat)
    assert latencies and all(lat > 0 for lat in latencies)  # the server's keepalive pings got their pongs
    assert direct.count(True) >= 15 + 10  # hello, metadata and every reply could go directly here
