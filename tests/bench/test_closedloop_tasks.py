"""The closed-loop tasks: MuJoCo robots under joint position commands, and their scripted experts."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("mujoco")

from chunkline.bench.closedloop.tasks import TASKS, FrameSource, make_task
from chunkline.policies.base import validate_observation
from chunkline.policies.embedded.tasks import (
    ReachPlanner,
    Track7Planner,
    reach_fk,
    reach_ik,
    reach_spec,
    track7_spec,
)


def _drive(task, planner, replan_every: int = 10) -> None:
    k = 0
    chunk = None
    while not task.done:
        if k % replan_every == 0:
            chunk = planner.plan(task.state())
        task.step(chunk[k % replan_every])
        k += 1


@pytest.mark.parametrize("name", sorted(TASKS))
def test_observation_is_what_the_policy_spec_accepts(name: str) -> None:
    task = make_task(name, episode_s=1.0)
    task.reset(0)
    obs = task.observe()
    spec = reach_spec() if name.startswith("reach") else track7_spec()
    checked = validate_observation(spec, obs)  # raises on any mismatch
    for key, value in checked.items():
        if key.startswith("images/"):
            assert value.shape == (224, 224, 3) and value.dtype == np.uint8
    assert checked["state"].dtype == np.float32
    limits = task.limits()
    assert limits.action_dim == task.action_dim and limits.dt == task.period
    task.close()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_reset_is_deterministic_per_seed(name: str) -> None:
    task = make_task(name, episode_s=1.0)
    a = (task.reset(3), task.state().copy())
    task.step(task.command)
    b = (task.reset(3), task.state().copy())
    c = (task.reset(4), task.state().copy())
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])
    task.close()


def test_reach_expert_tracks_the_moving_target_at_zero_delay() -> None:
    task = make_task("reach", episode_s=4.0)
    for seed in (0, 1):
        task.reset(seed)
        _drive(task, ReachPlanner())
        out = task.outcome()
        assert out.success, out
        assert out.score < 0.01  # mean tracking error under a centimetre
    task.close()


def test_track7_expert_keeps_the_hand_over_the_marker_at_zero_delay() -> None:
    task = make_task("track7", episode_s=4.0)
    task.reset(0)
    _drive(task, Track7Planner())
    out = task.outcome()
    assert out.success and out.score < 0.01, out
    task.close()


def test_a_late_chunk_loses_the_moving_target() -> None:
    """Timing matters: the same expert's chunks, executed 300 ms late, miss the target."""
    task = make_task("reach", episode_s=4.0)
    task.reset(0)
    planner = ReachPlanner()
    lag = 15  # ticks: a 300 ms round trip
    arrived: list[tuple[int, np.ndarray]] = []  # (arrival tick, chunk)
    k = 0
    while not task.done:
        if k % 10 == 0:
            arrived.append((k + lag, planner.plan(task.state())))
        usable = [(t, c) for t, c in arrived if t <= k]
        if usable:
            t, c = usable[-1]
            task.step(c[k - t])  # executed from its first action on arrival: 300 ms late
        else:
            task.step(None)
        k += 1
    assert not task.outcome().success
    task.close()


def test_no_command_holds_the_last_target() -> None:
    task = make_task("track7", episode_s=2.0)
    q0 = task.reset(1)
    for _ in range(25):
        task.step(None)
    assert np.allclose(task.joint_positions(), q0, atol=0.02)
    task.close()


def test_reach_inverse_kinematics_round_trip() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        r = rng.uniform(0.05, 0.2)
        a = rng.uniform(-np.pi, np.pi)
        p = np.array([r * np.cos(a), r * np.sin(a)])
        q = reach_ik(p, rng.uniform(-3, 3, 2))
        assert np.allclose(reach_fk(q), p, atol=1e-9)


def test_synthetic_frames_have_the_camera_shape() -> None:
    frames = FrameSource("synthetic", seed=1)
    a, b = frames.synthetic(), frames.synthetic()
    assert a.shape == b.shape == (224, 224, 3) and a.dtype == np.uint8
    assert not np.array_equal(a, b)
    with pytest.raises(ValueError):
        FrameSource("webcam")


