"""Fallback behaviours and their start-up verification (example and property tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.safety import (
    CallableBehaviour,
    FallbackVerificationError,
    HoldBehaviour,
    Limits,
    LimitsError,
    MotionState,
    SafePoseBehaviour,
    verify_fallback,
    worst_case_states,
)
from chunkline.safety.exceptions import ActionShapeError


def arm() -> Limits:
    return Limits(lower=[-2.0, -1.0, 0.0], upper=[2.0, 1.0, 0.08], max_velocity=[2.0, 1.5, 0.2], max_acceleration=[20.0, 10.0, 2.0], dt=0.02)


def simulate(behaviour, lim: Limits, state: MotionState, steps: int) -> MotionState:
    behaviour.reset(state.copy())
    for _ in range(steps):
        cmd = behaviour.next_command(state.copy())
        if not lim.step_ok(state, cmd):  # the fast check; the slow one says what broke
            assert lim.step_violations(state, cmd) == [], (state, cmd)
        state = state.advanced(cmd, lim.dt)
    return state


def test_hold_brakes_then_holds() -> None:
    lim = arm()
    start = MotionState(np.array([0.0, 0.0, 0.04]), np.array([2.0, -1.5, 0.1]))
    end = simulate(HoldBehaviour(lim), lim, start, 10)
    # 2 m/s at 20 m/s^2 stops in 5 periods.
    np.testing.assert_array_equal(end.velocity[:1], [0.0])
    held = simulate(HoldBehaviour(lim), lim, end, 5)
    np.testing.assert_allclose(held.position, end.position)
    assert HoldBehaviour(lim).settled(held)


def test_hold_without_limits_repeats_the_last_command() -> None:
    state = MotionState(np.array([0.3, 0.4]), np.array([9.0, 9.0]))
    np.testing.assert_array_equal(HoldBehaviour(None).next_command(state), [0.3, 0.4])


def test_safe_pose_reaches_the_pose_within_limits() -> None:
    lim = arm()
    pose = np.array([0.5, -0.5, 0.08])
    b = SafePoseBehaviour(lim, pose, max_speed=[1.0, 1.0, 0.1])
    start = MotionState(np.array([-1.9, 0.9, 0.0]), np.array([-1.0, 1.0, 0.0]))
    end = simulate(b, lim, start, 400)
    assert b.settled(end)
    np.testing.assert_allclose(end.position, pose, atol=1e-9)


def test_safe_pose_respects_its_speed_cap() -> None:
    lim = arm()
    b = SafePoseBehaviour(lim, [1.5, 0.0, 0.0], max_speed=0.5 * np.array([1.0, 1.0, 0.1]))
    state = MotionState.at_rest([-1.5, 0.0, 0.0])
    b.reset(state)
    top = 0.0
    for _ in range(300):
        cmd = b.next_command(state)
        state = state.advanced(cmd, lim.dt)
        top = max(top, abs(state.velocity[0]))
    assert top <= 0.5 + 1e-12
    assert top > 0.49


@pytest.mark.parametrize(
    "kw",
    [dict(pose=[3.0, 0.0, 0.0]), dict(pose=[0.0, 0.0]), dict(pose=[math.nan, 0, 0]), dict(pose=[0, 0, 0], max_speed=5.0), dict(pose=[0, 0, 0], max_speed=0.0)],
)
def test_safe_pose_validation(kw) -> None:
    with pytest.raises((LimitsError, ActionShapeError)):
        SafePoseBehaviour(arm(), **kw)


def test_worst_case_states_are_viable_and_include_the_extremes() -> None:
    lim = arm()
    states = worst_case_states(lim, n_random=16)
    assert all(lim.is_viable(s, rtol=1e-9) for s in states)
    speeds = np.stack([np.abs(s.velocity) for s in states])
    np.testing.assert_allclose(speeds.max(axis=0), lim.max_velocity)
    positions = np.stack([s.position for s in states])
    np.testing.assert_allclose(positions.min(axis=0), lim.lower)
    np.testing.assert_allclose(positions.max(axis=0), lim.upper)


def test_built_in_behaviours_pass_verification() -> None:
    lim = arm()
    for b in (HoldBehaviour(lim), SafePoseBehaviour(lim, [0.0, 0.0, 0.04])):
        report = verify_fallback(b, lim)
        assert report.states >= 20 and report.settled


def test_a_safe_user_behaviour_passes() -> None:
    lim = arm()
    # "Stop, then creep the gripper open" written by hand, within the limits.
    def creep(state: MotionState, k: int) -> np.ndarray:
        v = np.sign(state.velocity) * np.maximum(np.abs(state.velocity) - lim.dv, 0.0)
        return np.clip(state.position + v * lim.dt, lim.lower, lim.upper)

    report = verify_fallback(CallableBehaviour(creep, name="creep"), lim)
    assert report.behaviour == "creep" and not report.settled  # no settle claim


def test_unsafe_user_behaviours_are_refused() -> None:
    lim = arm()
    jump_home = CallableBehaviour(lambda s, k: np.zeros(3), name="jump_home")
    with pytest.raises(FallbackVerificationError, match="jump_home"):
        verify_fallback(jump_home, lim)
    # Stops instantly: breaks the acceleration limit from any moving state.
    freeze = CallableBehaviour(lambda s, k: s.position, name="freeze")
    with pytest.raises(FallbackVerificationError, match="acceleration"):
        verify_fallback(freeze, lim)
    raises = CallableBehaviour(lambda s, k: 1 / 0, name="raises")
    with pytest.raises(FallbackVerificationError, match="ZeroDivisionError"):
        verify_fallback(raises, lim)
    wrong = CallableBehaviour(lambda s, k: np.zeros(2), name="wrong")
    with pytest.raises(FallbackVerificationError, match="shape"):
        verify_fallback(wrong, lim)
    # Safe until step 30, then a NaN: the whole horizon is checked.
    late_nan = CallableBehaviour(
        lambda s, k: HoldBehaviour(lim).next_command(s) if k < 30 else np.full(3, math.nan), name="late_nan"
    )
    with pytest.raises(FallbackVerificationError, match="nonfinite"):
        verify_fallback(late_nan, lim, steps=40)


def test_a_behaviour_that_claims_to_settle_must() -> None:
    lim = arm()
    never = CallableBehaviour(lambda s, k: HoldBehaviour(lim).next_command(s), name="never", settled=lambda s: False)
    with pytest.raises(FallbackVerificationError, match="settle"):
        verify_fallback(never, lim)
    verify_fallback(never, lim, require_settle=False)


@st.composite
def limits_and_state(draw):
    a = draw(st.integers(1, 5))
    lo = np.array(draw(st.lists(st.floats(-3, 1), min_size=a, max_size=a)))
    width = np.array(draw(st.lists(st.floats(0.01, 4), min_size=a, max_size=a)))
    infinite = draw(st.lists(st.booleans(), min_size=a, max_size=a))
    lower = np.where(infinite, -np.inf, lo)
    upper = np.where(infinite, np.inf, lo + width)
    # Ranges keep the simulated horizons short (stops within ~1 s, crossings within ~20 s).
    vmax = np.array(draw(st.lists(st.floats(0.2, 5), min_size=a, max_size=a)))
    ratio = np.array(draw(st.lists(st.floats(1, 40), min_size=a, max_size=a)))
    lim = Limits(
        lower=lower,
        upper=upper,
        max_velocity=vmax,
        max_acceleration=vmax * ratio,
        dt=draw(st.sampled_from([0.002, 0.01, 0.02, 1 / 30])),
    )
    # A random viable state: a position, then a velocity the braking room allows.
    u = np.array(draw(st.lists(st.floats(0, 1), min_size=a, max_size=a)))
    q = np.where(infinite, (u - 0.5) * 4, lo + u * width)
    room_up = lim.upper - q
    room_lo = q - lim.lower
    vmax_up = np.minimum(lim.max_velocity, np.sqrt(2 * lim.max_acceleration * room_up))
    vmax_lo = np.minimum(lim.max_velocity, np.sqrt(2 * lim.max_acceleration * room_lo))
    f = np.array(draw(st.lists(st.floats(-1, 1), min_size=a, max_size=a)))
    v = np.where(f > 0, f * vmax_up, f * vmax_lo)
    pose_u = np.array(draw(st.lists(st.floats(0, 1), min_size=a, max_size=a)))
    pose = np.where(infinite, (pose_u - 0.5) * 4, lo + pose_u * width)
    return lim, MotionState(q, v), pose


@settings(max_examples=40, deadline=None)
@given(limits_and_state())
def test_property_hold_keeps_limits_and_stops(case) -> None:
    lim, state, _ = case
    steps = int(np.max(np.ceil(lim.max_velocity / lim.dv))) + 2
    end = simulate(HoldBehaviour(lim), lim, state, steps)
    assert HoldBehaviour(lim).settled(end)


@settings(max_examples=40, deadline=None)
@given(limits_and_state())
def test_property_safe_pose_keeps_limits_and_arrives(case) -> None:
    lim, state, pose = case
    b = SafePoseBehaviour(lim, pose, max_speed=lim.max_velocity)
    span = float(np.max(np.abs(pose - state.position) / lim.max_velocity)) / lim.dt
    steps = int(span + 4 * np.max(lim.max_velocity / lim.dv)) + 30
    end = simulate(b, lim, state, steps)
    assert b.settled(end), (end, pose)


@settings(max_examples=15, deadline=None)
@given(limits_and_state())
def test_property_built_ins_always_verify(case) -> None:
    lim, _, pose = case
    verify_fallback(HoldBehaviour(lim), lim, n_random=8)
    verify_fallback(SafePoseBehaviour(lim, pose), lim, n_random=8)
