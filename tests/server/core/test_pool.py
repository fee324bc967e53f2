"""The request-class skeleton (:class:`~chunkline.server.core.pool.ModelPool`) with a recording
class: admission, one guarded kick, cancel, stop, drops and the controller's own counts."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, PolicyCost, Request, ServiceTimeModel
from chunkline.server.core.pool import ModelPool
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import Refusal


@dataclasses.dataclass(eq=False)
class Job:
    id: int
    session: str = "s"
    admission: Request | None = None
    started: float | None = None


class Recorder:
    """A class that launches, aborts and ends jobs by writing down what it was asked."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        self.launched: list[int] = []
        self.aborted: list[int] = []
        self.ended: list[tuple[int, ErrorCode]] = []
        self.changes = 0
        self.on_launch: Callable[[Job], None] | None = None
        self.pool: ModelPool[Job] | None = None

    compatible = None

    def batch_size(self, now: float) -> int:
        assert self.pool is not None
        return 1 if self.pool.running < self.capacity else 0

    def launch(self, batch: list[Request], now: float) -> None:
        (request,) = batch
        job: Job = request.payload
        self.launched.append(job.id)
        if self.on_launch is not None:
            self.on_launch(job)

    def abort(self, job: Job, refusal: Refusal) -> None:
        self.aborted.append(job.id)

    def end_unstarted(self, job: Job, refusal: Refusal) -> None:
        self.ended.append((job.id, refusal.code))

    def changed(self) -> None:
        self.changes += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(capacity: int = 1, max_queue: int = 8) -> tuple[ModelPool[Job], Recorder, Clock]:
    clock, recorder = Clock(), Recorder(capacity)
    quotas = QuotaManager(TenantRegistry({"a": TenantInfo("a")}))
    admission = AdmissionController("m", quotas, AdmissionConfig(max_queue=max_queue, max_batch_size=1, workers=capacity),
                                    ServiceTimeModel(initial={1: 0.01}))
    recorder.pool = pool = ModelPool(admission, clock, recorder)
    return pool, recorder, clock


def job(i: int, session: str = "s", deadline: float = 1000.0) -> Job:
    j = Job(i, session)
    j.admission = Request(id=i, session=session, tenant="a", cls="test", cost=PolicyCost(), deadline=deadline, payload=j)
    return j


def req(j: Job) -> Request:
    assert j.admission is not None
    return j.admission


def run(body: Callable[[], None]) -> None:
    async def main() -> None:
        body()

    asyncio.run(main())


def test_jobs_start_as_slots_free_and_the_counts_are_the_controllers() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=2)
        jobs = [job(i) for i in range(4)]
        for j in jobs:
            pool.admit(req(j), clock())
        assert rec.launched == [0, 1] and pool.running == 2 and pool.queued == 2 and len(pool.jobs) == 4
        assert jobs[0].started == clock.now and jobs[2].started is None
        pool.finish(req(jobs[0]), clock())
        assert 0 not in pool.jobs and rec.launched == [0, 1]  # the class records first, then kicks
        pool.kick()
        assert rec.launched == [0, 1, 2] and pool.running == 2 and pool.queued == 1

    run(body)


def test_a_job_that_ends_inside_its_launch_does_not_re_enter_the_kick() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=1)
        depth = [0, 0]

        def finish_at_once(j: Job) -> None:
            depth[0] += 1
            depth[1] = max(depth[1], depth[0])
            pool.finish(req(j), clock())
            pool.kick()  # asked for inside the running kick: folded into it
            depth[0] -= 1

        jobs = [job(i) for i in range(5)]
        for j in jobs:
            pool.admit(req(j), clock())
        assert rec.launched == [0] and pool.queued == 4
        rec.on_launch = finish_at_once  # from now on every job ends inside its launch
        pool.finish(req(jobs[0]), clock())
        pool.kick()
        assert rec.launched == [0, 1, 2, 3, 4] and depth[1] == 1 and not pool.jobs and pool.running == 0

    run(body)


