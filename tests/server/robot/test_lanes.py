"""The lanes of a policy: dedicated threads fed by queues, one hand-back to the loop per batch,
hung lanes replaced, queued jobs answered at shutdown; and one watchdog timer per model."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest
from helpers import aloha_obs
from policies_for_tests import CountingPolicy
from runner_helpers import CLOCK

from chunkline.client.wire.errors import ErrorCode
from chunkline.policies.base import validate_observation
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.lanes import LanePool
from chunkline.server.robot.runner import ModelRunner
from tests.loop_helpers import until

ANON = TenantRegistry.anonymous()
TENANT = next(iter(ANON.tenants.values()))


class _Outcomes:
    """Collects ``done(result, error)`` calls and the thread each ran on."""

    def __init__(self, expected: int) -> None:
        self.got: list[tuple[Any, BaseException | None, threading.Thread]] = []
        self.expected = expected
        self.all_in = asyncio.get_running_loop().create_future()

    def done(self, result: Any, error: BaseException | None) -> None:
        self.got.append((result, error, threading.current_thread()))
        if len(self.got) == self.expected:
            self.all_in.set_result(None)


def test_jobs_run_in_order_on_the_lane_thread_and_come_back_on_the_loop() -> None:
    async def go() -> None:
        pool = LanePool("m", 1)
        out = _Outcomes(4)
        ran_on: list[str] = []

        def job(i: int) -> int:
            ran_on.append(threading.current_thread().name)
            if i == 2:
                raise ValueError("boom")
            return i * 10

        for i in range(4):
            pool.submit(0, job, (i,), out.done)
        await asyncio.wait_for(out.all_in, 5)
        pool.shutdown()
        assert ran_on == ["lane-m-0"] * 4
        assert [r for r, _, _ in out.got] == [0, 10, None, 30]
        assert isinstance(out.got[2][1], ValueError)
        assert all(t is threading.main_thread() for _, _, t in out.got)  # answered on the loop

    asyncio.run(go())


def test_a_replaced_lane_moves_its_queued_jobs_to_a_fresh_thread_and_the_old_one_exits() -> None:
    async def go() -> None:
        pool = LanePool("m", 1)
        release = threading.Event()
        out = _Outcomes(3)
        pool.submit(0, release.wait, (5.0,), out.done)  # "hangs" until released
        pool.submit(0, lambda: "queued", (), out.done)
        await asyncio.sleep(0.05)
        old = {t for t in threading.enumerate() if t.name == "lane-m-0"}
        pool.idle.clear()
        pool.replace(0)
        assert pool.idle == [0]
        pool.submit(0, lambda: "after", (), out.done)
        while len(out.got) < 2:
            await asyncio.sleep(0.01)
        assert [r for r, _, _ in out.got] == ["queued", "after"]  # ran while the old call still hangs
        release.set()
        await asyncio.wait_for(out.all_in, 5)
        assert out.got[2][0] is True  # the abandoned call's result still comes back (stale)
        for t in old:
            t.join(5)
            assert not t.is_alive()
        pool.shutdown()

    asyncio.run(go())


def test_every_lane_thread_runs_init_first_a_replacement_too_and_serves_if_it_fails() -> None:
    inits: list[str] = []

    def init() -> None:
        inits.append(threading.current_thread().name)
        if threading.current_thread().name == "lane-m-0":
            raise RuntimeError("no such setting")

    async def go() -> None:
        pool = LanePool("m", 2, init)
        out = _Outcomes(3)
        pool.submit(0, threading.current_thread, (), out.done)  # its init failed: it still serves
        pool.submit(1, threading.current_thread, (), out.done)
        await until(lambda: len(out.got) == 2, "both lanes answer")
        pool.idle.clear()
        pool.replace(1)
        pool.submit(1, threading.current_thread, (), out.done)
        await asyncio.wait_for(out.all_in, 5)
        pool.shutdown()
        assert sorted(inits) == ["lane-m-0", "lane-m-1", "lane-m-1"]
        threads = [r for r, _, _ in out.got]
        assert sorted(t.name for t in threads) == ["lane-m-0", "lane-m-1", "lane-m-1"] and len(set(threads)) == 3

    asyncio.run(go())


def test_shutdown_answers_jobs_not_started_as_cancelled() -> None:
    async def go() -> None:
        pool = LanePool("m", 1)
        release = threading.Event()
        out = _Outcomes(3)
        pool.submit(0, release.wait, (5.0,), out.done)
        pool.submit(0, lambda: 1, (), out.done)
        pool.submit(0, lambda: 2, (), out.done)
        await asyncio.sleep(0.05)
        pool.shutdown()
        release.set()
        await asyncio.wait_for(out.all_in, 5)
        errors = [e for _, e, _ in out.got]
        assert sum(isinstance(e, concurrent.futures.CancelledError) for e in errors) == 2
        assert [r for r, e, _ in out.got if e is None] == [True]

    asyncio.run(go())


class _CountingLoop:
    """Counts a running loop's thread-safe hand-offs and timers by wrapping its methods."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.threadsafe = 0
        self.timers = 0
        soon, at = loop.call_soon_threadsafe, loop.call_at

        def call_soon_threadsafe(*a: Any, **k: Any) -> Any:
            self.threadsafe += 1
            return soon(*a, **k)

        def call_at(*a: Any, **k: Any) -> Any:
            self.timers += 1
            return at(*a, **k)

        loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]
        loop.call_at = call_at  # type: ignore[method-assign]


