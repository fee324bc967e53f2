"""The capacity planner: the replica formula, the batch-size rule, the cost per qualified
result, and the service-curve measurement (with an injected clock)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.bench.capacity import (
    CapacityError,
    Fleet,
    ServicePoint,
    add_capacity_parser,
    check_passes,
    cost_per_qualified_result,
    measure_service_curve,
    plan_capacity,
    replicas_lower_bound,
)
from chunkline.bench.records import OK, RequestRecord, summarize
from chunkline.policies.base import Policy
from chunkline.policies.embedded.spec import aloha_spec


def point(b: int, ms: float) -> ServicePoint:
    return ServicePoint(batch_size=b, seconds=ms / 1000.0, p90=ms / 1000.0, samples=5)


# The DESIGN.md weight-bound example: 6 ms at batch 1, 13 ms at batch 16.
CURVE = [point(1, 6.0), point(2, 6.5), point(4, 7.5), point(8, 9.5), point(16, 13.0)]


def test_lower_bound_formula() -> None:
    assert replicas_lower_bound(100.0, 0.01, 1.0) == 1  # exactly one replica's worth
    assert replicas_lower_bound(100.0, 0.01, 0.5) == 2
    assert replicas_lower_bound(101.0, 0.01, 1.0) == 2
    assert replicas_lower_bound(10.0, 0.1, 0.5) == 2  # 2.0000000000000004 in floating point
    assert replicas_lower_bound(0.0, 0.01, 0.8) == 1  # an idle fleet still needs a server
    assert replicas_lower_bound(1000.0, 0.006, 0.8) == 8  # ceil(7.5)
    with pytest.raises(CapacityError):
        replicas_lower_bound(10.0, 0.0, 0.8)
    with pytest.raises(CapacityError):
        replicas_lower_bound(10.0, 0.01, 1.5)


@settings(max_examples=80, deadline=None)
@given(rate=st.floats(0.0, 1e5), service=st.floats(1e-5, 1.0), cap=st.floats(0.05, 1.0))
def test_lower_bound_is_the_least_count_under_the_cap(rate: float, service: float, cap: float) -> None:
    n = replicas_lower_bound(rate, service, cap)
    assert n >= 1
    assert rate * service / n <= cap * (1 + 1e-6)  # n replicas stay under the cap
    if n > 1:
        assert rate * service / (n - 1) > cap * (1 - 1e-6)  # one fewer would not


def test_plan_picks_the_cheapest_batch_that_meets_the_deadline() -> None:
    fleet = Fleet(robots=200, rate_hz=10.0, deadline_ms=100.0, peak_factor=1.5, utilisation_cap=0.8)
    plan = plan_capacity(CURVE, fleet)
    assert plan.batch_size == 16
    assert plan.service_time_s == pytest.approx(0.013 / 16)
    # ceil(3000 req/s * 0.8125 ms / 0.8) = ceil(3.046875) = 4
    assert plan.lower_bound == plan.replicas == 4
    assert plan.utilisation_at_peak == pytest.approx(3000 * 0.013 / 16 / 4)
    assert plan.headroom_at_peak == pytest.approx(1 - plan.utilisation_at_peak)
    assert plan.utilisation_at_mean == pytest.approx(plan.utilisation_at_peak / 1.5)
    assert plan.share_peak == pytest.approx(750.0) and plan.share_mean == pytest.approx(500.0)
    more = plan.with_replicas(5)
    assert more.share_peak == pytest.approx(600.0) and more.lower_bound == 4


def test_a_tight_deadline_limits_the_batch_size() -> None:
    # 2 * s(b) <= 18 ms allows batches up to 8 (9.5 ms > 9 ms excludes it): batch 4.
    fleet = Fleet(robots=100, rate_hz=10.0, deadline_ms=18.0, peak_factor=1.0, utilisation_cap=1.0)
    plan = plan_capacity(CURVE, fleet)
    assert plan.batch_size == 4
    assert plan.lower_bound == math.ceil(1000 * 0.0075 / 4)


def test_no_usable_batch_is_an_error_that_says_why() -> None:
    fleet = Fleet(robots=1, rate_hz=1.0, deadline_ms=10.0)
    with pytest.raises(CapacityError, match="at least 12.0 ms"):
        plan_capacity(CURVE, fleet)
    with pytest.raises(CapacityError):
        plan_capacity([], fleet)


def test_ties_prefer_the_smaller_batch() -> None:
    flat = [point(1, 10.0), point(2, 20.0), point(4, 40.0)]  # no gain from batching
    plan = plan_capacity(flat, Fleet(robots=10, rate_hz=10.0, deadline_ms=1000.0))
    assert plan.batch_size == 1


@pytest.mark.parametrize("kwargs", [dict(robots=0), dict(rate_hz=0.0), dict(deadline_ms=-1.0), dict(peak_factor=0.5),
                                    dict(utilisation_cap=0.0), dict(utilisation_cap=1.2), dict(rate_hz=math.nan)])
def test_bad_fleets_are_refused(kwargs: dict[str, Any]) -> None:
    base = dict(robots=10, rate_hz=5.0, deadline_ms=100.0)
    with pytest.raises(CapacityError):
        Fleet(**(base | kwargs))


def test_cost_per_qualified_result_includes_idle_capacity() -> None:
    # 4 devices at 2.50/h serve 2000 req/s on average, 99 % of them in deadline.
    cost = cost_per_qualified_result(4, 2.5, 2000.0, 0.99)
    assert cost == pytest.approx(10.0 / (2000 * 3600 * 0.99))
    # Twice the devices for the same traffic (more idle): twice the cost per result.
    assert cost_per_qualified_result(8, 2.5, 2000.0, 0.99) == pytest.approx(2 * cost)
    # Half the results qualifying: twice the cost per qualified one.
    assert cost_per_qualified_result(4, 2.5, 2000.0, 0.495) == pytest.approx(2 * cost)
    assert cost_per_qualified_result(1, 2.5, 10.0, 0.0) == math.inf
    assert cost_per_qualified_result(0, 2.5, 10.0, 1.0) == 0.0
    with pytest.raises(CapacityError):
        cost_per_qualified_result(1, 2.5, 10.0, 1.5)


def test_check_verdict_needs_both_goodput_and_p99() -> None:
    good = [RequestRecord(scheduled=0, sent=0, robot=0, outcome=OK, latency_s=0.01 + i * 1e-4, deadline_ms=50.0)
            for i in range(100)]
    assert check_passes(summarize(good, duration=1.0), 50.0, 0.99)
    slow = good[:98] + [RequestRecord(scheduled=0, sent=0, robot=0, outcome=OK, latency_s=0.2, deadline_ms=50.0)] * 2
    assert not check_passes(summarize(slow, duration=1.0), 50.0, 0.99)  # 98 % good
    assert not check_passes(summarize(good, duration=1.0), 15.0, 0.5)  # p99 over a tighter deadline


class _TimedPolicy(Policy):
    """A policy whose batch takes ``base + per_item * B`` seconds on a fake clock."""

    def __init__(self, clock: list[float], base: float, per_item: float) -> None:
        self.name = "timed"
        self.spec = aloha_spec(image_size=8)
        self._clock = clock
        self.base, self.per_item = base, per_item
        self.calls: list[int] = []

    @property
    def fingerprint(self) -> str:
        return "timed"

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        b = len(obs["state"])
        self.calls.append(b)
        self._clock[0] += self.base + self.per_item * b
        return np.zeros((b, self.spec.horizon, self.spec.action_dim), np.float32)


def test_service_curve_measurement_with_a_fake_clock() -> None:
    now = [0.0]
    policy = _TimedPolicy(now, base=0.005, per_item=0.0005)
    curve = measure_service_curve(policy, [4, 1, 16, 4], repeats=3, warmup=2, clock=lambda: now[0])
    assert [p.batch_size for p in curve] == [1, 4, 16]
    for p in curve:
        assert p.seconds == pytest.approx(0.005 + 0.0005 * p.batch_size)
        assert p.samples == 3
    # Warm-up first, then the sizes interleaved round by round.
    assert policy.calls == [1, 1, 4, 4, 16, 16] + [1, 4, 16] * 3
    plan = plan_capacity(curve, Fleet(robots=50, rate_hz=20.0, deadline_ms=100.0, peak_factor=2.0, utilisation_cap=0.5))
    assert plan.batch_size == 16
    assert plan.lower_bound == math.ceil(2000 * (0.013 / 16) / 0.5)
    with pytest.raises(CapacityError):
        measure_service_curve(policy, [0])


def test_capacity_subcommand_registers() -> None:
    parser = argparse.ArgumentParser(prog="chunkline")
    sub = parser.add_subparsers(dest="command")
    add_capacity_parser(sub)
    args = parser.parse_args(["capacity", "--robots", "10", "--rate-hz", "5", "--deadline-ms", "100", "--no-check"])
    assert args.robots == 10 and args.check is False and callable(args.func)
