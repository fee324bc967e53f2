"""Closed loop at high latency: the episode that diverged at 200 ms, and real-time chunking."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("mujoco")

from chunkline.bench.closedloop.des import Conditions, LocalServer, default_broker_config, run_des_episode
from chunkline.bench.closedloop.tasks import make_task
from chunkline.policies.registry import load_policy


@pytest.fixture(scope="module")
def reach():
    return make_task("reach", camera="synthetic"), LocalServer(load_policy("reach-expert"))


def test_the_episode_that_diverged_at_200_ms_now_tracks(reach) -> None:
    # Seed 2 at 200 ms one way: the second chunk, planned from an observation taken while the
    # arm swung in from the start, chose the other elbow branch; replacing the plan with it
    # handed the filter a 4 rad jump, and every chunk after it was planned mid-swing again
    # (139 mm mean error, 279 interventions). The broker now refuses that chunk and asks again.
    task, server = reach
    cfg = dataclasses.replace(default_broker_config(task.period, task.horizon), send_prefix=False, merge="replace")
    result = run_des_episode(task, "chunkline", server, Conditions(delay_s=0.2), seed=2, infer_s=0.001, broker_config=cfg)
    assert result.success and result.score < 0.015
    assert result.violation_ticks == 0 and result.stale_actions == 0
    assert result.details["strategy"]["broker"]["chunks_far"] >= 1


def test_rtc_tracks_at_300_ms_where_one_request_in_flight_could_not(reach) -> None:
    task, server = reach
    cfg = dataclasses.replace(default_broker_config(task.period, task.horizon), merge="rtc")
    one = dataclasses.replace(cfg, max_in_flight=1)
    several = [run_des_episode(task, "chunkline", server, Conditions(delay_s=0.3), seed=s, infer_s=0.001, broker_config=cfg)
               for s in range(3)]
    single = [run_des_episode(task, "chunkline", server, Conditions(delay_s=0.3), seed=s, infer_s=0.001, broker_config=one)
              for s in range(3)]
    assert all(r.success for r in several) and all(r.violation_ticks == 0 for r in several)
    assert sum(r.fallback_ticks for r in several) < sum(r.fallback_ticks for r in single)


def test_the_jumping_target_jumps_once_and_reaction_time_is_measured(reach) -> None:
    _, server = reach
    task = make_task("reach-jump", camera="synthetic")
    task.reset(0)
    before, _ = task.target(task.jump_at_s - 0.02)
    after, _ = task.target(task.jump_at_s)
    assert np.hypot(*(after - before)) > 0.05  # a jump, not the target's motion in one period
    cfg = dataclasses.replace(default_broker_config(task.period, task.horizon), merge="rtc")
    fast = run_des_episode(task, "chunkline", server, Conditions(delay_s=0.05), seed=0, infer_s=0.001, broker_config=cfg)
    slow = run_des_episode(task, "chunkline", server, Conditions(delay_s=0.05), seed=0, infer_s=0.001,
                           broker_config=dataclasses.replace(cfg, merge="replace", send_prefix=False))
    # rtc re-plans as soon as each answer is in: it reacts within about two round trips (the
    # request in flight at the jump, then one from after it); asking only when the plan runs
    # short (replace) reacts up to a chunk later.
    assert 0.1 <= fast.reaction_s <= 0.25 < slow.reaction_s
    assert fast.success and fast.violation_ticks == 0
    task.close()


def test_the_filtered_index_pattern_keeps_the_limits_the_raw_one_breaks(reach) -> None:
    task, server = reach
    raw = run_des_episode(task, "index", server, Conditions(delay_s=0.1), seed=0, infer_s=0.001)
    filtered = run_des_episode(task, "index-filtered", server, Conditions(delay_s=0.1), seed=0, infer_s=0.001)
    assert raw.violation_ticks > 0 and raw.interventions == 0
    assert filtered.violation_ticks == 0 and filtered.interventions > 0
    assert filtered.stale_actions == raw.stale_actions  # the same timing: only the filter differs


def test_the_execution_horizon_caps_rtcs_requests_at_no_cost_to_tracking() -> None:
    from chunkline.bench.closedloop import rtc_suite

    assert rtc_suite.broker_config_for("rtc@0.16", 0.02, 50).rtc_min_replan_s == 0.16
    p = rtc_suite.RtcPlan(tasks=("reach",), delays_ms=(0,), seeds=(0, 1), strategies=rtc_suite.horizon_sweep([0.0, 0.1]),
                          horizons_s=(1.0,))
    rows = {r["strategy"]: r for r in rtc_suite.run(p)}
    assert set(rows) == {"chunkline-replace", "chunkline-rtc@0s", "chunkline-rtc@0.1s"}
    every, paced = rows["chunkline-rtc@0s"], rows["chunkline-rtc@0.1s"]
    # 0 ms one-way: without a horizon rtc asks every tick (50/s at 50 Hz); 0.1 s: ten per second.
    assert every["requests_per_s"] > 45 and 9 <= paced["requests_per_s"] <= 10.5
    assert paced["success_rate"] == every["success_rate"] == 1.0
    assert paced["error_mm"] <= every["error_mm"] + 0.5


def test_max_in_flight_reaches_every_chunkline_strategy() -> None:
    # At 300 ms one way a 1 s chunk's requests overlap: one allowed in flight asks less often.
    from chunkline.bench.closedloop import rtc_suite

    def rate(max_in_flight: int | None) -> float:
        p = rtc_suite.RtcPlan(tasks=("reach",), delays_ms=(300,), seeds=(0,), horizons_s=(1.0,),
                              strategies=(("chunkline-rtc", "chunkline", "rtc"),), max_in_flight=max_in_flight)
        (row,) = rtc_suite.run(p)
        return float(row["requests_per_s"])

    one, default = rate(1), rate(None)
    assert one < 0.8 * default
    with pytest.raises(SystemExit):
        rtc_suite.main(["--max-in-flight", "0"])


def test_every_strategy_runs_at_the_served_policys_horizon() -> None:
    # A 2 s horizon is the served policy's: the index pattern's queue counts its 100 actions too
    # (it asks when 50 are left: about once a second at 100 ms, twice as seldom as with 1 s chunks).
    from chunkline.bench.closedloop import rtc_suite

    p = rtc_suite.RtcPlan(tasks=("reach",), delays_ms=(100,), seeds=(0,), horizons_s=(1.0, 2.0),
                          strategies=(("index", "index", None), ("chunkline-rtc", "chunkline", "rtc")))
    rows = {(r["horizon_s"], r["strategy"]): r for r in rtc_suite.run(p)}
    assert set(rows) == {(h, s) for h in (1.0, 2.0) for s in ("index", "chunkline-rtc")}
    assert rows[(2.0, "index")]["requests_per_s"] < 0.7 * rows[(1.0, "index")]["requests_per_s"]
    assert rtc_suite.expert_for("reach-jump", 2.0).spec.horizon == 100
    assert rtc_suite.expert_for("reach", 1.0).spec.horizon == 50


def test_the_targets_are_checked_per_task_and_horizon() -> None:
    from chunkline.bench.closedloop import rtc_suite

    def row(h: float, strategy: str, success: float, error: float, diverging: int = 0, accel: float = 1.0) -> dict:
        return {"task": "reach-jump", "horizon_s": h, "delay_ms": 300.0, "strategy": strategy, "success_rate": success,
                "error_mm": error, "stale_per_episode": 0.0, "violations_per_episode": 0.0, "diverging": diverging,
                "switch_accel_jump": accel, "switch_jump_rad": 0.0}

    rows = [row(1.0, "index", 0.0, 86.0, 9), row(1.0, "index-filtered", 0.0, 102.0, 10), row(1.0, "chunkline-rtc", 0.0, 43.0, 1),
            row(2.0, "index", 0.0, 90.0, 10), row(2.0, "index-filtered", 0.0, 92.0, 10), row(2.0, "chunkline-rtc", 0.0, 30.0, 0)]
    checks = {c["horizon_s"]: c for c in rtc_suite.targets(rows)}
    assert set(checks) == {1.0, 2.0}
    assert not checks[1.0]["passed"] and "diverging 1" in checks[1.0]["value"]
    assert checks[2.0]["passed"]
    legacy = [{k: v for k, v in r.items() if k != "horizon_s"} for r in rows[:3]]  # rows from before horizons
    assert [c["horizon_s"] for c in rtc_suite.targets(legacy)] == [1.0]
