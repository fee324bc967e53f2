"""A connection held back for a retry time (``hold_reading``) reads nothing from its peer until the
hold ends: the peer's next message arrives only then, and a large one stays in the peer's own
buffers (TCP flow control); closing ends the hold, so the closing handshake completes.

The robot port's listener on loopback with real clients: the tests wait on messages, the close
and the peer's buffers, never on a sleep."""

from __future__ import annotations

import asyncio

from listener_helpers import MIB, listening
from websockets.asyncio.client import connect

from chunkline.client.wire.errors import CloseCode
from chunkline.server.entrypoints.connection import BudgetedConnection
from tests.loop_helpers import until

HOLD_S = 0.2



def test_a_held_connection_reads_its_peers_next_message_only_once_the_hold_ends() -> None:
    async def go() -> tuple[float, bool, bool, bool]:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        flags: list[bool] = []

        async def handler(ws: BudgetedConnection) -> None:
            await ws.recv()
            times.append(loop.time())
            ws.hold_reading(HOLD_S)
            ws.hold_reading(HOLD_S / 2)  # a shorter hold does not cut the longer one short
            flags.append(ws.reading_held)
            await ws.recv()
            times.append(loop.time())
            flags.append(ws.reading_held)
            await ws.send(b"ok")
            await ws.wait_closed()

        async with listening(handler, max_message_bytes=64 * MIB) as server:
            async with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as client:
                await client.send(b"first")
                (connection,) = server.connections
                await until(lambda: connection.reading_held, "held")
                # 32 MiB: more than loopback's socket buffers take, so some stays in the client's.
                sending = asyncio.ensure_future(client.send(bytes(32 * MIB)))
                await until(lambda: client.transport.get_write_buffer_size() > 0, "the client's buffer in use")
                backed_up = connection.reading_held and not sending.done()
                await sending
                await asyncio.wait_for(client.recv(), 10)
        return times[1] - times[0], flags[0], flags[1], backed_up

    waited, held, still_held, backed_up = asyncio.run(go())
    assert held and not still_held and backed_up
    assert waited >= HOLD_S - 0.01  # the loop's clock resolution


def test_closing_ends_a_hold_so_the_closing_handshake_completes() -> None:
    async def handler(ws: BudgetedConnection) -> None:
        await ws.recv()
        ws.hold_reading(3600.0)
        await ws.close(CloseCode.TRY_AGAIN_LATER, "retry later")

    async def go() -> tuple[int | None, bool]:
        async with listening(handler, close_timeout_s=30.0) as server:
            async with connect(f"ws://127.0.0.1:{server.port}", close_timeout=30.0) as client:
                await client.send(b"hello")
                (connection,) = server.connections
                # Held, the server would not read the client's close frame before its close timeout.
                await asyncio.wait_for(connection.wait_closed(), 10)
                await asyncio.wait_for(client.wait_closed(), 10)
            return client.close_code, connection.reading_held

    code, held = asyncio.run(go())
    assert code == CloseCode.TRY_AGAIN_LATER and not held
