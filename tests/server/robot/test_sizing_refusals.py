"""A request refused for its deadline while a background timing pass holds a lane is told when
the pass ends (its retry time) and why, as one refused during the idle re-measurement is."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from chunkline.client.wire.errors import ErrorCode
from chunkline.policies.base import ArraySpec, PolicySpec, validate_observation
from chunkline.policies.embedded.noop import NoopPolicy
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import BatchPolicy
from chunkline.server.robot.runner import ModelRunner
from chunkline.server.robot.sizing import BatchSizeTuner, BatchSizing

ANON = TenantRegistry.anonymous()
TENANT = next(iter(ANON.tenants.values()))
SPEC = PolicySpec(observation={"state": ArraySpec((4,), "float32")}, action_dim=2, horizon=3, dt=0.05)


class HeldTiming(NoopPolicy):
    """A batch of 2 (the first timing pass) waits until the test releases it."""

    def __init__(self) -> None:
        super().__init__("held", SPEC)
        self.release = threading.Event()

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        if len(obs["state"]) == 2:
            self.release.wait(10)
        return super().infer_batch(obs)


def obs(seed: int) -> dict[str, Any]:
    return validate_observation(SPEC, {"state": np.full(4, seed, np.float32)})


async def until_timed(runner: ModelRunner) -> None:
    for _ in range(1000):  # bounded: the lane thread ends the pass meanwhile
        if runner.sizing is not None and runner.sizing.timing is None:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the timing pass did not end")

ALONE = Refusal(ErrorCode.DEADLINE_UNMEETABLE, "predicted to finish in 400.0 ms, budget is 100.0 ms")


def test_a_refusal_without_a_retry_time_during_a_timing_pass_gets_the_pass_end() -> None:
    tuner = BatchSizeTuner("m", BatchPolicy(max_batch_size=16), BatchSizing(16))
    tuner.serving(100.0)
    assert tuner.while_timing(ALONE, 100.0) is ALONE, "no pass: nothing to wait for"
    tuner.start(2, 100.0, 0.4)
    during = tuner.while_timing(ALONE, 100.1)
    assert during.code is ErrorCode.DEADLINE_UNMEETABLE and during.retry_after_ms == pytest.approx(300.0)
    assert during.message.endswith("; batch 2 is being timed in the background (planned to end in 300 ms)")
    late = tuner.while_timing(ALONE, 100.5)
    assert late.retry_after_ms == pytest.approx(400.0) and "100 ms past its planned 400 ms" in late.message
    # a refusal with its own retry time, or of another kind, is answered as it is
    waits = Refusal(ErrorCode.DEADLINE_UNMEETABLE, "short", 20.0)
    full = Refusal(ErrorCode.OVERLOADED, "queue full")
    assert tuner.while_timing(waits, 100.1) is waits and tuner.while_timing(full, 100.1) is full
    tuner.timed(2, 0.3, None, 100.3)
    assert tuner.while_timing(ALONE, 100.35) is ALONE, "the pass has ended"


def test_a_runner_timing_in_the_background_tells_a_refused_robot_when_to_retry() -> None:
    """Batch 1 planned at 200 ms (a slow warm-up): a 100 ms request is unmeetable alone, and
    the idle re-measurement that would say so waits for the pass of batch 2 (planned 400 ms);
    once the pass has ended, the retry is served."""
    clock = [100.0]
    policy = HeldTiming()

    async def go() -> tuple[Refusal, int]:
        runner = ModelRunner("m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=16),
                             batching=BatchPolicy(max_batch_size=16, max_batch_wait=0.0),
                             service=ServiceTimeModel(initial={1: 0.2}), sizing=BatchSizing(16), clock=lambda: clock[0])
        runner.start_background_timing()  # no request yet: the pass of batch 2 starts at once
        assert runner.sizing is not None and runner.sizing.timing == 2
        clock[0] += 0.15
        with pytest.raises(Refusal) as during:
            runner.submit(obs(0), tenant=TENANT, session="s", deadline=clock[0] + 0.1)
        assert runner.remeasure.future is None, "no re-measurement while the pass holds the lane"
        policy.release.set()
        await until_timed(runner)
        clock[0] += 0.25  # the retry time given: the pass's time has corrected the stale estimate
        result = await runner.submit(obs(1), tenant=TENANT, session="s", deadline=clock[0] + 0.1).future
        await runner.stop()
        return during.value, result.batch_size

    during, size = asyncio.run(go())
    assert during.code is ErrorCode.DEADLINE_UNMEETABLE and during.retry_after_ms == pytest.approx(250.0)
    assert "batch 2 is being timed in the background (planned to end in 250 ms)" in during.message
    assert size == 1
