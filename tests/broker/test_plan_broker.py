"""The plan broker's shells: requests off the control loop (a thread, an asyncio task), replies
and failures fed back to the core, a silent planner ending in the safe subtask."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from chunkline.broker.plan_broker import AsyncPlanBroker, PlanBrokerConfig, PlanRequest, SyncPlanBroker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def answer(req: PlanRequest) -> dict[str, Any]:
    return {"plan_id": f"p{req.request_id}", "expires": req.obs_time + 10.0,
            "plan": {"steps": [{"skill": "goto", "target": "t1", "goal": [0.1, 0.0]}], "note": ""}}


def test_sync_shell_runs_requests_on_a_thread_and_falls_back_when_the_planner_goes_silent() -> None:
    clock = Clock()
    release = threading.Event()
    calls: list[PlanRequest] = []
    second = threading.Event()

    def request(req: PlanRequest) -> dict[str, Any]:
        calls.append(req)
        if len(calls) > 1:
            second.set()
            release.wait(5)
            raise ConnectionError("planner down")
        return answer(req)

    broker = SyncPlanBroker(request, clock, PlanBrokerConfig(request_timeout_s=1.0, outage_bound_s=0.5))
    try:
        assert broker.tick().safe  # nothing yet: hold, and the first request goes out
        for _ in range(200):  # bounded wait for the worker thread's answer
            if broker.core.plan_id is not None:
                break
            clock.t += 0.001
            broker.tick()
        assert broker.tick().target == "t1"
        broker.subtask_done()  # the only step is done: a new request that will hang
        assert broker.tick().safe and second.wait(5)  # plan exhausted: the safe subtask while asking
        clock.t += 1.5
        assert broker.tick().safe and broker.core.outage_since is not None
    finally:
        release.set()
        broker.close()


def test_async_shell_feeds_replies_and_errors_back() -> None:
    async def main() -> None:
        clock = Clock()
        fail = True

        async def request(req: PlanRequest) -> dict[str, Any]:
            if fail:
                raise RuntimeError("plan_invalid")
            return answer(req)

        broker = AsyncPlanBroker(request, clock, PlanBrokerConfig(retry_s=0.1))
        assert broker.tick().safe
        await asyncio.sleep(0)
        clock.t = 0.05
        broker.tick()
        assert broker.core.stats["failures"] == 1
        fail = False
        clock.t = 0.2
        broker.tick()  # the retry goes out
        await asyncio.sleep(0)
        assert broker.tick().target == "t1" and broker.core.outage_since is None
        await broker.close()

    asyncio.run(main())


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlanBrokerConfig(outage_bound_s=0)
    with pytest.raises(ValueError):
        PlanBrokerConfig(safe_skill="dance")