def _runner(policy: Any, max_batch: int = 8) -> ModelRunner:
    return ModelRunner("m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=max_batch),
                       batching=BatchPolicy(max_batch_size=max_batch, max_batch_wait=0.0),
                       service=ServiceTimeModel(initial={1: 0.001}))


def test_a_batch_costs_one_hand_back_and_no_timer_of_its_own() -> None:
    policy = CountingPolicy()
    obs = validate_observation(policy.spec, aloha_obs(0))

    async def go() -> tuple[int, int, list[int]]:
        counts = _CountingLoop(asyncio.get_running_loop())
        runner = _runner(policy)
        sizes = []
        for _ in range(20):  # 20 batches of 8 (one lane: each waits for the one before)
            items = [runner.submit(obs, tenant=TENANT, session=f"s{i}", deadline=1e12) for i in range(8)]
            results = await asyncio.gather(*(i.future for i in items))
            sizes += [r.batch_size for r in results]
        await runner.stop()
        return counts.threadsafe, counts.timers, sizes

    threadsafe, timers, sizes = asyncio.run(go())
    batches = len(sizes) // 8
    assert sizes.count(1) + sizes.count(7) + sizes.count(8) == len(sizes)  # the first request may run alone
    assert threadsafe <= batches + 20 + 1  # one per batch, not one per request (160); one for the lane's stop
    assert timers <= 3  # the model's watchdog, armed once for 20 batches


def test_the_model_watchdog_fails_each_request_at_its_own_deadline_and_replaces_a_hung_lane() -> None:
    policy = CountingPolicy()
    obs = validate_observation(policy.spec, aloha_obs(0))
    release = threading.Event()

    class Hangs(CountingPolicy):
        def infer_batch(self, batch: Any) -> Any:
            release.wait(5)
            return policy.infer_batch(batch)

    async def go() -> None:
        runner = ModelRunner("m", Hangs(), quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=2),
                             batching=BatchPolicy(max_batch_size=2, max_batch_wait=0.0),
                             service=ServiceTimeModel(initial={1: 0.001}), hang_timeout=0.3, clock=CLOCK)
        now = CLOCK()
        early = runner.submit(obs, tenant=TENANT, session="a", deadline=now + 0.05)
        await asyncio.sleep(0)
        with pytest.raises(Refusal) as info:
            await asyncio.wait_for(early.future, 2)
        assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
        assert runner.healthy
        late = runner.submit(obs, tenant=TENANT, session="b", deadline=now + 100)  # behind the hung batch
        with pytest.raises(Refusal) as info:
            await asyncio.wait_for(late.future, 2)
        # Not the first request's lane but a new one: the second batch ran on the fresh thread
        # only after the first was declared hung; the hung call blocks it too (the same policy).
        assert info.value.code is ErrorCode.POLICY_FAILED
        assert not runner.healthy
        release.set()
        for _ in range(200):
            if runner.healthy:
                break
            await asyncio.sleep(0.01)
        assert runner.healthy  # the abandoned call returned
        await runner.stop()

    asyncio.run(go())
