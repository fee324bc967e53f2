"""A session's door for plans: a plan sent inside the retry window its planner gave is answered at
the door with the time still to wait, and the connection is held back until the window ends (no
read of every message such a client sends); the observation a plan holds is reserved in the
receive budget until its answer, and a plan that does not fit is refused with a retry time.

The planner class on the serving core with an injected clock, a stand-in connection that records
what the door asks of it; no network, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import numpy as np
import pytest
from plan_helpers import TENANT, GatedPlanner, gated_service

from chunkline.client.wire.codec import Encoder
from chunkline.client.wire.errors import CloseCode, ErrorCode
from chunkline.client.wire.protocol import Plan
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.planner_native import (
    HOLD_MARGIN_S,
    PLANS_SHARE,
    RECEIVE_BUDGET_RETRY_MS,
    PlanDoor,
    handle_plan,
    observation_bytes,
)
from chunkline.server.entrypoints.receive_budget import ReceiveBudget
from chunkline.server.entrypoints.robot_native import SENT_EARLY
from chunkline.server.planner.service import PlannerService

OBS = {"position": np.zeros(2, np.float32), "targets": np.array([[1, 0.1, 0.0]], np.float32)}


class Connection:
    """What the door uses of a connection: reservations that fit up to ``share`` of ``room`` bytes,
    holds and closes recorded."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.reserved = 0
        self.holds: list[float] = []
        self.closed: list[int] = []
        self.gate: object = None
        self.tenant = TENANT.name
        self.budget = ReceiveBudget(room, 1.0)  # what the gate asks of a plan's first bytes
        self.queued_messages = 0
        self.dropped = 0

    def drop_body(self) -> None:
        self.dropped += 1

    def reserve(self, nbytes: int, share: float = 1.0) -> Any:
        if self.reserved + nbytes > self.room * share:
            return None
        self.reserved += nbytes
        connection = self

        class Reservation:
            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: object) -> None:
                connection.reserved -= nbytes

        return Reservation()

    def hold_reading(self, seconds: float) -> None:
        self.holds.append(seconds)

    def set_body_gate(self, gate: object) -> None:
        self.gate = gate

    def ask_gate_again(self) -> None:
        return None

    async def close(self, code: int, reason: str) -> None:
        self.closed.append(code)


def _plan(i: int) -> Plan:
    return Plan(id=i, obs=dict(OBS), instruction=f"plan {i}", deadline_ms=60_000.0)


async def _service(now: list[float]) -> tuple[PlannerService, GatedPlanner]:
    service, planner = gated_service(now, expected_plan_s=0.01)
    await service.start()
    return service, planner


def _door_with_room_for_one_plan() -> tuple[Connection, PlanDoor, list[dict[str, Any]], Callable[[dict[str, Any]], Awaitable[None]]]:
    """A connection with room for one plan's observation, its door, and a ``send`` recording into the list."""
    connection = Connection(room=int(observation_bytes(OBS) / PLANS_SHARE))
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return connection, PlanDoor(cast(BudgetedConnection, connection)), sent, send


def test_a_plan_inside_its_retry_window_is_answered_at_the_door_and_the_connection_held_until_the_window_ends() -> None:
    async def main() -> tuple[list[dict[str, Any]], list[float], int, int]:
        now = [100.0]
        service, planner = await _service(now)
        connection = Connection(room=1 << 20)
        door = PlanDoor(cast(BudgetedConnection, connection), close_after=1)
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        def plan(i: int) -> asyncio.Task[None]:
            return asyncio.ensure_future(handle_plan(service, _plan(i), TENANT, "s", send, door))

        running = [plan(1), plan(2)]  # one planning (held at the gate), one queued
        await asyncio.sleep(0)
        await plan(3)  # the queue is full: refused with a retry time
        refused = sent[-1]
        in_flight = service.in_flight
        now[0] += 0.25 * refused["retry_after_ms"] / 1000.0
        await plan(4)  # inside the window: answered at the door, the planner's queue not asked
        early = sent[-1]
        assert service.in_flight == in_flight
        await plan(5)  # again: more than close_after in a row, the session is closed
        now[0] += refused["retry_after_ms"] / 1000.0
        planner.gate.set()
        await asyncio.gather(*running)
        await plan(6)  # after the window: planned
        await service.stop()
        return [refused, early, sent[-1]], connection.holds, connection.closed[0], connection.reserved

    (refused, early, planned), holds, closed, reserved = asyncio.run(main())
    assert refused["type"] == "error" and refused["code"] == "overloaded" and refused["retry_after_ms"] > 0
    assert early["code"] == "overloaded" and SENT_EARLY in early["message"]
    assert early["retry_after_ms"] == pytest.approx(refused["retry_after_ms"] * 0.75)
    assert holds == [pytest.approx(early["retry_after_ms"] / 1000.0)]  # reading held back for exactly the rest of the window
    assert closed == CloseCode.TRY_AGAIN_LATER
    assert planned["type"] == "plan_reply" and planned["id"] == 6
    assert reserved == 0  # every reservation released with its answer


