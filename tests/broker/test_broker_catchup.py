"""The catch-up join: a far chunk (a late answer heading elsewhere) is joined along a path within
the limits, not refused; the filter passes every command of the join; it ends exactly on the
chunk's rows, within about the least time the correction's budget allows (property test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.catchup import catch_up, join_time
from chunkline.broker.timeline import MergeOutcome
from chunkline.safety import Limits, Mode
from chunkline.safety.filter import SafetyFilter, Verdict
from chunkline.safety.limits import MotionState

A, DT = 2, 0.02
Q0 = np.array([0.0, 1.0])


def reach_limits() -> Limits:
    # The reach task's limits: 8 rad/s, 60 rad/s^2 at 50 Hz.
    return Limits(lower=[-50.0] * A, upper=[50.0] * A, max_velocity=8.0, max_acceleration=60.0, dt=DT)


def old_plan(t: np.ndarray | float) -> np.ndarray:
    """Speeds up at 6 rad/s^2 to 3 rad/s by 0.5 s, then cruises: a motion towards the old target."""
    t = np.asarray(t, dtype=np.float64)[..., None]
    p = np.where(t < 0.5, 3.0 * t * t, 0.75 + 3.0 * (t - 0.5))
    return np.asarray(Q0 + p * np.array([1.0, -1.0]))


def _broker_on(plan: np.ndarray, until: float, merge: MergeMode, resume_steps: int = 10,
               ) -> tuple[Broker, float, list[np.ndarray]]:
    """A broker that got ``plan`` (rows from 0 s) as the answer to its first request after 0.6 s
    (the round trip it expects, as at 300 ms one way), ticked to ``until`` with the requests it
    asks for unanswered; and its commands."""
    b = Broker(BrokerConfig(control_period_s=DT, merge=merge, resume_steps=resume_steps),
               initial_position=plan[0].astype(np.float64), limits=reach_limits(), verify_fallback=False)
    r = b.tick(0.0, {"s": 0}).request
    b.on_sent(r.request_id, 0.0)
    t = 0.0
    for _ in range(30):
        b.tick(t)
        t += DT
    b.on_chunk(ActionChunk(plan.astype(np.float32), 0.0, DT, len(plan) * DT, r.request_id), t)
    commands = []
    while t < until - 1e-9:
        commands.append(np.asarray(b.tick(t).action, dtype=np.float64))
        t += DT
    return b, t, commands


def _cruising_broker(merge: MergeMode, rows: int = 80, resume_steps: int = 10) -> tuple[Broker, float]:
    """A broker in policy mode at 1.2 s on a plan of ``rows`` rows: 80 rows run dry at 1.6 s,
    before a fresh answer could land."""
    b, t, _ = _broker_on(old_plan(np.arange(rows) * DT), 1.2, merge, resume_steps)
    assert b.mode is Mode.POLICY and b.watchdog.verdict is Verdict.PASSED
    return b, t


def _heading_back(t: float, speed: float, gap: float = 0.05) -> ActionChunk:
    """An answer from an observation taken at ``t`` after the target jumped: a few cm off the plan
    and heading the other way at ``speed``."""
    k = np.arange(50)[:, None]
    rows = old_plan(t) + gap - speed * k * DT * np.array([1.0, -1.0])
    return ActionChunk(rows.astype(np.float32), t, DT, t + 50 * DT, 99)


@pytest.mark.parametrize("merge", [MergeMode.REPLACE, MergeMode.RTC])
def test_a_chunk_heading_elsewhere_is_joined_within_the_limits_and_handed_over_exactly(merge) -> None:
    b, t = _cruising_broker(merge)
    assert b.remaining(t) < b.latency.estimate  # refused, the plan would run dry before a fresh answer
    counts = b.watchdog.filter.counts
    interventions = counts.interventions
    chunk = _heading_back(t, 1.5)  # 4.5 rad/s from the plan's velocity: a fade would need ~70 ticks
    assert b.on_chunk(chunk, t) is MergeOutcome.MERGED
    assert b.stats.chunks_far == 0 and b.stats.chunks_joined == 1
    commands = []
    for _ in range(40):
        cmd = b.tick(t)
        assert cmd.mode is Mode.POLICY and cmd.verdict is Verdict.PASSED
        commands.append((t, np.asarray(cmd.action, dtype=np.float64)))
        t += DT
    assert counts.interventions == interventions  # the filter cut nothing
    # It ends on the chunk's own rows (exactly: they are played as they are) ...
    rows = chunk.actions.astype(np.float64)
    on_chunk = [i for i, (tau, q) in enumerate(commands) if np.array_equal(q, rows[math.floor((tau - chunk.t0) / DT + 1e-9)])]
    assert on_chunk, "never joined the chunk"
    first = on_chunk[0]
    assert on_chunk == list(range(first, len(commands)))  # and stays there
    # ... within the time the jerk-bounded join takes at most over the bang-bang one: ramping the
    # acceleration from the plan's (0 here) to the correction's bound and across, at the jerk bound,
    # the whole stretched by its gentler approach (at most 2.2x over 4000 random joins).
    r, jerk = 30.0, 0.4 * 60.0
    predicted = join_time(np.full(A, -0.05), np.array([4.5, -4.5]), np.full(A, r))  # command minus chunk
    assert first * DT <= 2.5 * (predicted + (2 * r / jerk + 3) * DT)
    # The acceleration changes within the jerk bound from the plan's to the chunk's, through the join.
    q = np.array([q for _, q in commands])
    accel = np.diff(q, n=2, axis=0) / DT**2
    assert np.all(np.abs(np.diff(accel, axis=0)) <= jerk * (1 + 1e-6))

def test_a_far_chunk_is_refused_while_the_plan_lasts_until_a_fresh_answer() -> None:
    # The same answer, but the plan runs on past the time a fresh one asked now would land:
    # that one is asked for instead (from where the robot is: it agrees with the plan).
    b, t = _cruising_broker(MergeMode.REPLACE, rows=200)
    assert b.remaining(t) > b.latency.estimate
    assert b.on_chunk(_heading_back(t, 1.5), t) is MergeOutcome.FAR
    assert b.stats.chunks_far == 1 and b.stats.chunks_joined == 0
    assert b.tick(t, {"s": 1}).request is not None


def test_a_join_longer_than_the_longest_fade_is_taken_at_full_acceleration_when_the_plan_runs_dry_first() -> None:
    b, t = _cruising_broker(MergeMode.REPLACE)
    assert b.remaining(t) < b.latency.estimate
    counts = b.watchdog.filter.counts
    interventions = counts.interventions
    # Back at 7.5 rad/s: 10.5 rad/s to turn around at 30 rad/s^2 takes longer than the longest
    # fade (25 ticks at this round trip). Refused, the arm would run on towards the old target
    # until the plan ran dry at 1.6 s, and a fresh answer could not land before 1.8 s: joined at
    # the full acceleration budget instead, it turns round within a fifth of a second.
    chunk = _heading_back(t, 7.5, gap=0.3)
    assert b.on_chunk(chunk, t) is MergeOutcome.MERGED
    assert b.stats.chunks_far == 0 and b.stats.chunks_joined == 1
    q = []
    while t < chunk.expiry - DT:
        cmd = b.tick(t)
        assert cmd.mode is Mode.POLICY and cmd.verdict is Verdict.PASSED
        q.append(np.asarray(cmd.action, dtype=np.float64))
        t += DT
    assert counts.interventions == interventions  # the filter cut nothing
    v = np.diff(np.array(q), axis=0) / DT
    turned = np.flatnonzero(v[:, 0] < 0)
    assert turned.size and turned[0] * DT <= 0.2
    accel = np.diff(np.array(q), n=2, axis=0) / DT**2
    assert np.all(np.abs(np.diff(accel, axis=0)) <= 0.4 * 60.0 * (1 + 1e-6))  # the join's jerk bound


def _far_answer(t: float, gap: float, speed: float, rows_left: int) -> ActionChunk:
    """An answer that landed late at ``t`` with ``rows_left`` rows: ``gap`` rad off the plan in
    the first joint and moving at ``speed`` rad/s there (the first answer after reach-jump's jump
    at 300 ms one way: 1.65 rad off, -5.9 rad/s, 19 rows)."""
    first = 50 - rows_left
    k = np.arange(50)[:, None] - first
    rows = old_plan(t) + np.array([gap, 0.0]) + speed * k * DT * np.array([1.0, 0.0])
    return ActionChunk(rows.astype(np.float32), t - first * DT, DT, t + rows_left * DT, 99)


@pytest.mark.parametrize("merge", [MergeMode.REPLACE, MergeMode.RTC])
def test_a_chunk_beyond_the_switch_gap_is_joined_when_the_plan_runs_dry_first(merge) -> None:
    # Its position gap alone needs a longer fade than max_switch_steps (1.65 rad: 39 ticks): refused
    # before while the plan ran on towards the old target and then dry. Within the reach the
    # fallback would hand back with (25 resume steps: 3.5 rad), it is joined now, the join standing
    # for every row it has (it does not catch the chunk in 19 rows), each command within the limits.
    b, t = _cruising_broker(merge, resume_steps=25)
    chunk = _far_answer(t, -1.65, -5.9, 19)
    counts = b.watchdog.filter.counts
    interventions = counts.interventions
    assert b.on_chunk(chunk, t) is MergeOutcome.MERGED
    assert b.stats.chunks_far == 0 and b.stats.chunks_joined == 1
    q0 = b.timeline.plan_at(t)
    seen = []
    while t < chunk.expiry - 1e-9:
        cmd = b.tick(t)
        assert cmd.mode is Mode.POLICY and cmd.verdict is Verdict.PASSED and cmd.chunk_id == 99
        seen.append(np.asarray(cmd.action, dtype=np.float64))
        t += DT
    assert counts.interventions == interventions
    assert seen[-1][0] < q0[0] - 0.5  # well on its way back towards the chunk's side
    assert b.tick(t).mode is Mode.FALLBACK  # the chunk's rows are over: the plan runs dry there


def test_a_chunk_beyond_the_fallbacks_reach_or_while_the_plan_lasts_stays_refused() -> None:
    # Beyond the reach the fallback hands back with (10 resume steps: 1.1 rad; another elbow
    # branch), or while the plan lasts longer than a fresh answer takes: refused, the plan kept.
    b, t = _cruising_broker(MergeMode.REPLACE)  # resume_steps 10
    before = b.timeline.plan_at(t + DT).copy()
    assert b.on_chunk(_far_answer(t, -1.65, -5.9, 19), t) is MergeOutcome.FAR
    np.testing.assert_array_equal(b.timeline.plan_at(t + DT), before)
    b, t = _cruising_broker(MergeMode.REPLACE, rows=200, resume_steps=25)
    assert b.remaining(t) > b.latency.estimate
    assert b.on_chunk(_far_answer(t, -1.65, -5.9, 19), t) is MergeOutcome.FAR
    assert b.stats.chunks_far == 1 and b.stats.chunks_joined == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vmax=st.floats(1.0, 10.0),
    amax=st.floats(5.0, 100.0),
    share=st.floats(0.2, 1.0),
    gap=st.floats(-0.5, 0.5),
    v_cmd=st.floats(-0.5, 0.5),
    v_target=st.floats(-0.5, 0.5),
    a_target=st.floats(-0.4, 0.4),
)
# The slowest corner (a correction of 1 rad/s^2 catching a target at 3 rad/s): the longest join.
@example(vmax=7.3125, amax=5.0, share=0.2, gap=0.0, v_cmd=0.0, v_target=0.41796875, a_target=0.0)
def test_a_join_keeps_the_limits_and_ends_on_the_target_in_about_the_least_time(
    vmax, amax, share, gap, v_cmd, v_target, a_target
) -> None:
    # One joint at speed v_cmd (shares of the velocity limit) joins a target gap away, moving at
    # v_target and accelerating at a_target (a share of the acceleration limit the correction
    # leaves free, so the target itself stays feasible). The real filter checks every command.
    lim = Limits(lower=[-1e3], upper=[1e3], max_velocity=vmax, max_acceleration=amax, dt=DT)
    r = share * amax
    a_t = a_target * (amax - r)
    t = np.arange(400) * DT
    # The target's speed is kept under the velocity limit (it accelerates only until it would reach it).
    t_cap = (vmax * 0.4) / max(abs(a_t), 1e-9)
    tc = np.minimum(t, t_cap)
    x = (gap + v_target * vmax * t + 0.5 * a_t * tc * tc + a_t * tc * (t - tc))[:, None]
    q, v = np.zeros(1), np.array([v_cmd * vmax])
    rows = catch_up(lim, q, v, x, np.array([r]), DT)
    # Where neither limit binds (the bang-bang path's peak relative speed on top of the target's
    # stays under the velocity limit; the target's own acceleration is within what the correction
    # leaves free), it converges within its predicted time, when the target's rows last that long.
    e, ev = q[0] - x[0, 0], v[0] - (x[1, 0] - x[0, 0]) / DT
    sigma = e + ev * abs(ev) / (2 * r)
    peak = math.sqrt(max((1.0 if sigma >= 0 else -1.0) * r * e + 0.5 * ev * ev, ev * ev))
    predicted = join_time(np.array([e]), np.array([ev]), np.array([r]))
    free = peak + float(np.max(np.abs(np.diff(x[:, 0])))) / DT <= 0.9 * vmax
    if free and predicted < (len(x) - 10) * DT:
        assert rows is not None
        # The discrete join (one period's steps, inside the filter's window) runs a little longer
        # than the continuous bang-bang least time, the more so the longer it is: 3.9 ticks over
        # 7.06 s, 1.7 over 1.77 s at a 1 rad/s^2 correction. Four ticks and 2 % of the time.
        assert len(rows) * DT <= predicted * 1.02 + 4 * DT
    if rows is None:
        return  # it does not get there within the target's rows (the broker refuses such a chunk)
    n = len(rows)
    filt = SafetyFilter(lim, "reject")
    state = MotionState(q.copy(), v.copy())
    for c in [*rows, *x[n + 1:n + 4]]:  # the join, then the target's own rows
        out, verdict = filt.apply(np.asarray(c, dtype=np.float64), state)
        assert verdict is Verdict.PASSED
        state = state.advanced(out, DT)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vmax=st.floats(1.0, 10.0),
    amax=st.floats(5.0, 100.0),
    share=st.floats(0.2, 0.6),
    gap=st.floats(-0.3, 0.3),
    v_cmd=st.floats(-0.3, 0.3),
    v_target=st.floats(-0.3, 0.3),
    a_cmd=st.floats(-0.5, 0.5),
)
def test_a_jerk_bounded_join_keeps_the_limits_and_the_jerk_bound_and_ends_on_the_target(
    vmax, amax, share, gap, v_cmd, v_target, a_cmd
) -> None:
    # The broker's join: from a command accelerating at a_cmd (a share of the limit), the
    # acceleration changes by at most the jerk bound per tick, through the hand-over to the target.
    lim = Limits(lower=[-1e3], upper=[1e3], max_velocity=vmax, max_acceleration=amax, dt=DT)
    r, jerk, a0 = share * amax, 0.4 * amax, a_cmd * amax
    x = (gap + v_target * vmax * np.arange(400) * DT)[:, None]
    q, v = np.zeros(1), np.array([v_cmd * vmax])
    rows = catch_up(lim, q, v, x, np.array([r]), DT, jerk=np.array([jerk]), acceleration=np.array([a0]))
    e, ev = q[0] - x[0, 0], v[0] - v_target * vmax
    sigma = e + ev * abs(ev) / (2 * r)
    peak = math.sqrt(max((1.0 if sigma >= 0 else -1.0) * r * e + 0.5 * ev * ev, ev * ev))
    predicted = join_time(np.array([e]), np.array([ev]), np.array([r]))
    bound = 2.5 * (predicted + ((abs(a0) + 2 * r) / jerk + 3) * DT)
    if peak + abs(v_target) * vmax <= 0.9 * vmax and bound < (len(x) - 10) * DT:
        assert rows is not None and len(rows) * DT <= bound
    if rows is None:
        return
    n = len(rows)
    filt = SafetyFilter(lim, "reject")
    state, a_prev = MotionState(q.copy(), v.copy()), a0
    for c in [*rows, *x[n + 1:n + 4]]:
        a = ((c - state.position) / DT - state.velocity) / DT
        assert abs(float(a[0]) - a_prev) <= jerk * (1 + 1e-6)
        out, verdict = filt.apply(np.asarray(c, dtype=np.float64), state)
        assert verdict is Verdict.PASSED
        state, a_prev = state.advanced(out, DT), float(a[0])


def test_a_far_chunk_is_taken_at_once_while_the_command_ramps_in_from_the_fallback() -> None:
    # The ramp from the fallback blends into whatever chunk it is given from where the command is
    # (clamped to the limits); a far one that lands while it runs, when the plan would run dry
    # before a fresh answer, becomes its target at once (it was refused before, and the ramp went
    # on into the plan it was about to lose).
    b, t = _cruising_broker(MergeMode.REPLACE, resume_steps=25)
    while b.tick(t).mode is not Mode.FALLBACK:
        t += DT
    t += DT
    held = np.asarray(b.watchdog.state.position, dtype=np.float64)
    near = ActionChunk(np.repeat(held[None], 50, axis=0).astype(np.float32), t - 30 * DT, DT, t + 20 * DT, 98)
    assert b.on_chunk(near, t) is MergeOutcome.MERGED
    assert b.tick(t).mode is Mode.RESUMING
    t += DT
    assert b.watchdog.ramping and b.remaining(t) < b.latency.estimate
    k = np.arange(50)[:, None] - 30
    far = held + np.array([-1.65, 0.0]) - 3.0 * k * DT * np.array([1.0, 0.0])
    assert b.on_chunk(ActionChunk(far.astype(np.float32), t - 30 * DT, DT, t + 20 * DT, 97), t) is MergeOutcome.MERGED
    assert b.stats.chunks_far == 0 and b.stats.chunks_joined == 0  # taken as it is: the ramp blends it in
    dog = b.watchdog.state
    state = MotionState(np.array(dog.position, dtype=np.float64), np.array(dog.velocity, dtype=np.float64))
    for _ in range(10):
        cmd = b.tick(t)
        assert cmd.mode is Mode.RESUMING and cmd.chunk_id == 97
        assert not reach_limits().step_violations(state, np.asarray(cmd.action))
        state = state.advanced(np.asarray(cmd.action, dtype=np.float64), DT)
        t += DT


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    v_plan=st.tuples(st.floats(-4.0, 4.0), st.floats(-4.0, 4.0)),
    gap=st.tuples(st.floats(-3.0, 3.0), st.floats(-3.0, 3.0)),
    v_chunk=st.tuples(st.floats(-7.0, 7.0), st.floats(-7.0, 7.0)),
    rows_left=st.integers(3, 40),
)
def test_a_chunk_taken_while_the_plan_runs_dry_keeps_the_filter_and_the_jerk_bound(v_plan, gap, v_chunk, rows_left) -> None:
    # Any far answer that lands while the plan would run dry before a fresh one: merged or refused,
    # every command of the policy's plan passes the filter as it is, and a join changes the
    # acceleration by at most its jerk bound per tick, from the plan's (cruising: 0) on.
    lim = reach_limits()
    plan = Q0 + np.array(v_plan) * np.arange(130)[:, None] * DT  # dry at 2.6 s
    # The ramp from the fallback, the chase, then cruising on the plan.
    b, t, q = _broker_on(plan, 2.2, MergeMode.RTC, resume_steps=25)
    assert b.mode is Mode.POLICY
    np.testing.assert_allclose(np.diff(q[-4:], n=2, axis=0) / DT**2, 0.0, atol=1e-2)
    first = 50 - rows_left
    k = np.arange(50)[:, None] - first
    rows = b.timeline.plan_at(t) + np.array(gap) + np.array(v_chunk) * k * DT
    outcome = b.on_chunk(ActionChunk(rows.astype(np.float32), t - first * DT, DT, t + rows_left * DT, 99), t)
    assert outcome in (MergeOutcome.MERGED, MergeOutcome.FAR)
    joined = outcome is MergeOutcome.MERGED and b.stats.chunks_joined == 1
    filt = SafetyFilter(lim, "reject")
    dog = b.watchdog.state
    state = MotionState(np.array(dog.position, dtype=np.float64), np.array(dog.velocity, dtype=np.float64))
    a_prev = np.zeros(A)
    while t < 2.6 - 1e-9:
        cmd = b.tick(t)
        if cmd.mode is not Mode.POLICY:
            break
        assert cmd.verdict is Verdict.PASSED
        c = np.asarray(cmd.action, dtype=np.float64)
        a = ((c - state.position) / DT - state.velocity) / DT
        if joined:
            # (0.01 rad/s^2: the plan's float32 rows accelerate by that much around its nominal 0)
            assert np.all(np.abs(a - a_prev) <= 0.4 * 60.0 + 1e-2)
        out, verdict = filt.apply(c, state)
        assert verdict is Verdict.PASSED
        state, a_prev = state.advanced(out, DT), a
        t += DT
