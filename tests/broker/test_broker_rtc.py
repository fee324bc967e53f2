"""The broker at high latency: switches the filter never has to cut, far chunks refused, several
requests in flight keeping the plan full, the rtc merge and its prefix (property tests)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.latency import LatencyWindow
from chunkline.broker.sim import ScriptedServer, simulate
from chunkline.broker.timeline import MergeOutcome
from chunkline.safety import Limits, Mode
from chunkline.safety.filter import Verdict

A, DT, H = 2, 0.02, 50


def limits() -> Limits:
    return Limits(lower=[-10.0] * A, upper=[10.0] * A, max_velocity=2.0, max_acceleration=20.0, dt=DT)


def reference(t: float) -> np.ndarray:
    # Within half the limits (0.57 rad/s, 1.1 rad/s^2): what a switch may add is the other half.
    return 0.3 * np.sin(2 * np.pi * 0.3 * t + np.arange(A))


def disagreeing_policy(offsets: list[float], lags: list[float]):
    """Chunks on the reference, each shifted by its own offset and time lag: consecutive chunks
    disagree in position and velocity, as a policy re-planning from a stale observation does."""
    count = [0]

    def policy(obs, obs_time, prefix):
        i = count[0]
        count[0] += 1
        off, lag = offsets[i % len(offsets)], lags[i % len(lags)]
        return np.stack([reference(obs_time + k * DT - lag) + off for k in range(H)]).astype(np.float32)

    return policy


def _running_broker(merge: MergeMode) -> tuple[Broker, float]:
    """A broker in policy mode on a long chunk that follows the reference, settled after its resume."""
    b = Broker(BrokerConfig(control_period_s=DT, merge=merge), initial_position=reference(0.0), limits=limits())
    r = b.tick(0.0, {"s": 0}).request
    b.on_sent(r.request_id, 0.0)
    long = np.stack([reference(k * DT) for k in range(4 * H)]).astype(np.float32)
    b.on_chunk(ActionChunk(long, 0.0, DT, 4 * H * DT, r.request_id), 0.0)
    t = 0.0
    for _ in range(60):
        b.tick(t)
        t += DT
    assert b.mode is Mode.POLICY and b.watchdog.verdict is Verdict.PASSED
    return b, t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    offset=st.floats(-1.5, 1.5),
    lag=st.floats(-0.4, 0.4),
    late=st.floats(0.0, 0.5),
    merge=st.sampled_from([MergeMode.REPLACE, MergeMode.BLEND, MergeMode.RTC, MergeMode.ENSEMBLE]),
)
def test_a_switch_never_asks_the_filter_for_a_cut(offset, lag, late, merge) -> None:
    # A chunk that disagrees with the plan in position and velocity (a policy that re-planned
    # from a stale observation), arriving part-way in: either it is cross-faded in without one
    # clamped command, or it is refused (too far) and the plan runs on untouched.
    b, t = _running_broker(merge)
    obs_time = t - late
    acts = np.stack([reference(obs_time + k * DT - lag) + offset for k in range(H)]).astype(np.float32)
    outcome = b.on_chunk(ActionChunk(acts, obs_time, DT, obs_time + H * DT, 99), t)
    verdicts = []
    for _ in range(int(1.5 / DT)):
        cmd = b.tick(t)
        t += DT
        if cmd.mode is Mode.POLICY:
            verdicts.append(cmd.verdict)
    assert outcome in (MergeOutcome.MERGED, MergeOutcome.FAR)
    assert verdicts and all(v is Verdict.PASSED for v in verdicts), (outcome, verdicts.count(Verdict.CLAMPED))
    if abs(offset) < 0.05 and abs(lag) < 0.02:
        assert outcome is MergeOutcome.MERGED  # a chunk that agrees is never refused


def test_a_chunk_too_far_to_fade_in_is_refused_and_a_new_request_goes_out() -> None:
    b = Broker(BrokerConfig(control_period_s=DT), initial_position=reference(0.0), limits=limits())
    r = b.tick(0.0, {"s": 0}).request
    b.on_sent(r.request_id, 0.0)
    on_ref = np.stack([reference(k * DT) for k in range(H)]).astype(np.float32)
    b.on_chunk(ActionChunk(on_ref, 0.0, DT, H * DT, r.request_id), 0.0)
    t = 0.0
    for _ in range(12):
        b.tick(t)
        t += DT
    assert b.mode is Mode.POLICY
    before = b.timeline.plan_at(t + DT).copy()
    # The other elbow branch: 3 rad away, more than max_switch_steps can fade in.
    far = ActionChunk(on_ref + 3.0, t, DT, t + H * DT, 99)
    assert b.on_chunk(far, t) is MergeOutcome.FAR and b.stats.chunks_far == 1
    np.testing.assert_array_equal(b.timeline.plan_at(t + DT), before)
    assert b.tick(t, {"s": 1}).request is not None  # asked again at once, from where the robot is


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rtt=st.floats(0.05, 0.7), jitter=st.floats(0.0, 0.02), seed=st.integers(0, 2**16))
def test_round_trips_up_to_most_of_a_chunk_keep_the_plan_full(rtt, jitter, seed) -> None:
    # One second of actions per chunk; with one request in flight the plan would run dry above
    # half a second of round trip. Several in flight keep it full up to most of the chunk.
    rng = np.random.default_rng(seed)
    lat = rtt + rng.uniform(0, jitter, 2000)
    b = Broker(BrokerConfig(control_period_s=DT, initial_latency_s=rtt), initial_position=reference(0.0),
               limits=limits())
    server = ScriptedServer(policy=disagreeing_policy([0.0], [0.0]), dt=DT, latency=lambda i, t: lat[i])
    res = simulate(b, server, duration_s=12.0)
    # From the second chunk on (the first one, asked from a standstill, covers only 1 s - rtt).
    settled = [m for t, m in zip(res.times, res.modes, strict=True) if t > 1.0 + 2 * rtt + 0.5]
    assert settled and all(m is not Mode.FALLBACK for m in settled)
    assert len(b.in_flight_ids) <= b.config.max_in_flight
    if rtt + jitter > 0.55:
        assert b.stats.requests_sent > 12 / (1.0 - rtt)  # overlapping: more than one per chunk's net coverage


def test_rtc_sends_the_rest_of_the_plan_and_the_frozen_count() -> None:
    b = Broker(BrokerConfig(control_period_s=DT, merge=MergeMode.RTC, initial_latency_s=0.1, prefetch_margin_s=0.02),
               initial_position=reference(0.0), limits=limits())
    r = b.tick(0.0, {"s": 0}).request
    b.on_sent(r.request_id, 0.0)
    on_ref = np.stack([reference(k * DT) for k in range(H)]).astype(np.float32)
    b.on_chunk(ActionChunk(on_ref, 0.0, DT, H * DT, r.request_id), 0.1)
    t = 0.12
    while (cmd := b.tick(t, {"s": 0})).request is None:
        t += DT
    p, d = cmd.request.prefix, cmd.request.prefix_delay
    k = int(round(t / DT))
    np.testing.assert_allclose(p, on_ref[k:], atol=1e-6)  # the whole rest of the plan
    assert d == math.ceil((0.1 + 0.02) / DT - 1e-9)  # the rows that run before the answer is expected


def test_the_latency_model_covers_the_spread_as_well_as_the_quantile() -> None:
    w = LatencyWindow(size=10, quantile=0.95, initial=0.1, spread_k=2.0)
    for x in [0.1] * 9 + [0.5]:
        w.add(x)
    assert w.mean == np.float64(0.14).item() or math.isclose(w.mean, 0.14)
    assert math.isclose(w.spread, 0.12, rel_tol=1e-9)
    assert math.isclose(w.estimate, 0.5)  # the quantile (nearest rank) is the spike itself
    w2 = LatencyWindow(size=100, quantile=0.5, spread_k=2.0)
    for x in [0.1, 0.3] * 10:
        w2.add(x)
    assert math.isclose(w2.estimate, 0.2 + 2 * 0.1)  # mean + 2 sd above the median


def test_the_settings_file_reaches_the_new_broker_fields() -> None:
    from chunkline.broker.settings import RobotSettings

    cfg = RobotSettings.model_validate({"broker": {"merge": "rtc", "max_in_flight": 2, "replan_interval_s": 0.1,
                                                   "latency_spread_k": 1.5, "max_switch_steps": 10}}).broker_config()
    assert cfg.merge is MergeMode.RTC and cfg.max_in_flight == 2 and cfg.replan_interval_s == 0.1
    assert cfg.latency_spread_k == 1.5 and cfg.max_switch_steps == 10
    assert RobotSettings().broker_config() == BrokerConfig()  # the file's defaults are the config's
