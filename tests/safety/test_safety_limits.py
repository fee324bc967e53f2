"""Limits: validation at construction, viability, and the step checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chunkline.safety import LimitKind, Limits, LimitsError, MotionState, UnsafeStateError
from chunkline.safety.exceptions import ActionShapeError


def make(**kw):
    base = dict(lower=[-1.0, -2.0], upper=[1.0, 2.0], max_velocity=[1.0, 2.0], max_acceleration=[10.0, 5.0], dt=0.01)
    base.update(kw)
    return Limits(**base)


def test_scalars_broadcast_and_arrays_are_read_only() -> None:
    lim = Limits(lower=[-1.0, -1.0, -1.0], upper=1.0, max_velocity=2.0, max_acceleration=3.0, dt=0.02)
    assert lim.action_dim == 3
    assert lim.upper.tolist() == [1.0, 1.0, 1.0]
    assert lim.max_velocity.dtype == np.float64
    with pytest.raises(ValueError):
        lim.upper[0] = 5.0
    np.testing.assert_allclose(lim.dv, [0.06, 0.06, 0.06])


@pytest.mark.parametrize(
    "kw",
    [
        dict(lower=[1.0, -2.0]),  # lower == upper on dim 0
        dict(lower=[2.0, -2.0]),  # crossed
        dict(max_velocity=[0.0, 1.0]),
        dict(max_velocity=[-1.0, 1.0]),
        dict(max_acceleration=[math.inf, 1.0]),
        dict(max_acceleration=[math.nan, 1.0]),
        dict(upper=[math.nan, 2.0]),
        dict(dt=0.0),
        dict(dt=-0.01),
        dict(dt=math.inf),
        dict(lower=[-1.0, -2.0, -3.0]),  # width mismatch
        dict(lower=[[-1.0, -2.0]]),
        dict(lower=[math.inf, -2.0], upper=[math.inf, 2.0]),
    ],
)
def test_invalid_limits_are_refused(kw) -> None:
    with pytest.raises(LimitsError):
        make(**kw)


def test_all_scalars_need_a_dimension() -> None:
    with pytest.raises(LimitsError):
        Limits(lower=-1.0, upper=1.0, max_velocity=1.0, max_acceleration=1.0, dt=0.01)


def test_infinite_position_bounds_are_allowed() -> None:
    lim = make(lower=[-math.inf, -2.0], upper=[math.inf, 2.0])
    assert np.isinf(lim.viable_speed(lim.upper - 0.0)[0])
    assert lim.is_viable(MotionState(np.array([1e6, 0.0]), np.array([1.0, 0.0])))


def test_viable_speed_solves_the_braking_equation() -> None:
    lim = make()
    room = np.array([0.3, 0.01])
    w = lim.viable_speed(room)
    np.testing.assert_allclose(w * lim.dt + lim.stopping_distance(w), room, rtol=1e-12)
    assert (lim.viable_speed(np.array([-1.0, 0.0])) == 0).all()


def test_viability() -> None:
    lim = make()
    # 1 m/s towards the upper bound needs 0.05 m to stop at 10 m/s^2.
    assert lim.is_viable(MotionState(np.array([0.95, 0.0]), np.array([1.0, 0.0])))
    assert not lim.is_viable(MotionState(np.array([0.96, 0.0]), np.array([1.0, 0.0])))
    assert lim.is_viable(MotionState(np.array([0.96, 0.0]), np.array([-1.0, 0.0])))
    assert not lim.is_viable(MotionState(np.array([1.5, 0.0]), np.zeros(2)))
    assert not lim.is_viable(MotionState(np.array([0.0, 0.0]), np.array([1.5, 0.0])))
    assert not lim.is_viable(MotionState(np.array([math.nan, 0.0]), np.zeros(2)))
    with pytest.raises(UnsafeStateError):
        lim.check_state(MotionState(np.array([1.5, 0.0]), np.zeros(2)))
    with pytest.raises(ActionShapeError):
        lim.check_state(MotionState.at_rest([0.0]))


def test_step_violations_name_each_limit() -> None:
    lim = make()
    rest = MotionState.at_rest([0.0, 0.0])
    assert lim.step_violations(rest, np.array([0.0005, 0.0])) == []
    assert lim.step_ok(rest, np.array([0.0005, 0.0]))
    kinds = {v.kind for v in lim.step_violations(rest, np.array([0.02, 0.0]))}
    assert kinds == {LimitKind.VELOCITY, LimitKind.ACCELERATION}  # 2 m/s from rest in 10 ms
    kinds = {v.kind for v in lim.step_violations(rest, np.array([0.002, 0.0]))}
    assert kinds == {LimitKind.ACCELERATION}
    edge = MotionState(np.array([0.999, 0.0]), np.array([0.1, 0.0]))
    kinds = {v.kind for v in lim.step_violations(edge, np.array([1.0011, 0.0]))}
    assert LimitKind.POSITION in kinds
    out = lim.step_violations(rest, np.array([math.nan, 0.0]))
    assert [v.kind for v in out] == [LimitKind.NONFINITE]
    assert not lim.step_ok(rest, np.array([math.nan, 0.0]))
    assert not lim.step_ok(rest, np.array([math.inf, 0.0]))
    assert "velocity of dim 0" in str(lim.step_violations(rest, np.array([0.02, 0.0]))[0])


def test_motion_state_advanced() -> None:
    s = MotionState.at_rest([0.0, 1.0]).advanced(np.array([0.01, 1.0]), 0.01)
    np.testing.assert_allclose(s.velocity, [1.0, 0.0])
