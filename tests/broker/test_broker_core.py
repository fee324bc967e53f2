"""The broker core against a scripted fake server on a simulated clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chunkline.broker import ActionChunk, Broker, BrokerConfig, BrokerConfigError, MergeMode, MergeOutcome
from chunkline.broker.sim import ReferencePolicy, ScriptedServer, simulate
from chunkline.safety import FallbackReason, Limits, Mode

DT = 0.02
A = 3


def limits() -> Limits:
    return Limits(lower=[-2.0] * A, upper=[2.0] * A, max_velocity=2.0, max_acceleration=40.0, dt=DT)


def reference(t: float) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * 0.25 * t + np.arange(A))


def make_broker(**cfg) -> Broker:
    # These tests are about the prefetch and the timeline under ``replace`` (rtc: test_broker_rtc*).
    cfg.setdefault("merge", MergeMode.REPLACE)
    return Broker(BrokerConfig(refresh_queued=False, control_period_s=DT, **cfg), initial_position=reference(0.0), limits=limits())


def server(latency=lambda i, t: 0.06, **kw) -> ScriptedServer:
    return ScriptedServer(policy=ReferencePolicy(reference, DT, 50, step=0.02), dt=DT, latency=latency, **kw)


def chunk(t0: float, rid: int, h: int = 50, value: float | None = None) -> ActionChunk:
    if value is None:
        acts = np.stack([reference(t0 + k * DT) for k in range(h)])
    else:
        acts = np.full((h, A), value)
    return ActionChunk(acts.astype(np.float32), t0, DT, t0 + h * DT, rid)


def test_first_tick_asks_for_a_chunk_and_holds_meanwhile() -> None:
    b = make_broker()
    cmd = b.tick(0.0, {"state": np.zeros(A)})
    assert cmd.mode is Mode.FALLBACK and cmd.reason is FallbackReason.NO_CHUNK
    np.testing.assert_array_equal(cmd.action, reference(0.0))
    assert cmd.request is not None and cmd.request.deadline_ms == pytest.approx(1000.0)
    assert cmd.request.prefix is None  # nothing will run meanwhile
    assert b.tick(0.0).wants_observation is True  # still due, but no observation given


def test_a_late_chunk_starts_at_the_action_due_now() -> None:
    b = make_broker()
    intent = b.tick(0.0, {"s": 0}).request
    b.on_sent(intent.request_id, 0.0)
    # The reply comes 90 ms after the observation: actions 0..3 are past and never run.
    assert b.on_chunk(chunk(0.0, intent.request_id), 0.09) is MergeOutcome.MERGED
    cmd = b.tick(0.1)
    assert cmd.mode is Mode.RESUMING and cmd.chunk_id == intent.request_id
    assert cmd.action_age_s == pytest.approx(0.0, abs=1e-9)
    assert b.latency.last == pytest.approx(0.09)
    for _ in range(10):
        cmd = b.tick(cmd.time + DT)
    assert cmd.mode is Mode.POLICY
    np.testing.assert_allclose(cmd.action, reference(cmd.time), atol=1e-6)


def test_no_stale_or_expired_action_is_ever_returned() -> None:
    rng = np.random.default_rng(1)
    lat = rng.uniform(0.01, 0.6, 1000)
    # No limits: the chunks disagree by more than a jump within them, and a cross-faded switch
    # (what the broker does then) would mix two chunks' actions; this test is about time.
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=DT), initial_position=reference(0.0), limits=None)
    sent = {}
    inner = ReferencePolicy(reference, DT, 50, step=0.02)
    valid_for = 0.7

    def policy(obs, obs_time, prefix):
        acts = inner(obs, obs_time, prefix)
        sent[obs_time] = acts
        return acts

    chunks = {}  # request id -> (t0, actions)
    checked = []

    def check(cmd) -> None:
        if cmd.request is not None:
            chunks[cmd.request.request_id] = cmd.request.obs_time
        if cmd.mode is Mode.FALLBACK:
            assert cmd.chunk_id is None
            return
        assert cmd.action_age_s is not None and -1e-9 <= cmd.action_age_s <= DT + 1e-9
        t0 = chunks[cmd.chunk_id]
        assert cmd.time <= t0 + valid_for + 1e-9  # never after the chunk's expiry
        if cmd.mode is Mode.POLICY and cmd.verdict.value == "passed":
            # Exactly the action of that chunk due now (the latest whose due time has come).
            k = int(np.floor((cmd.time - t0) / DT + 1e-9))
            np.testing.assert_allclose(cmd.action, sent[t0][k], atol=1e-6)
            checked.append(k)

    simulate(b, ScriptedServer(policy=policy, dt=DT, latency=lambda i, t: lat[i], valid_for=valid_for), duration_s=30.0, on_tick=check)
    assert len(checked) > 500 and b.stats.chunks_merged > 10
    assert max(checked) > 10  # late chunks started part-way in


@pytest.mark.parametrize("rtt", [0.02, 0.15, 0.3, 0.45])
def test_steady_latency_below_the_budget_never_empties_the_timeline(rtt: float) -> None:
    # With one request in flight, a chunk of length T keeps the timeline full when the round
    # trip is below T / 2 (each chunk must cover its successor's round trip): here T = 1 s.
    b = make_broker()
    res = simulate(b, server(latency=lambda i, t: rtt), duration_s=20.0)
    first_policy = res.modes.index(Mode.POLICY)
    assert all(m is not Mode.FALLBACK for m in res.modes[first_policy:])
    assert b.stats.requests_timed_out == 0 and b.stats.chunks_late == 0
    # It does not over-ask either: about one request per (chunk length - round trip).
    assert b.stats.requests_sent <= 20.0 / (1.0 - rtt - 0.06) + 3


def test_jittery_latency_uses_the_p95_and_stays_on_the_policy() -> None:
    rng = np.random.default_rng(7)
    lat = np.clip(rng.normal(0.05, 0.02, 5000), 0.01, None)
    b = make_broker()
    res = simulate(b, server(latency=lambda i, t: lat[i], valid_for=0.3), duration_s=60.0)
    after_warmup = res.modes[100:]
    assert sum(m is Mode.FALLBACK for m in after_warmup) / len(after_warmup) < 0.002
    assert b.latency.estimate == pytest.approx(np.quantile(lat[: b.stats.requests_sent][-50:], 0.95), abs=0.02)


def test_two_second_outage_falls_back_within_a_period_and_recovers() -> None:
    b = make_broker()
    outage = (5.0, 7.0)
    seen = {}

    def watch(cmd) -> None:
        if abs(cmd.time - outage[0]) < 1e-9:
            seen["dry_at"] = b.timeline.valid_until  # what was left when the link went down

    res = simulate(b, server(latency=lambda i, t: 0.1, outages=[outage]), duration_s=10.0, on_tick=watch)
    times = res.times
    down = [i for i, (t, m) in enumerate(zip(times, res.modes, strict=False)) if t >= outage[0] and m is Mode.FALLBACK]
    first_fb = times[down[0]]
    # Valid actions keep running after the link drops, then the fallback takes over within one period.
    assert first_fb > outage[0]
    assert seen["dry_at"] - 1e-9 <= first_fb <= seen["dry_at"] + DT + 1e-9
    assert res.reasons[down[0]] == "disconnected"
    # During the outage the robot holds still (hold fallback): zero velocity after braking.
    hold = res.actions[(times > first_fb + 0.5) & (times < outage[1])]
    assert np.ptp(hold, axis=0).max() < 1e-12
    # Back on the policy soon after the link returns: request, round trip, blend-in.
    back = next(t for t, m in zip(times, res.modes, strict=False) if t >= outage[1] and m is Mode.POLICY)
    assert back <= outage[1] + 0.1 + (b.config.resume_steps + 2) * DT
    assert b.stats.disconnects == 1
    assert b.watchdog.counts.by_reason == {"disconnected": 1}


def test_server_errors_back_off_and_report_server_error() -> None:
    b = make_broker(error_backoff_s=0.3)
    res = simulate(b, server(latency=lambda i, t: 0.05, fail={0, 1}), duration_s=2.0)
    assert b.stats.errors == 2
    first_two = np.flatnonzero(res.requests)[:3] * DT
    assert first_two[1] - first_two[0] >= 0.05 + 0.3 - 1e-9
    assert "server_error" in res.reasons
    assert res.modes[-1] is Mode.POLICY  # the third request succeeded


def test_retry_after_is_honoured() -> None:
    b = make_broker()
    intent = b.tick(0.0, {"s": 0}).request
    b.on_sent(intent.request_id, 0.0)
    b.on_error(0.01, request_id=intent.request_id, code="overloaded", retry_after_s=0.5)
    assert b.stats.last_error_code == "overloaded"
    assert b.tick(0.02, {"s": 0}).request is None
    assert b.tick(0.5, {"s": 0}).request is None
    assert b.tick(0.52, {"s": 0}).request is not None


def test_one_request_in_flight_and_newer_observations_supersede_unsent_ones() -> None:
    b = make_broker()
    r1 = b.tick(0.0, {"i": 1}).request
    r2 = b.tick(DT, {"i": 2}).request  # r1 was never reported sent
    assert r2.supersedes == r1.request_id and r2.observation == {"i": 2}
    assert b.stats.requests_superseded == 1
    b.on_sent(r2.request_id, 2 * DT)
    assert b.in_flight == r2.request_id and b.queued is None
    for i in range(3, 20):
        assert b.tick(i * DT, {"i": i}).request is None
    # A chunk answering an unsent, superseded request is still good data.
    assert b.on_chunk(chunk(2 * DT, r2.request_id), 0.4) is MergeOutcome.MERGED
    assert b.in_flight is None


def test_a_lost_request_times_out_and_a_new_one_goes() -> None:
    b = make_broker(request_timeout_s=0.5)
    r1 = b.tick(0.0, {"s": 0}).request
    b.on_sent(r1.request_id, 0.0)
    assert b.tick(0.5, {"s": 0}).request is None
    r2 = b.tick(0.52, {"s": 0}).request
    assert r2 is not None and b.stats.requests_timed_out == 1


def test_deadline_budget_is_the_time_until_the_timeline_runs_dry() -> None:
    b = make_broker(initial_latency_s=0.1, prefetch_margin_s=0.02)
    r = b.tick(0.0, {"s": 0}).request
    b.on_sent(r.request_id, 0.0)
    b.on_chunk(chunk(0.0, r.request_id, h=50), 0.1)  # 1 s of actions, 100 ms round trip
    t = 0.12
    while True:
        cmd = b.tick(t, {"s": 0})
        if cmd.request:
            break
        t += DT
    # Asked at the last tick from which the answer lands with the margin to spare:
    # remaining < p95 (0.1) + margin (0.02) + one period; remaining = 1.0 - t.
    assert 1.0 - t < 0.14 + 1e-9 and 1.0 - (t - DT) >= 0.14 - 1e-9
    assert cmd.request.deadline_ms == pytest.approx((1.0 - t) * 1000)
    # The prefix is what will run while the request is in flight, on the chunk's grid.
    p = cmd.request.prefix
    assert p.shape == (math.ceil(0.12 / DT - 1e-9), A)
    np.testing.assert_allclose(p[0], reference(t), atol=1e-6)
    np.testing.assert_allclose(p[1], reference(t + DT), atol=1e-6)


def test_prefix_matches_what_then_runs() -> None:
    b = make_broker(merge=MergeMode.REPLACE)
    captured = []

    def policy(obs, obs_time, prefix):
        if prefix is not None:
            captured.append((obs_time, prefix.copy()))
        return ReferencePolicy(reference, DT, 50, 0.02)(obs, obs_time, prefix)

    res = simulate(b, ScriptedServer(policy=policy, dt=DT, latency=lambda i, t: 0.1), duration_s=5.0)
    assert len(captured) >= 3
    for t0, prefix in captured:
        for j, row in enumerate(prefix):
            i = int(round((t0 + j * DT) / DT))
            np.testing.assert_allclose(res.actions[i], row, atol=1e-6)


def test_merge_modes_change_how_a_disagreeing_chunk_takes_over() -> None:
    jumps = {}
    for mode in MergeMode:
        b = Broker(
            BrokerConfig(control_period_s=DT, merge=mode, blend_weights=(0.2, 0.4, 0.6, 0.8), ensemble_decay=0.0),
            initial_position=np.zeros(A),
            limits=limits(),
        )
        r = b.tick(0.0, {"s": 0}).request
        b.on_sent(r.request_id, 0.0)
        b.on_chunk(chunk(0.0, r.request_id, value=0.0), 0.0)
        t = 0.0
        for _ in range(10):
            assert b.tick(t).action[0] == 0.0
            t += DT
        assert b.mode is Mode.POLICY
        b.on_chunk(chunk(t, 99, value=0.01), t)  # disagrees by 0.01 (within the rate limits)
        seq = [b.tick(t + j * DT).action[0] for j in range(6)]
        jumps[mode] = np.diff([0.0] + seq)
    # replace: the new action at once; blend: in steps of the weights; ensemble: the average.
    np.testing.assert_allclose(jumps[MergeMode.REPLACE], [0.01, 0, 0, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(jumps[MergeMode.BLEND], [0.002] * 5 + [0.0], atol=1e-7)
    np.testing.assert_allclose(jumps[MergeMode.ENSEMBLE], [0.005, 0, 0, 0, 0, 0], atol=1e-7)


def test_config_validation() -> None:
    for bad in (
        dict(control_period_s=0.0),
        dict(blend_weights=(0.5, 0.2)),
        dict(blend_weights=(1.5,)),
        dict(latency_quantile=0.0),
        dict(resume_steps=0),
        dict(max_age_s=-1.0),
        dict(idle_deadline_s=math.inf),
    ):
        with pytest.raises(BrokerConfigError):
            BrokerConfig(**bad)
    with pytest.raises(BrokerConfigError):
        Broker(BrokerConfig(control_period_s=0.01), initial_position=np.zeros(A), limits=limits())
    assert BrokerConfig(merge="blend").merge is MergeMode.BLEND


def test_reset_drops_the_plan_and_holds_at_the_new_position() -> None:
    b = make_broker()
    res = simulate(b, server(), duration_s=2.0)
    assert res.modes[-1] is Mode.POLICY
    b.reset(np.zeros(A))
    cmd = b.tick(2.0, {"s": 0})
    assert cmd.mode is Mode.FALLBACK and cmd.reason is FallbackReason.NO_CHUNK
    np.testing.assert_array_equal(cmd.action, np.zeros(A))


def test_without_limits_the_broker_still_refuses_nan_and_falls_back() -> None:
    b = Broker(BrokerConfig(control_period_s=DT, resume_steps=1), initial_position=np.zeros(A), limits=None)
    r = b.tick(0.0, {"s": 0}).request
    b.on_sent(r.request_id, 0.0)
    acts = np.ones((10, A), np.float32)
    acts[3] = np.nan
    b.on_chunk(ActionChunk(acts, 0.0, DT, 1.0, r.request_id), 0.0)
    out = [b.tick(k * DT, {"s": 0}) for k in range(5)]
    assert [c.mode for c in out] == [Mode.POLICY, Mode.POLICY, Mode.POLICY, Mode.FALLBACK, Mode.FALLBACK]
    assert out[3].reason is FallbackReason.REJECTED
    np.testing.assert_array_equal(out[3].action, np.ones(A))
    assert out[4].request is not None  # a fresh chunk is wanted at once


def test_reprs_are_short_and_never_dump_the_observation() -> None:
    b = make_broker()
    cmd = b.tick(0.0, {"image": np.zeros((224, 224, 3), np.uint8), "state": np.zeros(14)})
    assert cmd.request is not None
    assert len(repr(cmd)) < 400 and "request=#" in repr(cmd) and "0, 0, 0, 0" not in repr(cmd)
    assert len(repr(cmd.request)) < 200 and "observation=[image, state]" in repr(cmd.request)
    c = chunk(0.0, cmd.request.request_id)
    assert repr(c).startswith("ActionChunk(request_id=") and "[50x" in repr(c) and len(repr(c)) < 200


def test_an_out_of_reach_chunk_reads_unreachable_and_is_not_re_requested_every_tick() -> None:
    """Chunks arrive but their actions are far from the held command: the fallback says why
    (``unreachable``, counted in the stats), and the broker asks again only after the backoff."""
    b = make_broker(unreachable_backoff_s=0.25)
    t = 0.0
    requests = []
    reasons = set()
    while t < 1.0 - 1e-9:  # 50 ticks; every request answered at once with a far-away chunk
        cmd = b.tick(t, {"s": 0})
        reasons.add(cmd.reason)
        if cmd.request is not None:
            requests.append(t)
            b.on_sent(cmd.request.request_id, t)
            b.on_chunk(chunk(t, cmd.request.request_id, value=1.9), t)  # reference(0) is within 0.5 of 0
        t += DT
    assert b.mode is Mode.FALLBACK and FallbackReason.UNREACHABLE in reasons
    assert b.stats.chunks_unreachable == len(requests) and b.stats.unreachable_ticks > 0
    assert b.watchdog.counts.resume_refused > 0
    # One request per backoff, not one every tick or two.
    assert len(requests) <= 1 + math.ceil(1.0 / 0.25)
    assert all(later - earlier >= 0.25 - 1e-9 for earlier, later in zip(requests, requests[1:], strict=False))


def test_an_out_of_reach_answer_asked_long_ago_does_not_hold_the_next_request_back() -> None:
    """The backoff after an out-of-reach answer counts from the observation it was asked with: one
    that comes 0.8 s late (a stalled link) was asked from another state than the robot's now, and a
    request from now may bring a reachable one; one asked just now waits the backoff as before."""
    b = make_broker(unreachable_backoff_s=0.25)
    first = b.tick(0.0, {"s": 0}).request
    b.on_sent(first.request_id, 0.0)
    t = DT
    while t < 0.8 - 1e-9:
        assert b.tick(t, {"s": 0}).request is None  # no round trip measured yet: nothing else asked
        t += DT
    b.on_chunk(chunk(0.0, first.request_id, value=1.9), t)  # late, far away, still valid
    cmd = b.tick(t, {"s": 0})
    assert cmd.reason is FallbackReason.UNREACHABLE
    # Asked at 0.0: the backoff ran out at 0.25 s, so the request goes now, not at 1.05 s.
    assert cmd.request is not None
    b.on_sent(cmd.request.request_id, t)
    t += DT
    b.on_chunk(chunk(t, cmd.request.request_id, value=1.9), t)  # asked just now: the same answer
    asked = []
    for _ in range(20):
        cmd = b.tick(t, {"s": 0})
        if cmd.request is not None:
            asked.append(t)
            b.on_sent(cmd.request.request_id, t)
        t += DT
    assert asked and asked[0] >= 0.8 + 0.25 - 1e-9
