"""The safety filter: pass, clamp, reject, counters, and the limits it keeps (property tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.safety import FilterMode, LimitKind, Limits, MotionState, SafetyFilter, Verdict


def limits2() -> Limits:
    return Limits(lower=[-1.0, -1.0], upper=[1.0, 1.0], max_velocity=1.0, max_acceleration=10.0, dt=0.01)


def test_safe_proposal_passes_unchanged() -> None:
    f = SafetyFilter(limits2())
    state = MotionState(np.array([0.0, 0.5]), np.array([0.5, 0.0]))
    target = np.array([0.0051, 0.5])
    cmd, verdict = f.apply(target, state)
    assert verdict is Verdict.PASSED
    np.testing.assert_array_equal(cmd, target)
    assert not cmd.flags.writeable
    assert f.counts.passed == 1 and f.counts.interventions == 0
    np.testing.assert_allclose(f.velocity, [0.51, 0.0])


def test_read_only_float64_target_is_not_copied() -> None:
    f = SafetyFilter(limits2())
    target = np.array([0.0001, 0.0])
    target.flags.writeable = False
    cmd, _ = f.apply(target, MotionState.at_rest([0.0, 0.0]))
    assert cmd is target


def test_too_fast_is_clamped_to_the_acceleration_window() -> None:
    lim = limits2()
    f = SafetyFilter(lim)
    state = MotionState.at_rest([0.0, 0.0])
    res = f.check(np.array([0.5, -0.5]), state)
    assert res.verdict is Verdict.CLAMPED
    # From rest, one period at 10 m/s^2 reaches 0.1 m/s: 0.001 m.
    np.testing.assert_allclose(res.command, [0.001, -0.001])
    assert set(res.limits_hit) == {LimitKind.VELOCITY, LimitKind.ACCELERATION}
    assert lim.step_violations(state, res.command) == []
    assert f.counts.clamped == 1 and f.counts.velocity == 1 and f.counts.acceleration == 1


def test_braking_room_is_enforced_near_a_bound() -> None:
    lim = limits2()
    f = SafetyFilter(lim)
    # 1 m/s towards +1 from 0.945: the stop needs 0.05 m, so keeping full speed one more
    # period (to 0.955) would leave too little room: it must start braking now.
    state = MotionState(np.array([0.945, 0.0]), np.array([1.0, 0.0]))
    assert lim.is_viable(state)
    res = f.check(np.array([0.955, 0.0]), state)
    assert res.verdict is Verdict.CLAMPED
    assert res.limits_hit == (LimitKind.POSITION,)
    assert res.command[0] < 0.955
    new = state.advanced(res.command, lim.dt)
    assert lim.is_viable(new)
    assert lim.step_violations(state, res.command) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", list(FilterMode))
def test_non_finite_is_always_rejected(bad: float, mode: FilterMode) -> None:
    f = SafetyFilter(limits2(), mode)
    res = f.check(np.array([bad, 0.0]), MotionState.at_rest([0.0, 0.0]))
    assert res.command is None and res.verdict is Verdict.REJECTED
    assert res.limits_hit == (LimitKind.NONFINITE,)
    assert f.counts.rejected == 1 and f.counts.nonfinite == 1


def test_reject_mode_refuses_out_of_limits_but_clamp_override_wins() -> None:
    f = SafetyFilter(limits2(), FilterMode.REJECT)
    state = MotionState.at_rest([0.0, 0.0])
    cmd, verdict = f.apply(np.array([0.5, 0.0]), state)
    assert cmd is None and verdict is Verdict.REJECTED
    cmd, verdict = f.apply(np.array([0.5, 0.0]), state, clamp=True)
    assert verdict is Verdict.CLAMPED and cmd is not None
    assert f.counts.rejected == 1 and f.counts.clamped == 1 and f.counts.checked == 2


def test_wrong_width_raises() -> None:
    from chunkline.safety import ActionShapeError

    f = SafetyFilter(limits2())
    with pytest.raises((ActionShapeError, ValueError)):
        f.apply(np.zeros(3), MotionState.at_rest([0.0, 0.0]))


def _limits_strategy():
    dim = st.integers(1, 4)

    def build(a: int):
        lo = st.lists(st.floats(-5, 0), min_size=a, max_size=a)
        width = st.lists(st.floats(0.05, 5), min_size=a, max_size=a)
        vmax = st.lists(st.floats(0.05, 5), min_size=a, max_size=a)
        amax = st.lists(st.floats(0.5, 100), min_size=a, max_size=a)
        dt = st.sampled_from([0.002, 0.01, 0.02, 0.0333])
        return st.tuples(lo, width, vmax, amax, dt).map(
            lambda t: Limits(lower=t[0], upper=np.add(t[0], t[1]), max_velocity=t[2], max_acceleration=t[3], dt=t[4])
        )

    return dim.flatmap(build)


_value = st.one_of(st.floats(-20, 20), st.sampled_from([math.nan, math.inf, -math.inf]))


@settings(max_examples=60, deadline=None)
@given(lim=_limits_strategy(), data=st.data())
def test_property_filtered_commands_keep_every_limit(lim: Limits, data: st.DataObject) -> None:
    """Any proposals, NaN and infinities included: each emitted command keeps every limit."""
    f = SafetyFilter(lim, data.draw(st.sampled_from(list(FilterMode))))
    state = MotionState.at_rest(np.random.default_rng(0).uniform(lim.lower, lim.upper))
    n = data.draw(st.integers(1, 60))
    for _ in range(n):
        target = np.array(data.draw(st.lists(_value, min_size=lim.action_dim, max_size=lim.action_dim)))
        cmd, verdict = f.apply(target, state)
        if cmd is None:
            assert verdict is Verdict.REJECTED
            continue
        assert lim.step_violations(state, cmd) == []
        state = state.advanced(cmd, lim.dt)
        assert lim.is_viable(state, rtol=1e-7)