def test_cancel_ends_a_queued_job_and_aborts_a_running_one() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=1)
        running, queued = job(1), job(2)
        pool.admit(req(running), clock())
        pool.admit(req(queued), clock())
        pool.cancel(queued)
        assert rec.ended == [(2, ErrorCode.CANCELLED)] and pool.queued == 0 and 2 not in pool.jobs
        pool.cancel(running)
        assert rec.aborted == [1] and 1 in pool.jobs  # its finish still follows
        pool.finish(req(running), clock())
        pool.cancel(running)  # ended: nothing more happens
        assert rec.aborted == [1] and not pool.jobs

    run(body)


def test_release_session_withdraws_only_that_sessions_jobs() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=1)
        for i, session in enumerate(["x", "y", "x", "y"]):
            pool.admit(req(job(i, session)), clock())
        pool.release_session("x")
        assert rec.aborted == [0] and rec.ended == [(2, ErrorCode.CANCELLED)]
        assert sorted(pool.jobs) == [0, 1, 3]

    run(body)


def test_stop_ends_queued_jobs_aborts_running_ones_and_starts_nothing() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=1)
        first, second = job(1), job(2)
        pool.admit(req(first), clock())
        pool.admit(req(second), clock())
        pool.stop()
        assert rec.ended == [(2, ErrorCode.SHUTTING_DOWN)] and rec.aborted == [1]
        pool.finish(req(first), clock())
        pool.kick()
        assert rec.launched == [1] and not pool.jobs

    run(body)


def test_a_refused_job_is_not_kept() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=1, max_queue=1)
        pool.admit(req(job(1)), clock())
        pool.admit(req(job(2)), clock())
        with pytest.raises(Refusal) as refused:
            pool.admit(req(job(3)), clock())
        assert refused.value.code is ErrorCode.OVERLOADED and 3 not in pool.jobs and pool.queued == 1

    run(body)


def test_a_queued_job_past_its_deadline_is_dropped_and_answered_when_a_slot_frees() -> None:
    def body() -> None:
        pool, rec, clock = make(capacity=1)
        first, late = job(1), job(2, deadline=clock.now + 1.0)
        pool.admit(req(first), clock())
        pool.admit(req(late), clock())
        clock.now += 5.0
        pool.finish(req(first), clock())
        pool.kick()
        assert rec.ended == [(2, ErrorCode.DEADLINE_EXCEEDED)] and rec.launched == [1] and not pool.jobs

    run(body)


class Batcher(Recorder):
    """A class that starts up to ``size`` jobs together on each of its ``capacity`` workers."""

    def __init__(self, capacity: int, size: int) -> None:
        super().__init__(capacity)
        self.size = size
        self.batches: list[list[int]] = []
        self.busy = 0

    def batch_size(self, now: float) -> int:
        return self.size if self.busy < self.capacity else 0

    def launch(self, batch: list[Request], now: float) -> None:
        self.busy += 1
        self.batches.append([r.payload.id for r in batch])


def test_a_batching_class_draws_batches_and_finishes_them_whole() -> None:
    def body() -> None:
        clock, rec = Clock(), Batcher(capacity=1, size=3)
        quotas = QuotaManager(TenantRegistry({"a": TenantInfo("a")}))
        admission = AdmissionController("m", quotas, AdmissionConfig(max_queue=8, max_batch_size=3, workers=1),
                                        ServiceTimeModel(initial={1: 0.01, 3: 0.02}))
        pool: ModelPool[Job] = ModelPool(admission, clock, rec)
        jobs = [job(i) for i in range(5)]
        for j in jobs:
            pool.offer(req(j), clock())  # queued, nothing started until the kick
        assert rec.batches == [] and pool.queued == 5
        pool.kick()
        assert rec.batches == [[0, 1, 2]] and pool.running == 3 and all(j.started == clock.now for j in jobs[:3])
        pool.finish_batch([req(j) for j in jobs[:3]], clock(), 0.02)
        rec.busy = 0
        assert pool.running == 0 and sorted(pool.jobs) == [3, 4]
        pool.kick()
        assert rec.batches == [[0, 1, 2], [3, 4]] and pool.queued == 0

    run(body)
