"""The catch-up join: from the command state onto a chunk's trajectory, within the limits.

A cross-fade between the old plan and a new chunk that heads elsewhere (a late answer after the
target moved: several rad/s apart) has to be long to keep the acceleration it adds within the
switch budget, because the two trajectories keep diverging while it runs; the limits themselves
would change that velocity in a fraction of a second. The join instead steers the command onto
the chunk directly: per joint, the chunk's own acceleration (feed-forward) plus a correction of at
most ``accel`` that drives the position and velocity error to zero in (nearly) the least time a
bounded acceleration allows, each step kept inside the filter's velocity window (acceleration,
velocity and braking room before a bound), so the filter passes every command as it is. Once
switching to the chunk's own rows passes within the same budget, the join ends and the chunk
plays exactly.

The correction is the discrete time-optimal synthesis of a double integrator (Han's ``fhan``):
it reaches the switching curve of the bang-bang solution and slides along it without chattering,
so an unbounded join takes :func:`join_time` plus a few ticks. The broker also bounds the jerk
(the change of acceleration per tick, the join's start and hand-over included: a bang-bang
acceleration step is what a switch must not add); the join then ramps its acceleration and
takes longer. It is computed once, at the switch (``O(ticks)``, off the per-tick path), and is
refused (``None``) when it does not end within the chunk's rows. Pure functions of their
arguments: deterministic, no clock.
"""

from __future__ import annotations

import numpy as np

from ..safety.limits import Limits, MotionState

__all__ = ["join_time", "catch_up"]

#: commands keep this relative margin from the filter's window (float round-off in its check).
_MARGIN = 1e-6


def join_time(gap: np.ndarray, dv: np.ndarray, accel: np.ndarray) -> float:
    """The least time a relative acceleration bounded by ``accel`` needs to bring a position error
    ``gap`` and a velocity error ``dv`` (per joint, command minus target) both to zero: the
    bang-bang solution's duration, the longest over the joints (seconds)."""
    x1, x2, r = np.asarray(gap, np.float64), np.asarray(dv, np.float64), np.asarray(accel, np.float64)
    # Above the switching curve x1 = -x2|x2|/(2r) the error decelerates at -r, then accelerates at +r.
    sigma = x1 + x2 * np.abs(x2) / (2.0 * r)
    s = np.where(sigma >= 0.0, 1.0, -1.0)
    t = (s * x2 + 2.0 * np.sqrt(np.maximum(s * r * x1 + 0.5 * x2 * x2, 0.0))) / r
    return float(np.max(t)) if t.size else 0.0


def _fhan(x1: np.ndarray, x2: np.ndarray, r: np.ndarray, h: float) -> np.ndarray:
    """Han's discrete time-optimal control of ``x1'' = u``, ``|u| <= r``, step ``h``."""
    d = r * h
    d0 = h * d
    y = x1 + h * x2
    a0 = np.sqrt(d * d + 8.0 * r * np.abs(y))
    a = np.where(np.abs(y) > d0, x2 + 0.5 * (a0 - d) * np.sign(y), x2 + y / h)
    u: np.ndarray = np.where(np.abs(a) > d, -r * np.sign(a), -r * a / d)
    return u


