"""The hierarchical MuJoCo task: both strategies finish an episode with faults, within limits,
and the plan broker holds less than blocking on each plan in the same episodes."""

from __future__ import annotations

import pytest

pytest.importorskip("gymnasium")

from chunkline.bench.closedloop.hierarchical import PlannerConditions, run_episode


def test_both_strategies_complete_within_limits_and_the_broker_holds_less() -> None:
    faults = PlannerConditions("faults", (0.2, 2.0), outage=(2.0, 5.0), wrong=0.2, invalid=0.2)
    blocking = [run_episode("blocking", faults, seed) for seed in range(3)]
    broker = [run_episode("broker", faults, seed) for seed in range(3)]
    for e in blocking + broker:
        assert e.limit_violations == 0 and e.visited <= e.targets and e.plan_requests >= 1
    assert all(e.success for e in broker)
    assert sum(e.holding_s for e in broker) < sum(e.holding_s for e in blocking)