def test_reach_expert_continues_its_prefix_at_the_prefix_velocity() -> None:
    # A real-time-chunking request: the first 10 rows are frozen (the robot runs them while the
    # request is in flight). The plan after them must go on at the frozen rows' velocity: braking
    # at the first free row (no feed-forward there) would be a ~40 rad/s^2 kink right where each
    # rtc chunk takes over.
    planner = ReachPlanner()
    state = np.array([0.3, 0.9, 0.0, 0.0, 0.12, 0.0, 0.0, 0.3], dtype=np.float32)  # target at 0.3 m/s
    running = planner.plan(state)  # the current plan, moving after its start-up
    prefix, delay = running[15:].astype(np.float32), 10
    later = state.copy()
    later[4:6] = [0.12 * np.cos(0.75), 0.12 * np.sin(0.75)]  # observed 0.3 s on
    later[6:8] = [-0.3 * np.sin(0.75), 0.3 * np.cos(0.75)]
    chunk = planner.plan(later, np.concatenate([prefix, np.zeros((15, 2), np.float32)]), delay)
    np.testing.assert_array_equal(chunk[:delay], prefix[:delay])  # the frozen rows, exactly
    speed = np.abs(np.diff(prefix[:delay], axis=0)[-1]) / planner.dt
    assert speed.max() > 1.0  # the prefix is moving (the case that braked)
    accel = np.abs(np.diff(chunk[delay - 3 : delay + 3], n=2, axis=0)) / planner.dt**2
    assert accel.max() < 10.0, accel


def test_reach_expert_leaves_its_prefixs_acceleration_gradually() -> None:
    # The prefix accelerates at 20 rad/s^2 and the new observation asks for the other way: the plan
    # after the frozen rows starts at the prefix's acceleration and moves away from it by at most
    # the expert's jerk per step (a ramp), not in one 60 rad/s^2 kink where the chunk takes over.
    from chunkline.policies.embedded.tasks import _REACH_JERK, REACH_LINKS

    planner = ReachPlanner()
    dt, delay = planner.dt, 10
    t = np.arange(30) * dt
    prefix = np.stack([0.3 + 0.5 * 20.0 * t**2, 0.9 + 0.0 * t], axis=1).astype(np.float32)
    q_end = prefix[delay - 1].astype(np.float64)
    tip = np.array([REACH_LINKS[0] * np.cos(q_end[0]) + REACH_LINKS[1] * np.cos(q_end[0] + q_end[1]),
                    REACH_LINKS[0] * np.sin(q_end[0]) + REACH_LINKS[1] * np.sin(q_end[0] + q_end[1])])
    c, s = np.cos(-0.6), np.sin(-0.6)
    back = np.array([c * tip[0] - s * tip[1], s * tip[0] + c * tip[1]])  # the target 0.6 rad the other way
    state = np.array([0.3, 0.9, 0.0, 0.0, back[0], back[1], 0.0, 0.0], dtype=np.float32)
    chunk = planner.plan(state, prefix, delay)
    np.testing.assert_array_equal(chunk[:delay], prefix[:delay])
    acc = np.diff(chunk[delay - 3 : delay + 12, 0].astype(np.float64), n=2) / dt**2
    assert abs(acc[0] - 20.0) < 1.0  # the prefix's own acceleration, up to its last row
    assert np.max(np.abs(np.diff(acc))) <= _REACH_JERK * dt + 1.0, np.diff(acc)
    assert acc[-1] < 0.0  # and it did turn the other way


