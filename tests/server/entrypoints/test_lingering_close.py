"""The server's side of a close ends in a lingering close: after its close frame it half-closes
(TCP FIN) and reads and drops what the peer still sends until the peer's end of stream or the
close timeout. A client still writing a frame the server refused (1009) gets the close frame, not
a reset that would lose it; a peer that never ends is aborted at the close timeout, and counts as
a connection until then.

The robot port's listener on loopback and raw sockets: the tests wait on the sockets and the
connection's end, never on a sleep."""

from __future__ import annotations

import asyncio
import socket

from listener_helpers import MIB, listening
from websockets.frames import Opcode
from websockets.protocol import State

from chunkline.client.wire.errors import CloseCode
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.listener import Listener
from chunkline.server.entrypoints.receive_budget import ReceiveBudget

KIB = 1 << 10
MASK = b"\x01\x02\x03\x04"
_HANDSHAKE = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


def _oversize_header(length: int) -> bytes:
    """A final masked binary frame's header announcing ``length`` payload bytes (64-bit length)."""
    return bytes([0x82, 0x80 | 127]) + length.to_bytes(8, "big") + MASK


async def _open(port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, _HANDSHAKE)
    head = b""
    for _ in range(64):  # bounded: the 101 response is a few hundred bytes
        head += await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
        if b"\r\n\r\n" in head:
            break
    assert head.startswith(b"HTTP/1.1 101 ") and head.endswith(b"\r\n\r\n"), head
    return sock


async def _read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until its end of stream (raises on a reset)."""
    loop = asyncio.get_running_loop()
    data = b""
    for _ in range(1024):  # bounded: a close frame and the end of stream
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
        if not chunk:
            return data
        data += chunk
    raise AssertionError("the server sent more than a close frame")


def _close_code(data: bytes) -> int:
    """The code of the one frame the server sent: a close frame (server frames are unmasked)."""
    assert data[0] == 0x80 | Opcode.CLOSE.value and data[1] < 126, data
    assert len(data) == 2 + data[1], data
    return int.from_bytes(data[2:4], "big")


def _connections(server: Listener) -> list[BudgetedConnection]:
    return list(server.connections)


def test_a_client_still_sending_a_refused_frame_reads_the_1009_close_not_a_reset() -> None:
    """The client announces 32 MiB against a 1 MiB limit and goes on writing the payload in 64 KiB
    pieces, more than loopback's socket buffers hold, before it reads: every write is taken (the
    server drains them), then it reads the 1009 close frame and the server's end of stream."""

    async def go() -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        budget = ReceiveBudget(64 * MIB, 1.0)
        async with listening(lambda ws: ws.wait_closed(), budget, max_message_bytes=MIB) as server:
            sock = await _open(server.port)
            piece = bytes(64 * KIB)
            await loop.sock_sendall(sock, _oversize_header(32 * MIB) + piece)
            sent = len(piece)
            for _ in range(32 * MIB // len(piece) - 1):  # bounded: the announced payload
                await loop.sock_sendall(sock, piece)  # a reset here is the bug
                sent += len(piece)
            code = _close_code(await _read_to_end(sock))
            sock.close()
            for connection in _connections(server):
                await asyncio.wait_for(connection.wait_closed(), 10)
            return code, sent, budget.held

    code, sent, held = asyncio.run(go())
    assert code == CloseCode.MESSAGE_TOO_BIG and sent == 32 * MIB and held == 0


def test_a_peer_that_never_ends_its_stream_is_aborted_at_the_close_timeout_and_counted_until_then() -> None:
    """After the 1009 close the peer keeps its side open and reads: the server half-closed (the
    peer reads the close frame and the end of stream), the connection stays one of the listener's
    until the close timeout aborts it."""

    async def go() -> tuple[int, bool, bool]:
        loop = asyncio.get_running_loop()
        async with listening(lambda ws: ws.wait_closed(), max_message_bytes=MIB, close_timeout_s=0.2) as server:
            sock = await _open(server.port)
            await loop.sock_sendall(sock, _oversize_header(32 * MIB) + bytes(64 * KIB))
            code = _close_code(await _read_to_end(sock))
            (connection,) = _connections(server)
            lingering = connection.state is State.CLOSING
            await asyncio.wait_for(connection.wait_closed(), 10)
            assert connection.task is not None
            await asyncio.wait_for(connection.task, 10)
            sock.close()
            return code, lingering, connection in server.connections

    code, lingering, left = asyncio.run(go())
    assert code == CloseCode.MESSAGE_TOO_BIG and lingering and not left
