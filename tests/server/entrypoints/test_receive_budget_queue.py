"""Complete messages a session has not taken yet count in the receive budget: a client that sends
faster than its session reads is closed 1013 once its tenant's share is held, instead of parking
up to ``max_queue`` whole messages on the server; bytes taken by the session are released.

The robot port's listener on loopback, and a handler that does not read (or reads one message per
request): no sleeps, the test waits on events and the close."""

from __future__ import annotations

import asyncio

from listener_helpers import listening
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from chunkline.client.wire.errors import CloseCode
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.receive_budget import ReceiveBudget

MIB = 1 << 20


async def _run(budget: ReceiveBudget, messages: int, read: bool) -> tuple[int | None, list[int]]:
    """Send ``messages`` complete 1 MiB messages to a handler that reads none (``read=False``),
    or one at a time, each after the reply to the last, to a handler that reads each, notes the
    bytes held right after, and replies; returns the close code the client saw (``None``: still
    open) and those notes."""
    held_after_recv: list[int] = []
    all_read = asyncio.Event()

    async def handler(ws: BudgetedConnection) -> None:
        if not read:
            await ws.wait_closed()
            return
        for _ in range(messages):
            await ws.recv()
            held_after_recv.append(budget.held)
            await ws.send(b"ok")
        all_read.set()
        await ws.wait_closed()

    async with listening(handler, budget, max_message_bytes=2 * MIB) as server:
        port = server.port
        async with connect(f"ws://127.0.0.1:{port}", max_size=None) as client:
            try:
                for i in range(messages):
                    await client.send(bytes([i]) * MIB)
                    if read:  # a robot's pace: the next observation after the reply
                        await client.recv()
                if read:
                    await asyncio.wait_for(all_read.wait(), 10.0)
                    return None, held_after_recv
                await asyncio.wait_for(client.wait_closed(), 10.0)
            except ConnectionClosed:
                await asyncio.wait_for(client.wait_closed(), 10.0)
            return client.close_code, held_after_recv


def test_a_session_that_does_not_read_is_closed_once_its_queued_messages_pass_the_share() -> None:
    refused: list[int] = []
    budget = ReceiveBudget(4 * MIB, 0.5, on_refused=lambda: refused.append(1))  # 2 MiB per tenant
    code, _ = asyncio.run(_run(budget, messages=6, read=False))
    assert code == CloseCode.TRY_AGAIN_LATER
    assert refused == [1] and budget.held == 0


def test_messages_taken_by_the_session_are_released_and_nobody_is_closed() -> None:
    refused: list[int] = []
    budget = ReceiveBudget(4 * MIB, 0.5, on_refused=lambda: refused.append(1))
    code, held = asyncio.run(_run(budget, messages=6, read=True))
    assert code is None and refused == []
    assert held == [0] * 6  # each message taken leaves nothing held


def test_the_budget_is_set_from_flags_too() -> None:
    import argparse

    from chunkline.server.entrypoints.server_flags import add_server_flags, server_config_from_args

    p = argparse.ArgumentParser()
    add_server_flags(p)
    config = server_config_from_args(p.parse_args(["--no-auth", "--max-receive-buffer-bytes", str(64 * MIB),
                                                   "--tenant-receive-buffer-share", "0.25"]))
    assert (config.max_receive_buffer_bytes, config.tenant_receive_buffer_share) == (64 * MIB, 0.25)
