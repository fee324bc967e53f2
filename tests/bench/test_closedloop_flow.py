"""The shipped reach-flow weights do the tasks at 0 ms through chunkline's rtc mode, as the
scripted expert does, and keep up with it at d = 10 (the figures over 200 episodes:
``chunkline bench closed-loop --steps-sweep``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("mujoco")
pytest.importorskip("jax")

from chunkline.bench.closedloop.des import Conditions, LocalServer, run_des_episode
from chunkline.bench.closedloop.rtc_suite import broker_config_for, expert_for
from chunkline.bench.closedloop.tasks import make_task
from chunkline.policies.registry import load_policy


@pytest.mark.parametrize("task_name", ["reach", "reach-jump"])
def test_the_shipped_flow_policy_matches_the_expert_at_zero_delay(task_name: str) -> None:
    task = make_task(task_name)
    try:
        cfg = broker_config_for("rtc", task.period, task.horizon)
        seeds = (3, 4, 5)

        def run(policy_server: LocalServer) -> list:
            return [run_des_episode(task, "chunkline", policy_server, Conditions(0.0), seed=s, broker_config=cfg,
                                    infer_s=0.002) for s in seeds]

        learned = run(LocalServer(load_policy("reach-flow-jax")))
        expert = run(LocalServer(expert_for(task_name, 1.0)))
        assert all(r.success for r in learned), [r.score for r in learned]
        assert all(r.stale_actions == 0 and r.violation_ticks == 0 for r in learned)
        mean_learned = float(np.mean([r.score for r in learned]))
        mean_expert = float(np.mean([r.score for r in expert]))
        assert mean_learned <= 1.2 * mean_expert + 0.001, (mean_learned, mean_expert)
    finally:
        task.close()


@pytest.mark.parametrize(("task_name", "episodes", "losses_allowed"), [("reach", 6, 1), ("reach-jump", 12, 2)])
def test_the_shipped_flow_policy_keeps_up_with_the_expert_at_d10(task_name: str, episodes: int, losses_allowed: int) -> None:
    # 200 ms one way (d = 10), jitter and stalls as in the sweep (docs/closed_loop.md has the
    # figures over 200 episodes). On reach-jump the requests in flight when the target jumps carry
    # the plan made before it: weights trained without the broker's requests lost 9 of these 12
    # episodes (the expert none).
    from chunkline.bench.closedloop.rtc_suite import RtcPlan, delay_conditions

    task = make_task(task_name)
    try:
        cfg = broker_config_for("rtc", task.period, task.horizon)
        cond = delay_conditions(RtcPlan(), 200.0)

        def run(policy_server: LocalServer) -> list:
            return [run_des_episode(task, "chunkline", policy_server, cond, seed=s, broker_config=cfg, infer_s=0.002)
                    for s in range(episodes)]

        learned = run(LocalServer(load_policy("reach-flow-jax")))
        expert = run(LocalServer(expert_for(task_name, 1.0)))
        assert sum(r.success for r in learned) >= sum(r.success for r in expert) - losses_allowed, [r.score for r in learned]
        assert all(r.stale_actions == 0 and r.violation_ticks == 0 for r in learned)
        if task_name == "reach":
            assert float(np.mean([r.score for r in learned])) <= 2.0 * float(np.mean([r.score for r in expert]))
    finally:
        task.close()
