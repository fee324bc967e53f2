"""A large plan sent inside its planner's retry window is held after its first bytes: the server
reads nothing more of it (the rest stays in the client's buffers, TCP flow control) until the
window ends, then reads it and plans it; a plan outside any window is read on at once.

The robot port's listener on loopback with a real client sending out-of-band plans, the session's
plan door over the real connection, the planner class on an injected clock; the test waits on
the connection's state and the client's buffers, never on a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from listener_helpers import MIB, listening
from plan_helpers import GatedPlanner, gated_service, plan_session
from websockets.asyncio.client import ClientConnection, connect

from chunkline.client.wire.codec import DEFAULT_LIMITS, Encoder, decode
from chunkline.server.entrypoints.frame_reader import SCRATCH_BYTES
from chunkline.server.entrypoints.planner_native import RECEIVE_BUDGET_RETRY_MS
from chunkline.server.entrypoints.receive_budget import ReceiveBudget
from tests.loop_helpers import until

#: What is left of the window when the large plan arrives (the loop's real time it is held).
LEFT_S = 0.3


def _plan(i: int, image_bytes: int = 0) -> dict[str, Any]:
    obs: dict[str, Any] = {"position": np.zeros(2, np.float32), "targets": np.array([[1, 0.1, 0.0]], np.float32)}
    if image_bytes:
        obs["images/cam"] = np.ones((image_bytes // 3072, 1024, 3), np.uint8)
    return {"type": "plan", "id": i, "obs": obs, "instruction": f"plan {i}", "deadline_ms": 60_000.0}


@dataclasses.dataclass(slots=True)
class _Refused:
    """A session whose plan 1 (6 MiB of image) holds its observation while it plans, and whose
    plan 2, as large, was refused for the receive budget (``refused``)."""

    now: list[float]
    planner: GatedPlanner
    budget: ReceiveBudget
    out: dict[str, Any]
    server: Any
    client: ClientConnection
    encoder: Encoder
    refused: dict[str, Any]


@contextlib.asynccontextmanager
async def _second_plan_refused() -> AsyncIterator[_Refused]:
    now = [100.0]
    service, planner = gated_service(now, expected_plan_s=0.01)
    await service.start()
    budget = ReceiveBudget(16 * MIB, 1.0)  # plans may hold 8 MiB: one 6 MiB image, not two
    out: dict[str, Any] = {}
    async with listening(plan_session(service, now, out), budget, max_message_bytes=16 * MIB) as server:
        async with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as client:
            encoder = Encoder()
            await client.send(encoder.encode_oob(_plan(1, 6 * MIB)))
            await client.send(encoder.encode_oob(_plan(2, 6 * MIB)))
            refused = decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS)
            yield _Refused(now, planner, budget, out, server, client, encoder, refused)
    await service.stop()


def test_a_large_plan_inside_its_retry_window_is_held_after_its_first_bytes_until_the_window_ends() -> None:
    async def go() -> dict[str, Any]:
        now = [100.0]
        service, planner = gated_service(now, expected_plan_s=0.01)
        await service.start()
        budget = ReceiveBudget(1 << 30, 1.0)
        out: dict[str, Any] = {}
        handler = plan_session(service, now, out)

        async with listening(handler, budget, max_message_bytes=64 * MIB) as server:
            async with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as client:
                encoder = Encoder()
                for i in (1, 2, 3):  # one planning (held by the planner's gate), one queued, one refused
                    await client.send(encoder.encode_oob(_plan(i)))
                refused = decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS)
                (connection,) = server.connections
                now[0] += refused["retry_after_ms"] / 1000.0 - LEFT_S  # LEFT_S of the window left
                large = encoder.encode_oob(_plan(4, 32 * MIB))  # more than loopback's buffers take
                sending = asyncio.ensure_future(client.send(large))
                await until(lambda: connection.reading_held, "reading held")
                await until(lambda: client.transport.get_write_buffer_size() > 0, "the client's buffer in use")
                out["held_bytes"] = budget.holding(connection)
                out["backed_up"] = not sending.done()
                now[0] += LEFT_S  # the window has ended on the service's clock
                await sending
                await until(lambda: not connection.reading_held, "the hold ended")
                planner.gate.set()
                replies = [decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS) for _ in range(3)]
                out["replies"] = {r["id"]: r for r in replies}
                out["refused"] = refused
                out["length"] = len(large)
        await service.stop()
        return out

    out = asyncio.run(go())
    assert out["refused"]["id"] == 3 and out["refused"]["code"] == "overloaded"
    # Held after the first read of the frame: the payload's first bytes (and the running plans'
    # observations, a few bytes), no more.
    assert out["held_bytes"] <= SCRATCH_BYTES + 1024 < out["length"] // 100
    assert out["backed_up"]
    assert out["read_at"] == 100.0 + out["refused"]["retry_after_ms"] / 1000.0  # read once the window had ended
    assert out["replies"][4]["type"] == "plan_reply"  # then planned, not refused at the door
    assert {out["replies"][i]["type"] for i in (1, 2)} == {"plan_reply"}


def test_a_large_plan_being_read_when_a_retry_window_opens_is_held_from_then_on() -> None:
    # Plan 3 is refused while plan 4, sent right behind it, is being read: the gate let plan 4's
    # first bytes through before the window opened, and is asked again as it opens.
    async def go() -> dict[str, Any]:
        now = [100.0]
        service, planner = gated_service(now, expected_plan_s=0.5)
        await service.start()
        out: dict[str, Any] = {}
        handler = plan_session(service, now, out)

        async with listening(handler, max_message_bytes=64 * MIB) as server:
            async with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as client:
                encoder = Encoder()
                for i in (1, 2):  # one planning (held by the planner's gate), one queued
                    await client.send(encoder.encode_oob(_plan(i)))
                await client.send(encoder.encode_oob(_plan(3)))  # refused: the queue is full
                sending = asyncio.ensure_future(client.send(encoder.encode_oob(_plan(4, 32 * MIB))))
                refused = decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS)
                (connection,) = server.connections
                await until(lambda: connection.reading_held, "reading held")
                await until(lambda: client.transport.get_write_buffer_size() > 0, "the client's buffer in use")
                out["backed_up"] = not sending.done()
                now[0] += refused["retry_after_ms"] / 1000.0  # the window has ended on the service's clock
                await sending
                planner.gate.set()
                replies = [decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS) for _ in range(3)]
                out["replies"] = {r["id"]: r for r in replies}
                out["refused"] = refused
        await service.stop()
        return out

    out = asyncio.run(go())
    assert out["refused"]["id"] == 3 and out["refused"]["code"] == "overloaded"
    assert out["backed_up"]
    assert out["read_at"] == 100.0 + out["refused"]["retry_after_ms"] / 1000.0  # read once the window had ended
    assert out["replies"][4]["type"] == "plan_reply"  # then planned, not refused at the door


def test_once_a_plan_did_not_fit_a_large_plan_that_would_not_either_is_refused_from_its_first_bytes_and_dropped_unread() -> None:
    # Plan 1 holds its observation while it plans; plan 2, read whole, does not fit beside it and
    # is refused. After the retry time plan 3, as large, would not fit either: refused from its
    # first bytes (its id read there) and its body dropped as it arrives, never buffered whole nor
    # handed to the session; the frames behind it are read as ever.
    async def go() -> dict[str, Any]:
        async with _second_plan_refused() as t:
            now, client, encoder, out = t.now, t.client, t.encoder, t.out
            now[0] += t.refused["retry_after_ms"] / 1000.0  # the window has ended
            await client.send(encoder.encode_oob(_plan(3, 6 * MIB)))
            out["at_peek"] = decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS)
            now[0] += out["at_peek"]["retry_after_ms"] / 1000.0
            await client.send(encoder.encode_oob(_plan(4)))  # small: fits, planned
            t.planner.gate.set()
            replies = [decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS) for _ in range(2)]
            out["replies"] = {r["id"]: r for r in replies}
            out["refused"] = t.refused
            (connection,) = t.server.connections
            await until(lambda: t.budget.holding(connection) == 0, "every reservation released")
        return out

    out = asyncio.run(go())
    assert out["refused"]["id"] == 2 and out["refused"]["code"] == "overloaded"
    assert out["at_peek"]["id"] == 3 and out["at_peek"]["code"] == "overloaded" and out["at_peek"]["retry_after_ms"] > 0
    assert out["read"] == [1, 2, 4]  # plan 3 never reached the session
    assert {out["replies"][i]["type"] for i in (1, 4)} == {"plan_reply"}


def test_a_large_plan_held_until_its_window_ends_is_asked_about_the_budget_then_and_dropped_if_it_still_would_not_fit() -> None:
    async def go() -> dict[str, Any]:
        async with _second_plan_refused() as t:
            now, client, encoder, out = t.now, t.client, t.encoder, t.out
            (connection,) = t.server.connections
            now[0] += t.refused["retry_after_ms"] / 1000.0 - LEFT_S  # LEFT_S of the window left
            sending = asyncio.ensure_future(client.send(encoder.encode_oob(_plan(3, 6 * MIB))))
            await until(lambda: connection.reading_held, "reading held")
            now[0] += LEFT_S  # the window has ended on the service's clock; the hold ends on the loop's
            out["after_hold"] = decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS)
            await sending
            now[0] += out["after_hold"]["retry_after_ms"] / 1000.0
            await client.send(encoder.encode_oob(_plan(4)))
            t.planner.gate.set()
            replies = [decode(await asyncio.wait_for(client.recv(), 10), DEFAULT_LIMITS) for _ in range(2)]
            out["replies"] = {r["id"]: r for r in replies}
        return out

    out = asyncio.run(go())
    assert out["after_hold"]["id"] == 3 and out["after_hold"]["code"] == "overloaded"
    assert out["after_hold"]["retry_after_ms"] == RECEIVE_BUDGET_RETRY_MS  # a new window, not the one it was held in
    assert out["read"] == [1, 2, 4]
    assert {out["replies"][i]["type"] for i in (1, 4)} == {"plan_reply"}
