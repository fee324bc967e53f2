"""The planner class on the serving core, without a network: admission by deadline, priority
between tenants, cancellation, drops, the failure of one plan alone, and accounting under class
``plan``."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import Refusal
from chunkline.server.planner.config import PlannerConfig
from chunkline.server.planner.planners import NearestTargetPlanner, PlanInput, PlanResult
from chunkline.server.planner.service import PlannerService


class GatedPlanner(NearestTargetPlanner):
    """The embedded planner, held until the test releases it; ``fail`` makes the next plan raise."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()
        self.order: list[str | None] = []
        self.fail = False

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        await self.gate.wait()
        self.order.append(request.instruction)
        if self.fail:
            raise RuntimeError("planner bug")
        return await super().plan(request, deadline)


TENANTS = [TenantInfo("low", class_priority={"plan": 0}), TenantInfo("high", class_priority={"plan": 10}), TenantInfo("t"),
           TenantInfo("robots", classes=frozenset({"policy"}))]
OBS = {"position": np.zeros(2, np.float32), "targets": np.array([[1, 0.1, 0.0]], np.float32)}


def make(concurrency: int = 1) -> tuple[PlannerService, GatedPlanner]:
    planner = GatedPlanner("g")
    core = ServingCore(TenantRegistry({t.name: t for t in TENANTS}))
    service = PlannerService(core, planners=[PlannerConfig(name="g", concurrency=concurrency, expected_plan_s=0.01)],
                             factory=lambda cfg: planner)
    return service, planner


def test_priority_cancel_drop_and_accounting() -> None:
    async def main() -> None:
        service, planner = make()
        await service.start()
        low, high = TENANTS[0], TENANTS[1]
        first = service.submit(PlanInput(OBS, instruction="first"), None, low, "s1")
        queued_low = service.submit(PlanInput(OBS, instruction="low"), None, low, "s1")
        queued_high = service.submit(PlanInput(OBS, instruction="high"), None, high, "s2")
        assert service.busy_above(5) and not service.busy_above(10) and service.in_flight == 3
        doomed = service.submit(PlanInput(OBS, instruction="doomed"), None, low, "s3", deadline_ms=5000.0)
        service.release_session("s3")  # its robot left: withdrawn from the queue
        with pytest.raises(Refusal) as info:
            await doomed.result
        assert info.value.code_str == "cancelled"
        planner.gate.set()
        results = await asyncio.gather(first.result, queued_low.result, queued_high.result)
        assert planner.order == ["first", "high", "low"]  # the higher plan priority overtakes the queue
        assert all(r.document.steps[0].target == "t1" for r in results) and not service.busy_above(-1)
        outcomes = service.core.accounting.outcomes
        assert outcomes["ok"] == 3 and outcomes["cancelled"] == 1
        await service.stop()

    asyncio.run(main())


def test_a_failing_planner_fails_its_request_alone_and_deadlines_hold() -> None:
    async def main() -> None:
        service, planner = make(concurrency=2)
        await service.start()
        tenant = TENANTS[2]
        planner.fail = True
        job = service.submit(PlanInput(OBS), None, tenant, "s")
        planner.gate.set()
        with pytest.raises(Refusal) as info:
            await job.result
        assert info.value.code_str == "policy_failed"
        planner.fail = False
        planner.gate.clear()
        slow = service.submit(PlanInput(OBS), None, tenant, "s", deadline_ms=50.0)
        with pytest.raises(Refusal) as info:
            await slow.result
        assert info.value.code_str == "deadline_exceeded"
        planner.gate.set()
        assert (await service.submit(PlanInput(OBS), None, tenant, "s").result).attempts == 1
        with pytest.raises(Refusal) as refused:
            service.submit(PlanInput(OBS), "other", tenant, "s")
        assert refused.value.code_str == "unknown_model"
        with pytest.raises(Refusal) as refused:
            service.submit(PlanInput(OBS), None, TENANTS[3], "s")
        assert refused.value.code_str == "forbidden"
        await service.stop()
        with pytest.raises(Refusal) as refused:
            service.submit(PlanInput(OBS), None, tenant, "s")
        assert refused.value.code_str == "shutting_down"

    asyncio.run(main())


@pytest.mark.parametrize("obs,subtask,expected", [
    ({"position": [0.0, 0.0], "targets": [[5, 0.3, 0.0], [2, 0.1, 0.0], [9, 0.2, 0.0]]}, None, ["t2", "t9", "t5"]),
    ({"position": [0.0, 0.0], "targets": [[5, 0.3, 0.0], [2, 0.1, 0.0], [9, 0.2, 0.0]]}, "t5", ["t5", "t9", "t2"]),  # keeps its subtask
    ({"position": [0.0, 0.0], "targets": [[4, 0.1, 0.0], [3, -0.1, 0.0]]}, None, ["t3", "t4"]),  # a tie: the smaller id
    ({"position": [0.0, 0.0], "targets": np.zeros((0, 3))}, None, [None]),  # nothing left: hold
])
def test_the_embedded_planner_plans_a_greedy_tour_from_the_observation(obs: dict[str, Any], subtask: str | None,
                                                                       expected: list[str | None]) -> None:
    arrays = {k: np.asarray(v, np.float32) for k, v in obs.items()}
    plan = NearestTargetPlanner("tour").tour(PlanInput(arrays, subtask=subtask))
    assert [s.target for s in plan.steps] == expected


class _RefusingPlanner(GatedPlanner):
    """Answers as told: a plan, a refusal, or a bug, after reading the observation."""

    def __init__(self, name: str, answer: str) -> None:
        super().__init__(name)
        self.answer = answer

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        assert request.obs["camera"].shape == (64, 64, 3)
        if self.answer == "refusal":
            raise Refusal(ErrorCode.OVERLOADED, "upstream busy")
        if self.answer == "bug":
            raise RuntimeError("planner bug")
        return await super().plan(request, deadline)


@pytest.mark.parametrize("answer", ["plan", "refusal", "bug"])
def test_a_finished_plan_lets_its_observation_go_without_waiting_for_the_cycle_collector(answer: str) -> None:
    # A plan's observation (megabytes of camera image) must be freed when the plan ends, not when
    # Python's cycle collector next runs a full pass: the receive budget has let those bytes go.
    import gc
    import weakref

    async def main() -> weakref.ref[np.ndarray]:
        planner = _RefusingPlanner("g", answer)
        planner.gate.set()
        core = ServingCore(TenantRegistry({t.name: t for t in TENANTS}))
        service = PlannerService(core, planners=[PlannerConfig(name="g", expected_plan_s=0.01)], factory=lambda cfg: planner)
        await service.start()
        image = np.zeros((64, 64, 3), np.uint8)
        gone = weakref.ref(image)
        job = service.submit(PlanInput({**OBS, "camera": image}), None, TENANTS[2], "s")
        del image
        try:
            await job.result
        except Refusal:
            pass
        del job
        await service.stop()
        return gone

    gc.collect()
    gc.disable()
    try:
        gone = asyncio.run(main())
        assert gone() is None
    finally:
        gc.enable()
