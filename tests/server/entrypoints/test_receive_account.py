"""One memory account per connection and per tenant, over loopback (the robot port's listener with
real clients and raw sockets): complete messages queued for a stalled session count and stop the
reading, eviction closes the largest holder of the tenant furthest over its fair share and never a
tenant within it, TCP flow control resumes when the session takes messages, and decoded arrays
are reserved before they are made."""

from __future__ import annotations

import asyncio
import base64
import os

from listener_helpers import MIB, listening
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode

from chunkline.client.wire.errors import CloseCode
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.listener import Listener
from chunkline.server.entrypoints.receive_budget import ReceiveBudget
from tests.loop_helpers import until

KIB = 1 << 10


class PeakBudget(ReceiveBudget):
    """The budget, noting the most each tenant ever held."""

    def __init__(self, *args: float) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.peak: dict[str, int] = {}

    def update(self, holder: object, tenant: str, held: int) -> list[object]:
        evicted = super().update(holder, tenant, held)
        self.peak[tenant] = max(self.peak.get(tenant, 0), self.held_by(tenant))
        return evicted


def _handshake(tenant: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nX-Tenant: {tenant}\r\n\r\n").encode()


def _frame(payload: bytes, fin: bool = True, opcode: Opcode = Opcode.BINARY) -> bytes:
    return Frame(opcode, payload, fin).serialize(mask=True)


async def _raw(port: int, tenant: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_handshake(tenant))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101 "), head
    return reader, writer



async def _close_code(reader: asyncio.StreamReader) -> int | None:
    """The code of the close frame the server sends (server frames are unmasked), skipping others."""
    try:
        while True:
            head = await asyncio.wait_for(reader.readexactly(2), 10)
            length = head[1] & 0x7F
            if length == 126:
                length = int.from_bytes(await reader.readexactly(2), "big")
            elif length == 127:
                length = int.from_bytes(await reader.readexactly(8), "big")
            payload = await reader.readexactly(length)
            if head[0] & 0x0F == Opcode.CLOSE.value:
                return int.from_bytes(payload[:2], "big")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _connections(server: Listener) -> list[BudgetedConnection]:
    return list(server.connections)


# ---------------------------------------------------------------------------------- queued messages


def test_stalled_sessions_of_one_tenant_hold_at_most_its_share_plain_and_fragmented() -> None:
    """12 sessions of one tenant that never read, each sent 17 messages of 1 MiB (plain, or in 4
    fragments): the tenant's holdings never pass its share, and what is held is what is counted."""
    budget = PeakBudget(16 * MIB, 0.25)  # 4 MiB for the tenant

    async def go() -> None:
        async with listening(lambda ws: ws.wait_closed(), budget, max_message_bytes=MIB + KIB) as server:
            clients = [await _raw(server.port, "mallory") for _ in range(12)]
            message = os.urandom(MIB)
            for i, (_, writer) in enumerate(clients):
                for _ in range(17):
                    if i % 2:
                        writer.write(_frame(message))
                    else:
                        quarter = MIB // 4
                        writer.write(b"".join(_frame(message[k:k + quarter], fin=k + quarter >= MIB,
                                                     opcode=Opcode.BINARY if k == 0 else Opcode.CONT)
                                              for k in range(0, MIB, quarter)))
            await until(lambda: all(c.reading_paused or c.state.name != "OPEN" for c in _connections(server)),
                         "every connection paused or closed")
            for connection in _connections(server):
                assert budget.holding(connection) == connection.held_bytes()
            for _, writer in clients:
                writer.close()

    asyncio.run(go())
    assert budget.peak["mallory"] <= budget.tenant_bytes


def _stream(small: int, fragmented: int, large: int) -> tuple[bytes, list[bytes]]:
    """One write's worth: small whole messages, messages in two fragments, then 64 KiB ones."""
    messages, frames = [], []
    for i in range(small):
        messages.append(bytes([i % 256]) * 1000)
        frames.append(_frame(messages[-1]))
    for i in range(fragmented):
        messages.append(bytes([i % 256]) * 3000)
        frames += [_frame(messages[-1][:1000], fin=False), _frame(messages[-1][1000:], opcode=Opcode.CONT)]
    for i in range(large):
        messages.append(bytes([i % 256]) * (64 * KIB))
        frames.append(_frame(messages[-1]))
    return b"".join(frames), messages


def test_the_queue_allowance_pauses_reading_every_time_and_resumes_when_the_session_takes_messages() -> None:
    """One write fills the server's queue (messages read whole and messages in fragments) and the
    socket buffers: reading stops at the allowance, the session takes some, reading resumes and
    stops again at the allowance (never left running), and every message arrives in order.
    Repeated 12 times: the pause must hold every time."""
    phase: list[asyncio.Event] = []
    taken: list[bytes] = []
    allowance = 4 * (64 * KIB + 128) + 64 * KIB + 14  # the queue's allowance and one frame being read

    async def handler(ws: BudgetedConnection) -> None:
        await phase[0].wait()
        for _ in range(16):  # every small and fragmented message: both kinds taken
            taken.append(bytes(await ws.next_message()))
        phase[1].set()
        await phase[2].wait()
        while len(taken) < 416:
            taken.append(bytes(await ws.next_message()))
        await ws.send(b"done")

    async def stopped_reading(connection: BudgetedConnection, writer: asyncio.StreamWriter, held: int) -> None:
        for _ in range(2000):  # bounded: 10 s at most
            assert connection.held_bytes() <= allowance, "the server kept reading past the allowance"
            if (connection.reading_paused and writer.transport.get_write_buffer_size() > 0
                    and connection.held_bytes() >= held):  # the queue (re)filled, then reading stopped
                return
            await asyncio.sleep(0.005)
        raise AssertionError("never stopped reading")

    async def go() -> None:
        async with listening(handler, ReceiveBudget(256 * MIB, 1.0), max_message_bytes=MIB,
                             max_queued_messages=4) as server:
            for _ in range(12):
                phase[:] = [asyncio.Event() for _ in range(3)]
                taken.clear()
                reader, writer = await _raw(server.port, "acme")
                data, messages = _stream(small=8, fragmented=8, large=400)  # 25 MiB in one write
                writer.write(data)
                [connection] = _connections(server)
                try:
                    await stopped_reading(connection, writer, 4 * 1000)
                    phase[0].set()
                    await asyncio.wait_for(phase[1].wait(), 10)
                    await stopped_reading(connection, writer, 4 * 64 * KIB)  # resumed, refilled, paused again
                    assert connection.state.name == "OPEN"
                finally:
                    for event in phase:
                        event.set()
                await asyncio.wait_for(writer.drain(), 30)
                assert (await asyncio.wait_for(reader.readexactly(6), 30))[2:] == b"done"
                assert taken == messages
                writer.close()
                await connection.wait_closed()
                await until(lambda: not server.connections, "connection forgotten")

    asyncio.run(go())


# ---------------------------------------------------------------------------------- eviction order


def test_a_tenant_within_its_fair_share_is_never_the_one_closed() -> None:
    """Two tenants hold 106 half-sent frames of 153 KiB between them (each within its own share);
    a third tenant's robot sends a 196 KiB observation past the total: the robot is served, one of
    the holders is closed."""
    refused: list[int] = []
    budget = ReceiveBudget(16 * MIB, 0.5, on_refused=lambda: refused.append(1))
    got: list[int] = []

    async def handler(ws: BudgetedConnection) -> None:
        async for message in ws.messages():
            got.append(len(message))
            await ws.send(b"ok")

    async def go() -> None:
        async with listening(handler, budget, max_message_bytes=MIB) as server:
            holders = []
            half = _frame(bytes(306 * KIB))[: 153 * KIB]
            for i in range(106):
                reader, writer = await _raw(server.port, "alpha" if i % 2 else "beta")
                writer.write(half)
                holders.append((reader, writer))
            await until(lambda: budget.held >= 106 * (153 * KIB - 14), "the half frames held")  # less their headers
            async with connect(f"ws://127.0.0.1:{server.port}", additional_headers={"X-Tenant": "robot"},
                               max_size=None, compression=None) as robot:
                await robot.send(bytes(196 * KIB))
                assert await asyncio.wait_for(robot.recv(), 10) == b"ok"
            assert refused  # room was made among the holders
            assert budget.held <= budget.total_bytes
            for _, writer in holders:
                writer.close()

    asyncio.run(go())
    assert got == [196 * KIB]


def test_the_budget_evicts_from_the_tenant_furthest_over_its_fair_share() -> None:
    budget = ReceiveBudget(16 * MIB, 0.5)
    for i in range(53):
        assert budget.update(("a", i), "alpha", 153 * KIB) == []
        assert budget.update(("b", i), "beta", 153 * KIB) == []
    evicted = budget.update("robot", "gamma", 196 * KIB)
    assert evicted and "robot" not in evicted
    assert budget.held <= budget.total_bytes and budget.held_by("gamma") == 196 * KIB


def test_a_tenant_over_its_configured_share_loses_its_own_largest_holder() -> None:
    budget = ReceiveBudget(100 * MIB, 0.25)
    budget.update("small", "mallory", 5 * MIB)
    budget.update("big", "mallory", 15 * MIB)
    assert budget.update("grow", "mallory", 6 * MIB) == ["big"]


# ---------------------------------------------------------------------------------- decoded arrays


def test_decoded_arrays_are_reserved_before_they_are_made() -> None:
    budget = ReceiveBudget(8 * MIB, 0.5)
    seen: list[object] = []

    async def handler(ws: BudgetedConnection) -> None:
        first = ws.reserve(3 * MIB)
        seen.append(first is not None and budget.held_by("acme") >= 3 * MIB)
        seen.append(ws.reserve(2 * MIB))  # 5 MiB would pass the tenant's 4 MiB: refuse the request
        assert first is not None
        first.release()
        seen.append(budget.held_by("acme"))
        with ws.reserve(4 * MIB - 1024) as again:  # type: ignore[union-attr]
            seen.append(again.nbytes)
        await ws.send(b"ok")

    async def go() -> None:
        async with listening(handler, budget) as server:
            async with connect(f"ws://127.0.0.1:{server.port}", additional_headers={"X-Tenant": "acme"}) as client:
                assert await client.recv() == b"ok"

    asyncio.run(go())
    assert seen == [True, None, 0, 4 * MIB - 1024]
    assert budget.held == 0


# ---------------------------------------------------------------------------------- keepalive and close codes


def test_a_peer_that_answers_no_ping_is_closed_and_one_that_does_stays() -> None:
    async def go() -> tuple[int | None, bool]:
        async with listening(lambda ws: ws.wait_closed(), ping_interval_s=0.05) as server:
            async with connect(f"ws://127.0.0.1:{server.port}") as answering:
                reader, writer = await _raw(server.port, "mute")  # reads nothing, answers nothing
                code = await _close_code(reader)
                writer.close()
                alive = answering.state.name == "OPEN"
            return code, alive

    code, alive = asyncio.run(go())
    assert code == CloseCode.INTERNAL_ERROR and alive


def test_close_codes_reach_the_client() -> None:
    async def handler(ws: BudgetedConnection) -> None:
        message = await ws.next_message()
        if message == b"fail":
            raise RuntimeError("the session broke")
        if message == b"revoke":
            await ws.close(CloseCode.POLICY_VIOLATION, "API key revoked")

    async def go() -> list[tuple[int | None, str | None]]:
        out = []
        async with listening(handler) as server:
            for what in (b"fail", b"revoke", b"bye"):
                async with connect(f"ws://127.0.0.1:{server.port}") as client:
                    await client.send(what)
                    try:
                        await asyncio.wait_for(client.recv(), 10)
                    except ConnectionClosed:
                        pass
                out.append((client.close_code, client.close_reason))
        return out

    assert asyncio.run(go()) == [(1011, ""), (1008, "API key revoked"), (1000, "")]


def test_a_reservation_may_be_held_to_a_part_of_the_tenants_share() -> None:
    budget = ReceiveBudget(8 * MIB, 0.5)  # 4 MiB per tenant
    budget.update("frames", "t", 1 * MIB)
    assert budget.fits("t", 3 * MIB) and not budget.fits("t", 3 * MIB, share=0.5)
    assert budget.fits("t", 1 * MIB, share=0.5) and not budget.fits("t", MIB + 1, share=0.5)
