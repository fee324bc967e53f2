"""The queue chores every request class shares: draw order, drop answers, expiry."""

from __future__ import annotations

import asyncio

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, PolicyCost, Request, ServiceTimeModel
from chunkline.server.core.queue_chores import QueueChores
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import Refusal


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admission(max_queue: int = 8) -> AdmissionController:
    reg = TenantRegistry({"a": TenantInfo("a")})
    cfg = AdmissionConfig(max_queue=max_queue, max_batch_size=1, workers=1, drop_late=True)
    return AdmissionController("m", QuotaManager(reg), cfg, ServiceTimeModel(deviation_factor=0.0, initial={1: 0.01}))


def offer(core: AdmissionController, rid: int, deadline: float, now: float, priority: int = 0) -> None:
    decision = core.offer(Request(rid, "s", "a", "plan", PolicyCost(), deadline, priority, payload=f"job{rid}"), now)
    assert isinstance(decision, Admitted)


def test_take_follows_admission_and_answers_drops_once() -> None:
    clock = Clock()
    core = admission()
    dropped: list[tuple[str, Refusal]] = []
    queue = QueueChores(core, clock, lambda job, refusal: dropped.append((job, refusal)))
    offer(core, 1, deadline=0.05, now=0.0)
    offer(core, 2, deadline=1.0, now=0.0, priority=5)
    assert [r.payload for r in queue.take(0.0, 1)] == ["job2"]  # priority first
    clock.now = 0.2  # job1's budget ran out while it waited
    assert queue.take(clock.now, 1) == []
    assert [(job, r.code) for job, r in dropped] == [("job1", ErrorCode.DEADLINE_EXCEEDED)]
    queue.answer_dropped()
    assert len(dropped) == 1  # each drop is answered exactly once


def test_expiry_answers_a_queued_request_with_nothing_else_happening() -> None:
    async def main() -> tuple[str, ErrorCode, int]:
        loop = asyncio.get_running_loop()
        core = admission()
        answered: asyncio.Future[tuple[str, ErrorCode]] = loop.create_future()
        refreshed: list[int] = []
        queue = QueueChores(core, loop.time, lambda job, r: answered.set_result((job, r.code)), lambda: refreshed.append(1))
        offer(core, 1, deadline=loop.time() + 0.02, now=loop.time())
        queue.arm_expiry()
        job, code = await asyncio.wait_for(answered, 5.0)
        queue.close()
        return job, code, len(refreshed)

    assert asyncio.run(main()) == ("job1", ErrorCode.DEADLINE_EXCEEDED, 1)


def test_close_stops_the_expiry_timer() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        core = admission()
        calls: list[str] = []
        queue = QueueChores(core, loop.time, lambda job, r: calls.append(job))
        offer(core, 1, deadline=loop.time() + 0.03, now=loop.time())
        queue.arm_expiry()
        queue.close()
        # Run the loop past the deadline: a closed queue's timer must not fire.
        await asyncio.sleep(0.1)
        return len(calls)

    assert asyncio.run(main()) == 0