def test_reach_expert_meets_a_jumped_target_head_on_with_a_prefix_too() -> None:
    # The target (moving counter-clockwise at ~2.4 rad/s) jumped 2.5 rad ahead of the arm: nearest
    # is to chase it (2.5 rad counter-clockwise, closing at 6 - 2.4 rad/s: 0.7 s), but which way is
    # nearest flips with every observation near half a turn, and meeting it head on (3.8 rad
    # clockwise, closing at 6 + 2.4 rad/s: 0.45 s) is quicker. With a prefix, as without, the plan
    # turns against the target's motion (clockwise: the shoulder angle goes down).
    planner = ReachPlanner()
    q = np.array([0.2, 0.8])
    tip = reach_fk(q)
    ang = np.arctan2(tip[1], tip[0]) + 2.5
    r = np.hypot(*tip)
    p = np.array([r * np.cos(ang), r * np.sin(ang)])
    v = 0.3 * np.array([-np.sin(ang), np.cos(ang)])  # counter-clockwise
    state = np.concatenate([q, [0.0, 0.0], p, v]).astype(np.float32)
    prefix = np.repeat(q[None, :], 10, axis=0).astype(np.float32)
    with_prefix = planner.plan(state, prefix, 5)
    without = planner.plan(state)
    assert reach_ik(p, q)[0] - q[0] == pytest.approx(2.5)  # nearest: counter-clockwise
    assert with_prefix[15, 0] < q[0] - 0.3 and without[10, 0] < q[0] - 0.3


def test_the_experts_plan_the_horizon_they_are_served_with() -> None:
    from chunkline.policies.embedded.tasks import reach_expert
    from chunkline.policies.registry import load_policy

    assert reach_expert().spec.horizon == 50 and reach_expert(horizon_s=2.0).spec.horizon == 100
    served = load_policy("chunkline.policies.embedded.tasks:reach_expert", args={"horizon_s": 2})
    assert served.spec.horizon == 100 and served.spec.validity == pytest.approx(2.0)
    obs = {"state": np.zeros((1, 8), np.float32), "images/cam_high": np.zeros((1, 224, 224, 3), np.uint8)}
    assert served.infer_batch(obs).shape == (1, 100, 2)
    with pytest.raises(ValueError):
        reach_expert(horizon_s=0.01)


def test_the_reaction_allowance_moves_the_counted_windows_by_the_round_trip() -> None:
    task = make_task("reach-jump")
    try:
        task.reset(0)
        n = int(round(task.episode_s / task.period))
        err = np.zeros(n)
        late = slice(int(round((task.jump_at_s + task.jump_grace_s) / task.period)),
                     int(round((task.jump_at_s + task.jump_grace_s + 0.4) / task.period)))
        err[late] = 0.1  # off target for the round trip after the grace: no strategy can answer sooner
        err[: int(round((task.acquire_s + 0.4) / task.period))] = 0.1  # and until the first answer could act
        task.errors = list(err)
        strict = task.outcome()
        assert not strict.success and strict.details["success_strict"] is False
        task.reaction_allowance_s = 0.4
        out = task.outcome()
        assert out.success and out.score == 0.0 and out.details["success_strict"] is False
        task.reaction_allowance_s = 0.3  # one tick short of the round trip: the error is counted again
        assert task.outcome().score > 0.0
        task.reset(1)
        assert task.reaction_allowance_s == 0.0
    finally:
        task.close()


def test_reach_reports_the_targets_acceleration_and_the_expert_predicts_the_wobble_with_it() -> None:
    task = make_task("reach", episode_s=1.0)
    task.reset(5)
    task.amp, task.w_r = 0.03, 1.2  # the widest wobble, at the rate the expert assumes
    t, h = 0.7, 1e-5
    numeric = (task.target(t + h)[1] - task.target(t - h)[1]) / (2 * h)
    assert np.allclose(task.target_acceleration(t), numeric, atol=1e-6)
    task.time = t
    obs = task.observe()
    checked = validate_observation(reach_spec(), obs)
    assert np.allclose(checked["target_accel"], numeric, atol=1e-5)
    planner = ReachPlanner()
    future = np.array([task.target(t + k * planner.dt)[0] for k in range(planner.horizon)])
    with_accel = planner.predict_target(task.state(), checked["target_accel"])
    without = planner.predict_target(task.state())
    err_with = np.hypot(*(with_accel - future).T).max()
    err_without = np.hypot(*(without - future).T).max()
    # Straight-on radial speed misses the wobble's turn by centimetres over a second; the
    # oscillating radius follows it to float32 round-off when the rates agree.
    assert err_with < 1e-3 < 1e-2 < err_without
    # A batch's zero filler (a robot that sent no acceleration) reads as none.
    assert np.array_equal(planner.predict_target(task.state(), np.zeros(2, np.float32)), without)
    task.close()
