"""Shared pieces of the plan-door tests: a planner held until the test opens its gate, and a
planner service and session handler for one tenant on an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from chunkline.client.wire.codec import DEFAULT_LIMITS, Encoder, decode
from chunkline.client.wire.protocol import Plan, parse_client_message
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.entrypoints.connection import BudgetedConnection
from chunkline.server.entrypoints.planner_native import PlanDoor, handle_plan
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.planners import NearestTargetPlanner, PlanInput, PlanResult
from chunkline.server.planner.service import PlannerService

TENANT = TenantInfo("t")


class GatedPlanner(NearestTargetPlanner):
    """The embedded planner, held until the test opens the gate."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        await self.gate.wait()
        return await super().plan(request, deadline)


def gated_service(now: list[float], expected_plan_s: float) -> tuple[PlannerService, GatedPlanner]:
    """Planner ``g`` (one planning, one queued) on the clock ``now[0]``; start it before use."""
    planner = GatedPlanner("g")
    service = PlannerService(ServingCore(TenantRegistry({TENANT.name: TENANT})),
                             planners=[PlannerConfig(name="g", concurrency=1, max_queue=1, expected_plan_s=expected_plan_s)],
                             clock=lambda: now[0], factory=lambda cfg: planner)
    return service, planner


def plan_session(service: PlannerService, now: list[float], out: dict[str, Any]) -> Callable[[BudgetedConnection], Awaitable[None]]:
    """A session that hands every plan to ``service`` through its plan door; records in ``out``
    the clock when plan 4 was read (``read_at``) and the ids of the plans read (``read``)."""

    async def handler(ws: BudgetedConnection) -> None:
        door, encoder, tasks = PlanDoor(ws), Encoder(), []

        async def send(message: dict[str, Any]) -> None:
            await ws.send(encoder.encode(message))

        async for message in ws.messages():
            msg = parse_client_message(decode(message, DEFAULT_LIMITS))
            assert isinstance(msg, Plan)
            if msg.id == 4:
                out["read_at"] = now[0]
            out.setdefault("read", []).append(msg.id)
            tasks.append(asyncio.ensure_future(handle_plan(service, msg, TENANT, "s", send, door)))
        await asyncio.gather(*tasks)

    return handler
