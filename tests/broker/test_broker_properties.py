"""Property tests: whatever the chunks, latencies, outages and action values, every tick emits
exactly one command, and every command keeps the safety limits."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.sim import ScriptedServer, simulate
from chunkline.safety import FilterMode, Limits, Mode, MotionState, SafePoseBehaviour

A = 3


@st.composite
def scenarios(draw):
    dt = draw(st.sampled_from([0.01, 0.02, 1 / 30]))
    vmax = np.array(draw(st.lists(st.floats(0.2, 3), min_size=A, max_size=A)))
    lim = Limits(
        lower=[-1.0, -0.5, 0.0],
        upper=[1.0, 0.5, 0.1],
        max_velocity=vmax,
        max_acceleration=vmax * draw(st.floats(2, 60)),
        dt=dt,
    )
    chunk_dt = dt * draw(st.sampled_from([1, 1, 2, 0.5]))
    horizon = draw(st.integers(1, 60))
    n_req = 400
    latencies = draw(st.lists(st.floats(0.0, 1.5), min_size=1, max_size=8))
    outages = []
    t = 0.0
    for _ in range(draw(st.integers(0, 2))):
        start = t + draw(st.floats(0.05, 2.0))
        end = start + draw(st.floats(0.01, 2.5))
        outages.append((start, end))
        t = end
    return dict(
        limits=lim,
        chunk_dt=chunk_dt,
        horizon=horizon,
        latencies=[latencies[i % len(latencies)] for i in range(n_req)],
        outages=outages,
        fail=set(draw(st.lists(st.integers(0, 30), max_size=6))),
        valid_for=draw(st.one_of(st.none(), st.floats(0.01, 3.0))),
        seed=draw(st.integers(0, 2**31)),
        spread=draw(st.sampled_from([0.01, 0.3, 5.0])),  # how wild the policy's actions are
        bad_rate=draw(st.sampled_from([0.0, 0.01, 0.2])),  # NaN / +-inf per value
        merge=draw(st.sampled_from(list(MergeMode))),
        filter_mode=draw(st.sampled_from(list(FilterMode))),
        safe_pose=draw(st.booleans()),
        resume_steps=draw(st.integers(1, 8)),
        max_age=draw(st.one_of(st.none(), st.floats(0.001, 0.1))),
        duration=draw(st.floats(0.5, 4.0)),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_property_every_tick_one_command_within_limits(sc) -> None:
    lim: Limits = sc["limits"]
    rng = np.random.default_rng(sc["seed"])
    start = rng.uniform(lim.lower, lim.upper)

    def policy(obs, obs_time, prefix):
        base = np.asarray(obs["state"])
        acts = base + sc["spread"] * rng.standard_normal((sc["horizon"], A))
        bad = rng.random(acts.shape) < sc["bad_rate"]
        acts[bad] = rng.choice([math.nan, math.inf, -math.inf], size=int(bad.sum()))
        return acts

    server = ScriptedServer(
        policy=policy,
        dt=sc["chunk_dt"],
        latency=lambda i, t: sc["latencies"][i % len(sc["latencies"])],
        valid_for=sc["valid_for"],
        outages=sc["outages"],
        fail=sc["fail"],
    )
    config = BrokerConfig(
        control_period_s=lim.dt,
        merge=sc["merge"],
        filter_mode=sc["filter_mode"],
        resume_steps=sc["resume_steps"],
        max_age_s=sc["max_age"],
    )
    fallback = SafePoseBehaviour(lim, (lim.lower + lim.upper) / 2) if sc["safe_pose"] else None
    broker = Broker(config, initial_position=start, limits=lim, fallback=fallback)
    ticks = []
    res = simulate(broker, server, duration_s=sc["duration"], on_tick=ticks.append)

    n = int(round(sc["duration"] / lim.dt))
    assert len(ticks) == n == broker.stats.ticks == broker.watchdog.counts.ticks
    state = MotionState.at_rest(start)
    for cmd in ticks:
        assert cmd.action.shape == (A,)
        violations = lim.step_violations(state, cmd.action)
        assert violations == [], (cmd, violations)
        state = state.advanced(cmd.action, lim.dt)
        if cmd.mode is Mode.FALLBACK:
            assert cmd.reason is not None and cmd.chunk_id is None
        else:
            tol = sc["max_age"] if sc["max_age"] is not None else sc["chunk_dt"]
            assert cmd.action_age_s is not None and cmd.action_age_s <= tol + 1e-9
    counts = broker.watchdog.counts
    assert counts.policy_ticks + counts.resuming_ticks + counts.fallback_ticks == n
    assert counts.fallback_interventions == 0  # the verified fallback never needed the filter
    assert res.actions.shape == (n, A)


_events = st.lists(
    st.tuples(
        st.sampled_from(["chunk", "chunk", "chunk", "error", "down", "up", "nothing"]),
        st.floats(-1.0, 0.5),  # chunk t0 relative to its arrival (past or future)
        st.integers(1, 40),  # horizon
        st.sampled_from([0.005, 0.01, 0.02, 0.05]),  # chunk dt
        st.one_of(st.none(), st.floats(-0.1, 2.0)),  # expiry relative to t0
        st.floats(-3.0, 3.0) | st.sampled_from([math.nan, math.inf, -math.inf]),  # value
        st.integers(0, 5),  # ticks until the next event
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(events=_events, merge=st.sampled_from(list(MergeMode)), mode=st.sampled_from(list(FilterMode)))
def test_property_arbitrary_event_interleavings(events, merge: MergeMode, mode: FilterMode) -> None:
    """Chunks from the past or the future, expired on arrival, out of order, of any dt; errors
    and link changes at any tick: still one command per tick, within the limits, never stale."""
    dt = 0.01
    lim = Limits(lower=[-1.0, -1.0, -1.0], upper=[1.0, 1.0, 1.0], max_velocity=1.0, max_acceleration=20.0, dt=dt)
    broker = Broker(BrokerConfig(control_period_s=dt, merge=merge, filter_mode=mode), initial_position=np.zeros(A), limits=lim)
    state = MotionState.at_rest(np.zeros(A))
    now = 0.0
    ticks = 0
    rid = 0
    for kind, rel_t0, h, cdt, rel_exp, value, wait in events:
        if kind == "chunk":
            rid += 1
            t0 = now + rel_t0
            acts = np.full((h, A), value, dtype=np.float64)
            acts[:, 1] = np.linspace(-0.5, 0.5, h)
            broker.on_chunk(ActionChunk(acts, t0, cdt, None if rel_exp is None else t0 + rel_exp, rid), now)
        elif kind == "error":
            broker.on_error(now, code="internal")
        elif kind == "down":
            broker.on_disconnect(now)
        elif kind == "up":
            broker.on_connect(now)
        for _ in range(wait + 1):
            cmd = broker.tick(now, {"state": state.position})
            ticks += 1
            assert lim.step_violations(state, cmd.action) == []
            state = state.advanced(cmd.action, dt)
            if cmd.mode is not Mode.FALLBACK:
                assert cmd.action_age_s is not None and cmd.action_age_s <= 0.05 + 1e-9
            now += dt
    assert broker.stats.ticks == ticks == broker.watchdog.counts.ticks
