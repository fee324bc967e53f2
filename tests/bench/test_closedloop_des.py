"""Discrete-event closed loop: the issue's acceptance at tiny size, and the driver's fidelity."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("mujoco")

from chunkline.bench.closedloop.des import Conditions, LocalServer, run_des_episode
from chunkline.bench.closedloop.metrics import EpisodeMeter
from chunkline.bench.closedloop.strategies import (
    ChunklineStrategy,
    IndexStrategy,
    Step,
    SyncStrategy,
    make_strategy,
)
from chunkline.bench.closedloop.suite import outage_figures
from chunkline.bench.closedloop.tasks import TaskOutcome, make_task
from chunkline.bench.faultproxy import Outage
from chunkline.broker import ActionChunk, Broker, BrokerConfig
from chunkline.broker.sim import ScriptedServer, simulate
from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.policies.embedded.tasks import reach_expert
from chunkline.safety import Limits

STRATEGIES = ("sync", "index", "chunkline")


@pytest.fixture(scope="module")
def reach() -> Any:
    task = make_task("reach", episode_s=4.0)
    yield task, LocalServer(reach_expert())
    task.close()


def test_at_zero_delay_all_three_solve_the_task(reach: Any) -> None:
    task, server = reach
    for strategy in STRATEGIES:
        for seed in (0, 1):
            r = run_des_episode(task, strategy, server, Conditions(0.0), seed=seed)
            assert r.success, (strategy, seed, r.score)
            assert r.stale_actions == 0, strategy


def test_at_150ms_only_chunkline_executes_no_stale_action(reach: Any) -> None:
    task, server = reach
    by = {s: run_des_episode(task, s, server, Conditions(0.150), seed=0) for s in STRATEGIES}
    assert by["chunkline"].stale_actions == 0
    assert by["chunkline"].success
    assert by["sync"].stale_actions > 0 and by["index"].stale_actions > 0
    # What a stale action is: run more than one period after its due time (here ~ a round trip).
    assert by["sync"].max_action_age_s > 0.29 and by["chunkline"].max_action_age_s <= task.period + 1e-9
    assert not by["sync"].success  # a chunk executed 300 ms late loses the moving target


@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_outage_chunkline_falls_back_in_time_and_breaks_no_limit(mode: str) -> None:
    # A blackhole ends with TCP's retransmission backoff: give the task 4 s to resume.
    task = make_task("reach", episode_s=8.0)
    server = LocalServer(reach_expert())
    outage = Outage(2.0, 2.0, mode)
    r = run_des_episode(task, "chunkline", server, Conditions(0.05, outages=(outage,)), seed=0, keep_timeline=True)
    tl = r.timeline
    assert tl is not None
    t, src, vu = tl["t"], tl["source"], tl["valid_until"]
    first = int(np.flatnonzero((src == "fallback") & (t >= outage.start))[0])
    dry = vu[first]
    assert outage.start <= dry <= outage.end  # the last valid action expired during the outage ...
    assert -1e-9 <= t[first] - dry <= task.period + 1e-9  # ... and the fallback took over within a period (a tick a
    # float round-off before the end counts as past it, as the timeline reads it)
    assert src[first - 1] in ("policy", "resuming") and t[first - 1] <= dry  # valid until then
    assert r.violation_ticks == 0 and r.stale_actions == 0
    figures = outage_figures(r, outage, task.tolerance_m)
    assert figures["fallback_entry_ok"] == 1.0
    assert math.isfinite(figures["recovered_s"])  # the task resumed after the link came back
    task.close()


def test_sync_and_index_break_limits_where_chunkline_does_not(reach: Any) -> None:
    task, server = reach
    by = {s: run_des_episode(task, s, server, Conditions(0.1), seed=1) for s in STRATEGIES}
    assert by["chunkline"].violation_ticks == 0
    assert by["sync"].violation_ticks > 0  # a blocked loop stops the arm dead; a late chunk jumps


# ------------------------------------------------------------------ fidelity of the driver


class _PointRobot:
    """A robot without physics (the command is the position): lets the closed-loop driver be
    compared tick for tick with broker.sim's simulator."""

    name = "point"
    action_dim = 3
    period = 0.02
    horizon = 20
    episode_s = 3.0
    tolerance_m = 0.1

    def __init__(self) -> None:
        self.pos = np.zeros(3)

    def limits(self) -> Limits:
        return Limits(lower=[-2.0] * 3, upper=[2.0] * 3, max_velocity=2.0, max_acceleration=40.0, dt=self.period)

    def reset(self, seed: int) -> np.ndarray:
        self.pos = np.zeros(3)
        return self.pos.copy()

    def observe(self) -> dict[str, Any]:
        return {"state": self.pos.astype(np.float32)}

    def error(self) -> float:
        return 0.0

    def step(self, command: np.ndarray | None, periods: int = 1) -> None:
        if command is not None:
            self.pos = np.asarray(command, dtype=np.float64).copy()

    def outcome(self) -> TaskOutcome:
        return TaskOutcome(True, 0.0, {})