def test_a_plans_observation_is_reserved_and_one_that_does_not_fit_is_refused_with_a_retry_window() -> None:
    async def main() -> tuple[list[dict[str, Any]], int, list[float]]:
        now = [0.0]
        service, planner = await _service(now)
        connection, door, sent, send = _door_with_room_for_one_plan()

        first = asyncio.ensure_future(handle_plan(service, _plan(1), TENANT, "s", send, door))
        await asyncio.sleep(0)
        held_while_planning = connection.reserved
        await handle_plan(service, _plan(2), TENANT, "s", send, door)  # refused: no room
        now[0] += 0.5
        await handle_plan(service, _plan(3), TENANT, "s", send, door)  # inside its retry window: held
        planner.gate.set()
        await first
        await service.stop()
        return sent, held_while_planning, connection.holds

    sent, held, holds = asyncio.run(main())
    assert held == observation_bytes(OBS) == 2 * 4 + 3 * 4
    refused, early, planned = sent
    assert refused["id"] == 2 and refused["code"] == "overloaded" and refused["retry_after_ms"] == RECEIVE_BUDGET_RETRY_MS
    assert early["id"] == 3 and early["retry_after_ms"] == pytest.approx(RECEIVE_BUDGET_RETRY_MS - 500.0)
    assert holds == [pytest.approx(0.5)]
    assert planned["type"] == "plan_reply" and planned["id"] == 1


def test_the_door_has_the_connection_peek_at_large_frames_only_while_a_window_is_open() -> None:
    async def main() -> list[object]:
        now = [0.0]
        service, _ = await _service(now)
        connection = Connection(room=1 << 20)
        door = PlanDoor(cast(BudgetedConnection, connection))
        door.service = service
        plan = Encoder().encode_oob({"type": "plan", "id": 1, "obs": {"image": np.zeros((256, 256, 3), np.uint8)},
                                     "instruction": "go"})
        head = memoryview(plan)[:4096]
        seen: list[object] = [connection.gate]
        door.hold("g", ErrorCode.OVERLOADED, 500.0, now[0])
        seen += [connection.gate, door.gate(head, len(plan))]
        seen.append(door.gate(memoryview(Encoder().encode_oob({"type": "infer", "id": 2, "obs": {}}) + bytes(4096))[:4096], 9))
        now[0] += 0.5
        seen += [door.gate(head, len(plan)), connection.gate]
        await service.stop()
        return seen

    before, during, held, infer, after, gate_after = asyncio.run(main())
    assert before is None and during is not None
    assert held == pytest.approx(0.5 + HOLD_MARGIN_S)  # the rest of the window
    assert infer == 0.0  # not a plan: read on
    assert after == 0.0 and gate_after is None  # the window ended: nothing is peeked at any more


def test_once_a_plan_did_not_fit_the_gate_refuses_a_plan_that_would_not_from_its_first_bytes_after_those_read_before_it() -> None:
    async def main() -> tuple[list[Any], list[dict[str, Any]], Connection, PlanDoor]:
        now = [0.0]
        service, planner = await _service(now)
        connection, door, sent, send = _door_with_room_for_one_plan()

        image = {"type": "plan", "id": 7, "obs": {"image": np.zeros((256, 256, 3), np.uint8)}, "instruction": "go"}
        plan = Encoder().encode_oob(image)
        head = memoryview(plan)[:4096]
        seen: list[Any] = [door.gate(head, len(plan))]  # before any refusal: read on
        first = asyncio.ensure_future(handle_plan(service, _plan(1), TENANT, "s", send, door))
        await asyncio.sleep(0)
        connection.budget.update(connection, TENANT.name, connection.reserved)  # plan 1's observation, held
        await handle_plan(service, _plan(2), TENANT, "s", send, door)  # refused: no room; the door is tight
        now[0] += RECEIVE_BUDGET_RETRY_MS / 1000.0  # its window has ended
        connection.queued_messages = 1
        seen.append(door.gate(head, len(plan)))  # a message read before it is still queued: asked again shortly
        seen.append(connection.dropped)
        connection.queued_messages = 0
        seen.append(door.gate(head, len(plan)))  # refused from its first bytes, its body dropped
        seen.append(connection.dropped)
        await asyncio.sleep(0)  # the refusal is sent
        seen.append(door.gate(head, len(plan)))  # inside the window that refusal opened: held
        planner.gate.set()
        await first
        connection.budget.release(connection)
        now[0] += RECEIVE_BUDGET_RETRY_MS / 1000.0
        await handle_plan(service, _plan(3), TENANT, "s", send, door)  # fits: the door is not tight any more
        seen.append(door.tight)
        await service.stop()
        return seen, sent, connection, door

    seen, sent, connection, door = asyncio.run(main())
    unasked, shortly, not_dropped, refused_here, dropped, held, tight = seen
    assert unasked == 0.0 and shortly == HOLD_MARGIN_S and not_dropped == 0
    assert refused_here == 0.0 and dropped == 1
    answer = next(m for m in sent if m["id"] == 7)
    assert answer["code"] == "overloaded" and answer["retry_after_ms"] == RECEIVE_BUDGET_RETRY_MS
    assert held == pytest.approx(RECEIVE_BUDGET_RETRY_MS / 1000.0 + HOLD_MARGIN_S)
    assert not tight
