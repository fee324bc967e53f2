"""A connection reading a huge frame takes one read of at most ``READ_BYTES`` per turn of the
event loop: after such a read it pauses its transport until the loop's next turn (uvloop would
otherwise read the same socket up to 32 times in a row, megabytes per turn ahead of every other
client). Smaller reads go on as they come.

A connection on a stand-in transport that records pauses, fed reads by hand; the test steps the
loop one turn at a time."""

from __future__ import annotations

import asyncio
from typing import Any

from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response

from chunkline.server.entrypoints.connection import BudgetedConnection, ConnectionSettings
from chunkline.server.entrypoints.frame_reader import READ_BYTES

MIB = 1 << 20
_HANDSHAKE = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


class Transport:
    """What the connection uses of an asyncio transport; records whether reading is paused."""

    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0
        self.written = bytearray()

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        assert not self.paused
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        assert self.paused
        self.paused = False


class Hooks:
    def process_request(self, connection: BudgetedConnection, request: Request) -> Response | None:
        return None

    def select_subprotocol(self, connection: BudgetedConnection, offered: list[str]) -> str | None:
        return None

    def process_response(self, connection: BudgetedConnection, request: Request, response: Response) -> None:
        pass

    async def handler(self, connection: BudgetedConnection) -> None:
        await connection.wait_closed()

    def forget(self, connection: BudgetedConnection) -> None:
        pass


def _feed(connection: BudgetedConnection, data: bytes) -> None:
    """``data`` as the transport would deliver it: into the buffers the connection hands out."""
    view = memoryview(data)
    while view:
        buf = connection.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        connection.buffer_updated(n)
        view = view[n:]


def test_a_read_of_read_bytes_pauses_reading_until_the_loops_next_turn() -> None:
    async def go() -> list[tuple[str, bool]]:
        connection = BudgetedConnection(Hooks(), ConnectionSettings(max_message_bytes=16 * MIB, open_timeout_s=None,
                                                                    ping_interval_s=None))
        transport = Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        _feed(connection, _HANDSHAKE)
        assert transport.written.startswith(b"HTTP/1.1 101 ")
        seen: list[tuple[str, bool]] = []
        frame = Frame(Opcode.BINARY, bytes(4 * MIB)).serialize(mask=True)
        header = len(frame) - 4 * MIB
        _feed(connection, frame[:header + 1000])  # the header and a small first read
        seen.append(("small read", transport.paused))
        buf = connection.get_buffer(-1)
        assert len(buf) == READ_BYTES
        buf[:] = frame[header + 1000:header + 1000 + READ_BYTES]
        connection.buffer_updated(READ_BYTES)
        seen.append(("full read", transport.paused))
        await asyncio.sleep(0)  # the loop's next turn
        seen.append(("next turn", transport.paused))
        _feed(connection, frame[header + 1000 + READ_BYTES:])
        seen.append(("message", (await connection.next_message()) == bytes(4 * MIB)))
        await asyncio.sleep(0)
        seen.append(("after", transport.paused))
        connection.connection_lost(None)
        return seen

    assert asyncio.run(go()) == [("small read", False), ("full read", True), ("next turn", False), ("message", True),
                                 ("after", False)]
