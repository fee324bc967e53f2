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


@settings(max_examples=300, deadline=None)
@given(
    dim=st.integers(1, 30),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([0.0, 0.5, 1.0, 1.0 + 1e-12, 1.2]),
    f32=st.booleans(),
    poison=st.sampled_from([None, math.nan, math.inf]),
    own_state=st.booleans(),
)
def test_the_small_dimension_pass_check_gives_the_numpy_paths_verdicts_to_the_bit(dim, seed, spread, f32, poison,
                                                                                   own_state) -> None:
    # Up to SMALL_DIM dimensions a passing proposal is told on Python floats; the numpy path
    # (forced on a twin filter) must agree on every verdict, command, velocity and counter,
    # at the window's very edge (spread 1), just past it, for float32 targets and NaN / inf.
    rng = np.random.default_rng(seed)
    lim = Limits(lower=-rng.uniform(0.5, 3.0, dim), upper=rng.uniform(0.5, 3.0, dim),
                 max_velocity=rng.uniform(0.5, 5.0, dim), max_acceleration=rng.uniform(5.0, 100.0, dim), dt=0.02)
    fast, ref = SafetyFilter(lim), SafetyFilter(lim)
    ref._small = None  # the numpy path only
    q = rng.uniform(lim.lower * 0.5, lim.upper * 0.5)
    v = rng.uniform(-lim.max_velocity, lim.max_velocity)
    state = MotionState(q, v)
    for step in range(6):
        u = rng.choice([-spread, spread], dim) * rng.choice([1.0, rng.uniform(0, 1)], dim)
        target = state.position + lim.dt * np.clip(state.velocity + u * lim.dv, -spread * lim.max_velocity,
                                                   spread * lim.max_velocity)
        if poison is not None and step == 3:
            target[rng.integers(dim)] = poison
        if f32:
            target = target.astype(np.float32)
        a, va = fast.apply(target, state)
        b, vb = ref.apply(target, state)
        assert va is vb
        if a is None or b is None:
            assert a is None and b is None
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b)
            assert np.array_equal(fast.velocity, ref.velocity)
        assert fast.counts == ref.counts
        if a is not None:
            # The filter's own last command as the next state, as the watchdog does (the path
            # that skips the braking-room check) or, now and then, a copy of it (the full check).
            state = MotionState(a if own_state else a.copy(), fast.velocity.copy())
    if dim > 24:
        assert fast._small is None  # above SMALL_DIM the numpy path serves both


@pytest.mark.parametrize("small", [True, False])
def test_a_proposal_exactly_on_the_windows_edge_passes(small: bool) -> None:
    # Binary-exact figures: dv = 4 * 0.25 = 1, so from v = 1 the target's velocity 2 is both the
    # velocity limit and the acceleration window's top, exactly.
    lim = Limits(lower=[-100.0, -100.0], upper=[100.0, 100.0], max_velocity=2.0, max_acceleration=4.0, dt=0.25)
    f = SafetyFilter(lim)
    if not small:
        f._small = None
    state = MotionState(np.zeros(2), np.array([1.0, -1.0]))
    cmd, verdict = f.apply(np.array([0.5, -0.5]), state)
    assert verdict is Verdict.PASSED
    np.testing.assert_array_equal(f.velocity, [2.0, -2.0])
    cmd, verdict = f.apply(np.array([0.5 + 1e-12, -0.5]), state)
    assert verdict is Verdict.CLAMPED
