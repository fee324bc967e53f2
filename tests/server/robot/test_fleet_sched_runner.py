"""The fleet batch strategy in a real model runner (lanes, admission, replies): chosen by the
policy's ``batch_strategy``, fed by each request's urgency and robot weight."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from helpers import aloha_obs
from policies_for_tests import CountingPolicy
from pydantic import ValidationError
from runner_helpers import ANON, CLOCK, TENANT, Gate

from chunkline.policies.base import validate_observation
from chunkline.server.core.admission import ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.robot.config import PolicyConfig
from chunkline.server.robot.fleet import FleetSelector, FleetStrategy, Urgency
from chunkline.server.robot.runner import ModelRunner

L40S = {1: 0.073, 2: 0.1098, 3: 0.1424, 4: 0.1775, 5: 0.2111}


class CurveGate(Gate):
    """Waits for the gate, then takes the L40S curve's time for its batch size."""

    def infer_batch(self, obs: Any) -> np.ndarray:
        out = super().infer_batch(obs)
        time.sleep(L40S[len(out)])
        return out


class FixedCurve(ServiceTimeModel):
    """The L40S curve as the runner's estimate, not relearned from this machine's batch times:
    a busy machine stretches every sleep, which would move the strategy's choice with the load
    rather than with the curve under test."""

    def observe(self, batch_size: int, seconds: float) -> None:
        pass

    def observe_handoff(self, seconds: float) -> None:
        pass


def _runner(policy: Gate, fleet: bool) -> ModelRunner:
    pc = PolicyConfig(ref="noop", max_batch_size=3, max_batch_wait_ms=0.0, batch_strategy="fleet" if fleet else "admission")
    chooser = FleetSelector(FleetStrategy(), lambda t: 1.0) if pc.batch_strategy == "fleet" else None
    return ModelRunner("m", policy, quotas=QuotaManager(ANON), admission=pc.admission_config(), batching=pc.batch_policy(),
                       service=FixedCurve(deviation_factor=0.0, initial=L40S),
                       selector=chooser, clock=CLOCK)


def _results(fleet: bool) -> list[Any]:
    counting = CountingPolicy()
    gate = CurveGate(counting)
    obs = validate_observation(counting.spec, aloha_obs(0))

    async def go() -> list[Any]:
        runner = _runner(gate, fleet)
        deadline = CLOCK() + 5.0
        first = runner.submit(obs, tenant=TENANT, session="busy", deadline=deadline)  # holds the lane
        slow = [runner.submit(obs, tenant=TENANT, session=f"slow{i}", deadline=deadline, urgency=Urgency(0.3, 8, 0.05))
                for i in range(4)]
        fast = runner.submit(obs, tenant=TENANT, session="fast", deadline=deadline, urgency=Urgency(0.1, 4, 0.05),
                             robot_weight=5.0)
        gate.gate.set()
        results = await asyncio.gather(first.future, fast.future, *(s.future for s in slow))
        await runner.stop()
        return list(results)

    return asyncio.run(go())


def _batch_sizes(fleet: bool) -> tuple[int, list[int]]:
    results = _results(fleet)
    return results[1].batch_size, [r.batch_size for r in results[2:]]


def test_a_reply_says_how_many_requests_were_left_waiting_when_its_batch_ended() -> None:
    first, fast, *slow = _results(fleet=True)
    # The weighted robot rode alone while the four others waited behind it: its broker reads the
    # backlog, not its own short queueing, to tell a busy server from an idle one.
    assert (first.batch_size, first.backlog) == (1, 5) and (fast.batch_size, fast.backlog) == (1, 4)
    assert min(r.backlog for r in slow) == 0


def test_the_weighted_robot_rides_alone_under_the_fleet_strategy() -> None:
    fast, slow = _batch_sizes(fleet=True)
    assert fast == 1
    assert sorted(slow) == [1, 3, 3, 3]


def test_the_default_strategy_batches_it_with_the_others() -> None:
    fast, _ = _batch_sizes(fleet=False)
    assert fast > 1  # first come, first served at equal deadlines: it joins the last of the others


def test_batch_strategy_is_an_operator_setting() -> None:
    assert PolicyConfig(ref="noop").batch_strategy == "admission"
    assert PolicyConfig(ref="noop", batch_strategy="fleet").batch_strategy == "fleet"


def test_the_fleet_age_objective_is_an_operator_setting() -> None:
    assert PolicyConfig(ref="noop").fleet_config().age_bound_s == pytest.approx(0.6)
    assert PolicyConfig(ref="noop", fleet_age_bound_ms=450).fleet_config().age_bound_s == pytest.approx(0.45)
    assert PolicyConfig(ref="noop", fleet_age_bound_ms=None).fleet_config().age_bound_s is None
    for bad in (0, -1.0):
        with pytest.raises(ValidationError):
            PolicyConfig(ref="noop", fleet_age_bound_ms=bad)


class WaitOnce:
    """A selector that waits once for a request it expects (none comes), then picks by deadline."""

    fairness_slack = 4.0

    def __init__(self) -> None:
        from chunkline.server.core.admission import EdfSelector

        self.inner = EdfSelector()
        self.resume_at = float("inf")
        self.asked: list[float] = []

    def select(self, queue: Any, now: float, limit: int, compatible: Any) -> list[Any]:
        self.asked.append(now)
        if len(self.asked) == 1:
            self.resume_at = now + 0.02
            return []
        self.resume_at = float("inf")
        return self.inner.select(queue, now, limit, compatible)


def test_a_selector_that_waits_is_asked_again_at_the_time_it_names() -> None:
    counting = CountingPolicy()
    obs = validate_observation(counting.spec, aloha_obs(0))
    selector = WaitOnce()

    async def go() -> float:
        pc = PolicyConfig(ref="noop", max_batch_size=3, max_batch_wait_ms=0.0, batch_strategy="fleet")
        runner = ModelRunner("m", counting, quotas=QuotaManager(ANON), admission=pc.admission_config(),
                             batching=pc.batch_policy(), selector=selector, clock=CLOCK)
        item = runner.submit(obs, tenant=TENANT, session="a", deadline=CLOCK() + 5.0)
        # Nothing else happens on the runner: only its batch timer can start the batch.
        await asyncio.wait_for(item.future, timeout=3.0)
        await runner.stop()
        return item.started if item.started is not None else float("nan")

    started = asyncio.run(go())
    assert len(selector.asked) == 2 and selector.asked[1] >= selector.asked[0] + 0.02 - 0.002
    assert started == selector.asked[1]