def _policy(obs: Mapping[str, Any], obs_time: float, prefix: Any = None) -> np.ndarray:
    k = np.arange(20)[:, None]
    return (0.5 * np.sin(obs_time + k * 0.02 + np.arange(3)[None, :])).astype(np.float32)


class _Server:
    spec = PolicySpec(observation={"state": ArraySpec((3,), "float32")}, action_dim=3, horizon=20, dt=0.02)

    def __init__(self) -> None:
        self.now = 0.0

    def infer(self, observation: Mapping[str, Any]) -> np.ndarray:
        return _policy(observation, self.now)


def test_the_driver_runs_the_broker_exactly_as_broker_sim_does() -> None:
    """Same broker settings, same round trip, same policy: identical commands, tick for tick."""
    robot = _PointRobot()
    cfg = BrokerConfig(control_period_s=0.02)
    rtt = 2 * 0.03 + 0.004
    # the closed-loop driver
    server = _Server()
    strategy = make_strategy("chunkline", action_dim=3, horizon=20, limits=robot.limits(), initial_position=np.zeros(3),
                             config=cfg)
    assert isinstance(strategy, ChunklineStrategy)
    original_tick = strategy.tick
    commands: list[np.ndarray] = []

    def tick(now: float, obs: Mapping[str, Any]) -> Step:
        server.now = now  # the policy plans from the observation's time, as the reference does
        step = original_tick(now, obs)
        commands.append(np.array(step.action))
        return step

    strategy.tick = tick  # type: ignore[method-assign]
    run_des_episode(robot, strategy, server, Conditions(0.03, infer_s=0.004), seed=0)  # type: ignore[arg-type]
    # broker.sim's simulator on its own broker
    broker = Broker(cfg, initial_position=np.zeros(3), limits=robot.limits())
    ref = simulate(broker, ScriptedServer(_policy, 0.02, lambda i, t: rtt), duration_s=robot.episode_s)
    assert len(commands) == len(ref.actions)
    assert np.allclose(np.stack(commands), ref.actions, atol=1e-12)


# ------------------------------------------------------------------ the strategies alone


def _chunk(t0: float, rid: int, h: int = 6, value: float = 0.0) -> ActionChunk:
    return ActionChunk(np.full((h, 1), value) + np.arange(h)[:, None], t0, 0.1, t0 + h * 0.1, rid)


def test_sync_blocks_then_executes_from_the_first_action_however_late() -> None:
    s = SyncStrategy(1, action_horizon=3)
    step = s.tick(0.0, {})
    assert step.action is None and step.request is not None
    s.on_sent(step.request.request_id, 0.0)
    assert s.tick(0.1, {}).source == "hold"
    s.on_chunk(_chunk(0.0, step.request.request_id), 0.35)
    first = s.tick(0.4, {})
    assert first.action is not None and first.action[0] == 0.0 and first.due == 0.0  # 0.4 s late
    assert [s.tick(t, {}).action[0] for t in (0.5, 0.6)] == [1.0, 2.0]
    assert s.tick(0.7, {}).request is not None  # used up: ask again


def test_index_drops_executed_indices_and_runs_the_rest_in_order() -> None:
    s = IndexStrategy(1, horizon=6, threshold=0.5, aggregate="latest_only")
    r1 = s.tick(0.0, {}).request
    s.on_sent(r1.request_id, 0.0)
    s.on_chunk(_chunk(0.0, r1.request_id), 0.05)
    ran = [s.tick(0.1 * i, {}) for i in range(1, 4)]
    assert [x.action[0] for x in ran] == [0.0, 1.0, 2.0]
    assert ran[-1].request is not None  # 3 of 6 left: at the threshold
    r2 = ran[-1].request
    s.on_sent(r2.request_id, 0.3)
    s.on_chunk(_chunk(0.3, r2.request_id, value=10.0), 0.45)  # indices 2..7; 2 already ran
    nxt = s.tick(0.4, {})
    assert nxt.action[0] == 11.0  # index 3 of the new chunk (its action 1), by index, not by time