def _window(limits: Limits, q: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The filter's window for the next velocity from command ``q`` moving at ``v``, shrunk by the margin."""
    lo, hi = limits.velocity_window(MotionState(q, v))
    shrink = _MARGIN * (np.abs(lo) + np.abs(hi) + limits.dv)
    return lo + shrink, hi - shrink


def catch_up(limits: Limits, position: np.ndarray, velocity: np.ndarray, target: np.ndarray, accel: np.ndarray,
             period: float, jerk: np.ndarray | None = None, acceleration: np.ndarray | None = None,
             partial: bool = False) -> np.ndarray | None:
    """The commands that join ``target`` from the command state, or ``None`` when it does not
    within its rows (``partial``: the commands it has by then, one per row but the last three).

    Args:
        limits: the filter's limits (``limits.dt`` is the control period the filter checks with).
        position: the last command ``[A]``.
        velocity: its velocity ``[A]`` (the filter's state).
        target: the chunk's commands at the ticks ``[K, A]``: row 0 is the one before the join's
            first tick (its velocity and acceleration are read from rows 0-2), row ``i`` the one
            due at the join's ``i``-th tick.
        accel: the correction's bound per joint (a share of the acceleration limit).
        period: the control period.
        jerk: the largest change of the command's acceleration from one tick to the next, per
            joint (``None``: unbounded), the hand-over to the chunk's rows included.
        acceleration: the command's acceleration before the join (with ``jerk``; default 0).
        partial: when the join does not end within the rows, return its commands up to there
            instead of ``None`` (each inside the filter's window, heading onto the target).

    Returns:
        ``[n, A]``: the join's commands, one per tick from the first; the chunk's row ``n + 1``
        plays at the tick after them and passes the filter (as does the row after it), the
        acceleration changing within ``jerk`` up to the one after that. Empty when the chunk can
        be taken at once.
    """
    q = np.asarray(position, dtype=np.float64)
    v = np.asarray(velocity, dtype=np.float64)
    x = np.asarray(target, dtype=np.float64)
    r = np.asarray(accel, dtype=np.float64)
    inv = 1.0 / period
    amax = limits.max_acceleration
    vt_prev = (x[1] - x[0]) * inv  # the target's velocity at row 0 (one-sided)
    a_prev = np.zeros_like(q) if acceleration is None else np.asarray(acceleration, dtype=np.float64)
    jmax = np.full_like(q, np.inf) if jerk is None else np.asarray(jerk, dtype=np.float64)
    # Han's filter factor: with the jerk bounded the acceleration lags what fhan asks for, and a
    # one-tick step overshoots into a limit cycle (2703 of 3000 random joins never ended); a
    # three-tick one approaches gently enough (all ended). Without it, one tick: least time.
    hh = period if jerk is None else 3.0 * period
    rows: list[np.ndarray] = []
    for i in range(1, x.shape[0] - 2):
        vt = (x[i] - x[i - 1]) * inv
        vt_next = (x[i + 1] - x[i]) * inv
        a_after = (x[i + 2] - 2.0 * x[i + 1] + x[i]) * inv * inv  # the chunk's own, once handed over
        # Hand over when taking the chunk's row i now, and its next row after, both pass the filter
        # and neither needs more than the correction's budget beyond the chunk's own acceleration.
        v_take = (x[i] - q) * inv
        lo, hi = _window(limits, q, v)
        if ((v_take >= lo) & (v_take <= hi)).all():
            a_take, a_next = (v_take - v) * inv, (vt_next - v_take) * inv
            a_own = (vt - vt_prev) * inv
            if (np.abs(a_take - a_own) <= r).all() and (np.abs(a_next) <= amax * (1 - _MARGIN)).all() \
                    and (np.abs(a_next - (vt_next - vt) * inv) <= r).all() \
                    and (np.abs(a_take - a_prev) <= jmax).all() and (np.abs(a_next - a_take) <= jmax).all() \
                    and (np.abs(a_after - a_next) <= jmax).all():
                return np.asarray(rows).reshape(len(rows), q.shape[0])
        # Otherwise one step of the join: the chunk's acceleration plus the time-optimal correction
        # of the error it would have at this tick, inside the filter's window.
        u = _fhan(q - x[i - 1], v - vt_prev, r, hh)
        a = (vt - vt_prev) * inv + u
        if jerk is not None:
            # Approach the velocity limit with the acceleration tapering off at the jerk bound (the
            # window below would otherwise stop it within one tick): a^2 P / (2J) + a P <= room.
            vlim = limits.max_velocity * (1 - _MARGIN)
            up = -jmax + np.sqrt(jmax * jmax + 2.0 * jmax * np.maximum(vlim - v, 0.0) * inv)
            down = -jmax + np.sqrt(jmax * jmax + 2.0 * jmax * np.maximum(vlim + v, 0.0) * inv)
            a = np.clip(a, -down, up)
        a = np.clip(a, a_prev - jmax, a_prev + jmax)
        v_next = np.clip(v + a * period, lo, hi)
        q = q + v_next * period
        a_prev = (v_next - v) * inv
        v = v_next
        vt_prev = vt
        rows.append(q)
    if partial:
        return np.asarray(rows).reshape(len(rows), q.shape[0])
    return None