def test_meter_counts_stale_actions_and_violations() -> None:
    limits = Limits(lower=[-1.0], upper=[1.0], max_velocity=1.0, max_acceleration=10.0, dt=0.1)
    m = EpisodeMeter(limits, np.zeros(1))
    m.record(0.0, Step(np.array([0.05]), "policy", due=0.0), 0.0)
    m.record(0.1, Step(np.array([0.1]), "policy", due=-0.2), 0.0)  # 0.3 s late: stale
    m.record(0.2, Step(np.array([0.9]), "policy", due=0.2), 0.0)  # a jump: velocity and acceleration
    m.record(0.3, Step(None, "hold"), 0.0)
    assert m.stale == 1 and m.counts["hold"] == 1
    assert m.violation_ticks >= 2 and m.violations["velocity"] >= 1


def test_the_boundary_metric_is_the_jump_in_acceleration_not_the_acceleration() -> None:
    limits = Limits(lower=[-10.0], upper=[10.0], max_velocity=10.0, max_acceleration=100.0, dt=0.1)

    def run(kink: float) -> EpisodeMeter:
        m = EpisodeMeter(limits, np.zeros(1))
        # Constant acceleration of 2 throughout (x = t^2); the switch to chunk 2 at tick 5 keeps it
        # (a smooth hand-over) or steps 1 cm off it (a jump of 0.01 / 0.1^2 = 1 in acceleration).
        for i in range(10):
            t = 0.1 * i
            x = t * t + (kink if i >= 5 else 0.0)
            m.record(t, Step(np.array([x]), "policy", due=t, chunk_id=1 if i < 5 else 2), 0.0)
        return m

    smooth, kinked = run(0.0), run(0.01)
    assert smooth.switch_accel_jump < 1e-9  # accelerating through the switch is no discontinuity
    assert math.isclose(kinked.switch_accel_jump, 1.0, rel_tol=1e-6)
    assert math.isclose(kinked.switch_jump - smooth.switch_jump, 0.01, rel_tol=1e-6)  # the position step


def test_a_switch_in_the_resume_ramp_is_no_boundary_one_in_the_chase_after_it_is() -> None:
    limits = Limits(lower=[-10.0], upper=[10.0], max_velocity=10.0, max_acceleration=100.0, dt=0.1)

    def jump_at(tick: int) -> float:
        # Fallback for 3 ticks, then the watchdog's hand-back (4 ramp ticks, then its chase, all
        # "resuming"), then the policy; chunk 2 takes over at `tick` with a 1 cm step.
        m = EpisodeMeter(limits, np.zeros(1), hand_back_ticks=4)
        for i in range(14):
            source = "fallback" if i < 3 else "resuming" if i < 10 else "policy"
            x = 0.0 if source == "fallback" else (0.01 if i >= tick else 0.0)
            m.record(0.1 * i, Step(np.array([x]), source, due=0.1 * i, chunk_id=None if i < 3 else 1 + (i >= tick)), 0.0)
        return m.switch_accel_jump

    assert jump_at(5) == 0.0  # within the ramp: the hand-back's business
    assert math.isclose(jump_at(8), 1.0, rel_tol=1e-6)  # in the chase: a boundary
    assert math.isclose(jump_at(11), 1.0, rel_tol=1e-6)  # on the policy


def test_served_demonstrations_are_the_brokers_requests_and_the_experts_answers() -> None:
    from chunkline.bench.closedloop.train_common import SERVED_STEPS, collect_served

    # Episodes 0-5 run at d = 0..5, episode 1 on reach-jump: the first two are the same alone.
    demos = collect_served(6, seed=3)
    again = collect_served(2, seed=3)
    n, m = len(demos.states), len(again.states)
    assert SERVED_STEPS[:6] == (0, 1, 2, 3, 4, 5) and n > 6 * 20 and 0 < m < n
    assert np.array_equal(demos.rtc_chunks[:m], again.rtc_chunks) and np.array_equal(demos.states[:m], again.states)
    frozen = [i for i in range(n) if demos.delay[i] > 0 and demos.prefix_mask[i, : demos.delay[i]].all()]
    # Under delay the broker sends the running plan with rows frozen: the label keeps them.
    assert len(frozen) > n // 4
    for i in frozen:
        d = int(demos.delay[i])
        np.testing.assert_allclose(demos.rtc_chunks[i, :d], demos.prefix[i, :d], atol=1e-6)
    assert demos.accel.shape == (n, 2) and np.any(demos.accel != 0)
    assert demos.chunks.shape == demos.rtc_chunks.shape == (n, 50, 2)
