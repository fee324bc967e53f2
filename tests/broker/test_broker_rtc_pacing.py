"""rtc at high latency: continuous re-planning paced by the typical round trip, frozen rows from
that typical round trip (not the tail), late or disagreeing chunks cross-faded in, fades from the
old plan continued at its final velocity (``Timeline.continued_at``). Injected clocks only."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.exceptions import BrokerConfigError
from chunkline.broker.latency import LatencyWindow
from chunkline.broker.settings import RobotSettings
from chunkline.broker.sim import ScriptedServer, simulate
from chunkline.broker.timeline import Timeline
from chunkline.safety import Limits, Mode
from chunkline.safety.filter import Verdict

A, DT, H = 2, 0.02, 50


def limits() -> Limits:
    return Limits(lower=[-10.0] * A, upper=[10.0] * A, max_velocity=2.0, max_acceleration=20.0, dt=DT)


def reference(t: float) -> np.ndarray:
    return 0.3 * np.sin(2 * np.pi * 0.3 * t + np.arange(A))


def chunk_on_reference(t0: float, rid: int, *, offset: float = 0.0, horizon: int = H) -> ActionChunk:
    acts = np.stack([reference(t0 + k * DT) + offset for k in range(horizon)]).astype(np.float32)
    return ActionChunk(acts, t0, DT, t0 + horizon * DT, rid)


def rtc_broker(**kw: object) -> Broker:
    cfg = BrokerConfig(**{"control_period_s": DT, "merge": MergeMode.RTC, "initial_latency_s": 0.1, "refresh_queued": False, **kw})  # type: ignore[arg-type]
    return Broker(cfg, initial_position=reference(0.0), limits=limits())


def feed_round_trips(b: Broker, rtts: list[float]) -> None:
    """Round trips measured as if their chunks had come (the pace is updated when one does)."""
    for x in rtts:
        b.latency.add(x)
    b._update_pace()


def running(b: Broker, until: float = 0.6) -> float:
    """Start ``b`` on a long chunk on the reference (answered at once) and tick it past the resume."""
    r = b.tick(0.0, {"s": 0}).request
    assert r is not None
    b.on_sent(r.request_id, 0.0)
    b.on_chunk(chunk_on_reference(0.0, r.request_id, horizon=4 * H), 0.0)
    t = 0.0
    while t < until:
        b.tick(t)  # no observation: a wanted request is only reported, never issued
        t = round(t + DT, 9)
    assert b.mode is Mode.POLICY
    return t


# ------------------------------------------------------------------ the latency model and settings


def test_the_typical_round_trip_is_a_lower_quantile_than_the_tail_estimate() -> None:
    w = LatencyWindow(size=20, quantile=0.95, initial=0.1, spread_k=2.0, typical_quantile=0.75)
    assert w.typical == 0.1  # before any sample: the initial guess
    for x in [0.1] * 15 + [0.5] * 5:
        w.add(x)
    assert w.typical == 0.1  # 15 of 20 at or below 0.1: the nearest-rank p75
    assert w.estimate >= 0.5  # the tail is what the prefetch budgets for
    w.reset()
    assert w.typical == w.estimate == 0.1


def test_rtc_delay_quantile_is_validated_and_reaches_the_settings_file() -> None:
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(BrokerConfigError, match="rtc_delay_quantile"):
            BrokerConfig(rtc_delay_quantile=bad)
    cfg = RobotSettings.model_validate({"broker": {"merge": "rtc", "rtc_delay_quantile": 0.5}}).broker_config()
    assert cfg.rtc_delay_quantile == 0.5
    b = Broker(cfg, initial_position=[0.0] * A, limits=None, verify_fallback=False)
    assert b.latency.typical_quantile == 0.5


# ------------------------------------------------------------------ frozen rows and pacing


def test_frozen_rows_are_counted_from_the_typical_round_trip_not_the_tail() -> None:
    b = rtc_broker()
    t = running(b)
    feed_round_trips(b, [0.1] * 15 + [0.5] * 5)
    assert b.latency.estimate >= 0.5
    cmd = b.tick(t, {"s": 1})
    assert cmd.request is not None and cmd.request.prefix is not None
    # ceil((0.1 typical + 0.02 margin) / dt) = 6 rows, where the tail (0.5 s) would freeze 26
    assert cmd.request.prefix_delay == 6
    assert len(cmd.request.prefix) > 26  # the rest of the plan still goes, for the soft overlap


def test_rtc_asks_again_as_soon_as_a_chunk_arrives_replace_waits_for_the_plan_to_run_short() -> None:
    for merge, asks in ((MergeMode.RTC, True), (MergeMode.REPLACE, False)):
        b = Broker(BrokerConfig(control_period_s=DT, merge=merge), initial_position=reference(0.0), limits=limits())
        t = running(b)
        cmd = b.tick(t, {"s": 1})
        if not asks:
            assert cmd.request is None  # four seconds of plan left: nothing to ask
            continue
        assert cmd.request is not None
        b.on_sent(cmd.request.request_id, t)
        b.on_chunk(chunk_on_reference(t, cmd.request.request_id), t + 0.1)
        nxt = b.tick(round(t + 0.12, 9), {"s": 2})
        assert nxt.request is not None  # the answer is in: the next one goes at the next tick


def test_an_answer_not_in_by_half_a_typical_round_trip_is_overlapped() -> None:
    b = rtc_broker()
    t = running(b)
    feed_round_trips(b, [0.4] * 20)
    first = b.tick(t, {"s": 1}).request
    assert first is not None
    b.on_sent(first.request_id, t)
    sent = t
    times = []
    while t < sent + 0.5:
        t = round(t + DT, 9)
        cmd = b.tick(t, {"s": 2})
        if cmd.request is not None:
            times.append(t)
            b.on_sent(cmd.request.request_id, t)
    # No second request within half the first's typical round trip (0.4 s); then one per 0.2 s.
    assert times and math.isclose(times[0], sent + 0.2, abs_tol=1e-9)
    assert np.allclose(np.diff([sent, *times]), 0.2)
    assert len(b.in_flight_ids) == 1 + len(times) <= b.config.max_in_flight


def test_the_pace_shrinks_so_the_plan_stays_full_and_never_bursts() -> None:
    b = rtc_broker(max_in_flight=4)
    running(b)
    b._coverage = 1.0  # a chunk covers 1 s from its observation
    feed_round_trips(b, [0.3] * 20)
    assert math.isclose(b._cadence(1.0).rtc_pace, 0.15)  # half a typical round trip: the plan has room
    b.latency.reset()
    feed_round_trips(b, [0.6] * 18 + [1.2] * 2)
    # 1 s of coverage less the 1.2 s tail: spare nothing; never more often than a typical round
    # trip shared among the four requests in flight
    assert math.isclose(b._cadence(1.0).rtc_pace, 0.6 / 4)
    b.latency.reset()
    feed_round_trips(b, [0.001] * 20)
    assert math.isclose(b._cadence(1.0).rtc_pace, b.config.rtc_min_replan_s, abs_tol=1e-8)  # the execution horizon bounds it
    b = rtc_broker(max_in_flight=4, rtc_min_replan_s=0.0)
    feed_round_trips(b, [0.001] * 20)
    assert b._cadence(1.0).rtc_pace == DT  # never more than one request per tick


@pytest.mark.parametrize(("min_replan", "rtt"), [(0.0, 0.0), (0.1, 0.0), (0.1, 0.03), (0.16, 0.05), (0.06, 0.1)])
def test_rtc_re_plans_no_more_often_than_its_execution_horizon(min_replan: float, rtt: float) -> None:
    # Answers come after `rtt` (0: within the tick): the next request waits for the later of the
    # answer and min_replan after the last send, and goes at the first tick past both; an answer
    # still out after half its round trip is overlapped then, if min_replan has passed (the last
    # case: 0.06 s, where the answer would take 0.1).
    b = rtc_broker(rtc_min_replan_s=min_replan)
    t = running(b)
    feed_round_trips(b, [rtt] * 20)
    sends: list[float] = []
    pending: list[tuple[float, int, float]] = []
    for _ in range(100):
        for arrival, rid, obs in [p for p in pending if p[0] <= t]:
            pending.remove((arrival, rid, obs))
            b.on_chunk(chunk_on_reference(obs, rid), arrival)
        cmd = b.tick(t, {"s": 1})
        if cmd.request is not None:
            b.on_sent(cmd.request.request_id, t)
            sends.append(t)
            pending.append((round(t + rtt, 9), cmd.request.request_id, t))
        t = round(t + DT, 9)
    gaps = np.diff(sends)
    expected = max(DT, math.ceil(round(max(min_replan, min(rtt, max(rtt / 2, min_replan))) / DT, 9)) * DT)
    assert len(sends) > 5
    assert gaps.min() >= min_replan - 1e-9
    assert np.allclose(gaps, expected)  # and no later: one request per execution horizon


def test_a_plan_running_dry_asks_before_the_execution_horizon() -> None:
    # The execution horizon paces re-planning, never the prefetch: a plan that would run dry
    # before the next answer asks at once.
    b = rtc_broker(rtc_min_replan_s=10.0, initial_latency_s=0.05)
    r = b.tick(0.0, {"s": 0}).request
    assert r is not None
    b.on_sent(r.request_id, 0.0)
    b.on_chunk(chunk_on_reference(0.0, r.request_id, horizon=H), 0.05)  # a 50 ms round trip
    t, asked = 0.04, None
    while t < H * DT:
        t = round(t + DT, 9)
        cmd = b.tick(t, {"s": 1})
        if cmd.request is not None:
            asked = t
            break
    assert asked is not None
    # asked when less than the round trip + margin + a period was left, not after 10 s
    assert H * DT - asked <= 0.05 + b.config.prefetch_margin_s + 2 * DT + 1e-9
    assert H * DT - asked >= 0.05 + b.config.prefetch_margin_s


def test_rtc_min_replan_s_is_validated_and_reaches_the_settings_file() -> None:
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(BrokerConfigError, match="rtc_min_replan_s"):
            BrokerConfig(rtc_min_replan_s=bad)
    cfg = RobotSettings.model_validate({"broker": {"merge": "rtc", "rtc_min_replan_s": 0.2}}).broker_config()
    assert cfg.rtc_min_replan_s == 0.2


def test_requests_in_flight_never_exceed_the_bound_when_no_answer_comes() -> None:
    b = rtc_broker(max_in_flight=3, request_timeout_s=10.0)
    t = running(b)
    for _ in range(200):
        cmd = b.tick(t, {"s": 1})
        if cmd.request is not None:
            b.on_sent(cmd.request.request_id, t)
        assert len(b.in_flight_ids) <= 3
        t = round(t + DT, 9)
    assert len(b.in_flight_ids) == 3


def test_each_request_in_flight_times_out_at_its_own_deadline() -> None:
    # Time-outs are checked against the oldest flight only (one comparison per tick): each of
    # several overlapping requests must still leave at the first tick past its own deadline.
    b = rtc_broker(max_in_flight=3, request_timeout_s=0.5)
    t = running(b)
    feed_round_trips(b, [0.1] * 20)  # overlap every 0.1 s
    sent: dict[int, float] = {}
    for _ in range(80):
        cmd = b.tick(t, {"s": 1})
        assert set(b.in_flight_ids) == {rid for rid, at in sent.items() if not t - at > 0.5}
        if cmd.request is not None:
            b.on_sent(cmd.request.request_id, t)
            sent[cmd.request.request_id] = t
        t = round(t + DT, 9)
    assert b.stats.requests_timed_out >= 5


# ------------------------------------------------------------------ switches


def _ask(b: Broker, t: float) -> tuple[int, int]:
    cmd = b.tick(t, {"s": 1})
    assert cmd.request is not None and cmd.request.prefix_delay is not None
    b.on_sent(cmd.request.request_id, t)
    return cmd.request.request_id, cmd.request.prefix_delay


def _commands(b: Broker, t: float, n: int) -> tuple[np.ndarray, list[Verdict | None], float]:
    out, verdicts = [], []
    for _ in range(n):
        cmd = b.tick(t)
        out.append(np.array(cmd.action))
        verdicts.append(cmd.verdict)
        t = round(t + DT, 9)
    return np.stack(out), verdicts, t


def _accel_jump(cmds: np.ndarray) -> float:
    acc = np.diff(cmds, n=2, axis=0) / DT**2
    return float(np.max(np.abs(np.diff(acc, axis=0))))


def test_an_on_time_chunk_that_honours_its_prefix_is_taken_as_it_is() -> None:
    b = rtc_broker()
    t = running(b)
    feed_round_trips(b, [0.1] * 20)  # 6 frozen rows
    rid, frozen = _ask(b, t)
    # The policy re-planned 2 cm off the plan, but kept the frozen rows (it inpainted them).
    acts = np.stack([reference(t + k * DT) + (0.02 if k >= frozen else 0.0) for k in range(H)]).astype(np.float32)
    _commands(b, round(t + DT, 9), 2)
    b.on_chunk(ActionChunk(acts, t, DT, t + H * DT, rid), t + 0.05)
    assert b.stats.rtc_late == 0 and b.stats.chunks_faded == 0
    k = 3  # the chunk's rows play from the switch on
    np.testing.assert_allclose(b.timeline.plan_at(t + k * DT), acts[k], atol=1e-7)


def test_a_late_rtc_chunk_is_faded_in_where_replace_jumps() -> None:
    jumps = {}
    for merge in (MergeMode.RTC, MergeMode.REPLACE):
        b = Broker(BrokerConfig(refresh_queued=False, control_period_s=DT, merge=merge, initial_latency_s=0.1), initial_position=reference(0.0),
                   limits=limits())
        t = running(b)
        cmd = b.tick(t, {"s": 1})
        rid = cmd.request.request_id if cmd.request is not None else None
        if rid is None:  # replace does not ask with a full plan: send one by hand for the comparison
            b._ask_again = True
            cmd = b.tick(t, {"s": 1})
            assert cmd.request is not None
            rid = cmd.request.request_id
        b.on_sent(rid, t)
        before, _, t2 = _commands(b, round(t + DT, 9), 14)  # 0.28 s: past the 6 frozen rows
        # The policy's re-plan is 6 mrad off the plan past its frozen rows (a newer observation):
        # landing late, the switch meets that part.
        acts = np.stack([reference(t + k * DT) + 0.006 for k in range(H)]).astype(np.float32)
        b.on_chunk(ActionChunk(acts, t, DT, t + H * DT, rid), t2 - DT / 2)
        after, verdicts, _ = _commands(b, t2, 30)
        assert all(v is Verdict.PASSED for v in verdicts)
        jumps[merge] = _accel_jump(np.concatenate([before[-3:], after[:5]]))
        if merge is MergeMode.RTC:
            assert b.stats.rtc_late == 1 and b.stats.chunks_faded == 1
            np.testing.assert_allclose(after[-1], acts[int(round((t2 + 29 * DT - t) / DT))], atol=1e-6)  # taken over
    # 6 mrad in one tick is 15 rad/s^2 of acceleration, twice in a row: replace passes it on
    assert jumps[MergeMode.REPLACE] > 20.0 and jumps[MergeMode.RTC] < 0.2 * jumps[MergeMode.REPLACE]


def test_a_chunk_that_ignored_its_prefix_is_faded_in_even_on_time() -> None:
    b = rtc_broker()
    t = running(b)
    feed_round_trips(b, [0.1] * 20)
    rid, _ = _ask(b, t)
    _, _, t2 = _commands(b, round(t + DT, 9), 2)
    # 6 mrad off from the first row: a 15 rad/s^2 jump the filter would pass (replace takes it)
    b.on_chunk(chunk_on_reference(t, rid, offset=0.006), t + 0.05)
    assert b.stats.rtc_late == 0 and b.stats.chunks_faded == 1
    cmds, verdicts, _ = _commands(b, t2, 30)
    assert all(v is Verdict.PASSED for v in verdicts)
    assert np.max(np.abs(np.diff(cmds, n=2, axis=0))) / DT**2 < 0.25 * 20.0 + 1.0  # a gentle hand-over


# ------------------------------------------------------------------ the timeline


@pytest.mark.parametrize("lead", [0.0, 0.1 * DT])
def test_continued_at_runs_the_plan_on_at_its_final_velocity(lead: float) -> None:
    # With a lead the plan's end must still be continued from its last row (looked up without the
    # lead, which names the row after): None there let a far chunk in "at once" as nothing to fade from.
    tl = Timeline(A, lead_s=lead)
    assert tl.continued_at(0.0) is None  # nothing to continue
    acts = np.stack([np.array([0.1 * k, -0.2 * k]) for k in range(5)]).astype(np.float32)
    tl.add(ActionChunk(acts, 1.0, DT, None, 1), 1, now=1.0)
    np.testing.assert_allclose(tl.continued_at(1.0 + 2 * DT), acts[2])  # within: the plan itself
    end = tl.valid_until  # last row due at 1.08, held one dt
    np.testing.assert_allclose(tl.continued_at(end), acts[4] + (acts[4] - acts[3]), atol=1e-6)
    np.testing.assert_allclose(tl.continued_at(end + 2.5 * DT), acts[4] + 3 * (acts[4] - acts[3]), atol=1e-6)
    assert tl.continued_at(0.5) is None  # before the plan: not a continuation
    one = Timeline(A)
    one.add(ActionChunk(acts[:1] + 1.0, 0.0, DT, None, 1), 1, now=0.0)
    np.testing.assert_allclose(one.continued_at(1.0), acts[0] + 1.0)  # one row: no velocity to go on with


def test_a_fade_past_the_old_plans_end_continues_it_rather_than_holding_it() -> None:
    tl = Timeline(A)
    moving = np.stack([np.array([0.01 * k, 0.0]) for k in range(10)]).astype(np.float32)  # 0.5 rad/s
    tl.add(ActionChunk(moving, 0.0, DT, None, 1), 1, now=0.0)
    # The next chunk lands at row 8 going on at the same speed, 5 mrad off: faded over 6 rows,
    # 4 of them past the old plan's end.
    nxt = np.stack([np.array([0.005 + 0.01 * (8 + k), 0.0]) for k in range(20)]).astype(np.float32)
    tl.add(ActionChunk(nxt, 8 * DT, DT, None, 2), 2, now=8 * DT, transition=6, tick=8 * DT)
    rows = np.concatenate([moving[6:8, 0], np.stack([tl.plan_at(k * DT + 1e-6) for k in range(8, 18)])[:, 0]])
    step = np.diff(rows)
    assert np.all(step > 0.009) and np.all(step < 0.0115), step  # no stop where the old plan ended
    np.testing.assert_allclose(rows[-1], nxt[9, 0], atol=1e-7)


def test_the_fade_starts_without_an_acceleration_step() -> None:
    tl = Timeline(A)
    flat = np.zeros((40, A), dtype=np.float32)
    tl.add(ActionChunk(flat, 0.0, DT, None, 1), 1, now=0.0)
    tl.add(ActionChunk(flat + 0.1, 0.0, DT, None, 2), 2, now=0.0, transition=20, tick=0.0)
    rows = np.stack([tl.plan_at(k * DT + 1e-6) for k in range(25)])[:, 0]
    acc = np.diff(np.concatenate([[0.0, 0.0], rows]), n=2)
    # smootherstep: the first rows move as x^3 (a smoothstep's first acceleration would be 3x^2 w:
    # 0.1 * 3 / 21^2 = 6.8e-4 per tick squared; here 10 x^3 = 1.1e-4)
    assert abs(acc[0]) < 2e-4 and abs(acc[0]) < 0.2 * np.max(np.abs(acc))
    np.testing.assert_allclose(rows[20:], 0.1, atol=1e-7)


# ------------------------------------------------------------------ properties


def inpainting_policy(delays: dict[int, int], offsets: np.ndarray):
    """A policy that keeps its prefix's frozen rows and re-plans the rest onto the reference,
    each answer off by its own offset (a newer observation)."""
    count = [0]

    def policy(obs, obs_time, prefix):
        i = count[0]
        count[0] += 1
        d = delays.get(i, 0) if prefix is not None else 0
        ref = np.stack([reference(obs_time + k * DT) for k in range(H)])
        # From the last frozen row the plan moves from the prefix's offset to its own over 10
        # rows, as a policy that continues its prefix smoothly would (the chunk never jumps).
        start = prefix[d - 1] - ref[d - 1] if d else np.zeros(A)
        ramp = np.clip((np.arange(H) - d + 1) / 10.0, 0.0, 1.0)[:, None]
        acts = ref + (1.0 - ramp) * start + ramp * offsets[i % len(offsets)]
        if d:
            acts[:d] = prefix[:d]
        return acts.astype(np.float32)

    return policy


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rtt=st.floats(0.02, 0.6), spike=st.floats(0.0, 0.6), rate=st.floats(0.0, 0.3), seed=st.integers(0, 2**16))
# A start-up fallback of 2.7 s (every early chunk out of reach), then a hand-back whose chase of
# the plan outlasted the ramp: that chase read `policy`, its clamps counted as a switch's.
@example(rtt=0.3950423368852737, spike=0.6, rate=0.3, seed=23630)
def test_rtc_never_plays_a_stale_action_and_falls_back_when_nothing_is_valid(rtt, spike, rate, seed) -> None:
    rng = np.random.default_rng(seed)
    lat = rtt + rng.uniform(0, 0.2 * rtt, 2000) + np.where(rng.random(2000) < rate, spike, 0.0)
    offsets = rng.uniform(-0.004, 0.004, (64, 1))
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=DT, merge=MergeMode.RTC, initial_latency_s=rtt), initial_position=reference(0.0),
               limits=limits())
    delays: dict[int, int] = {}
    sent = [0]
    policy_run = [0]

    def on_tick(cmd) -> None:
        if cmd.request is not None:
            delays[sent[0]] = cmd.request.prefix_delay or 0
            sent[0] += 1
        k = b.timeline.lookup(cmd.time)
        if isinstance(k, int):
            assert cmd.action_age_s is None or cmd.action_age_s <= DT + 1e-9  # never stale
        else:
            assert cmd.mode is Mode.FALLBACK  # nothing valid due: the fallback, that same tick
        policy_run[0] = policy_run[0] + 1 if cmd.mode is Mode.POLICY else 0
        if policy_run[0] > 20:
            # Settled on the policy (a hand-back from the fallback is the resume's business):
            # no chunk switch, late or not, handed the filter a cut.
            assert cmd.verdict is Verdict.PASSED

    res = simulate(b, ScriptedServer(policy=inpainting_policy(delays, offsets), dt=DT, latency=lambda i, t: lat[i]),
                   duration_s=6.0, on_tick=on_tick)
    assert len(b.in_flight_ids) <= b.config.max_in_flight
    assert np.isfinite(res.actions).all()


def test_the_prefix_is_the_plans_rows_from_now_read_only_and_kept_across_merges() -> None:
    b = rtc_broker(rtc_min_replan_s=0.0)
    t = running(b)
    cmd = b.tick(t, {"s": 1})
    assert cmd.request is not None and cmd.request.prefix is not None
    prefix = cmd.request.prefix
    k = b.timeline.lookup(t)
    assert isinstance(k, int)
    plan = np.stack([b.timeline.row(j) for j in range(k, k + len(prefix))])
    assert prefix.dtype == np.float32 and np.array_equal(prefix, plan.astype(np.float32))
    assert len(prefix) == len(b.timeline) - k  # the whole rest of the plan
    assert not prefix.flags.writeable
    with pytest.raises(ValueError):
        prefix[0, 0] = 1.0
    kept = prefix.copy()
    b.on_sent(cmd.request.request_id, t)
    b.on_chunk(chunk_on_reference(t, cmd.request.request_id, offset=0.001), t + 0.06)
    assert np.array_equal(prefix, kept)  # a merge installs a new plan, never writes into the old


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rtt=st.floats(0.0, 0.3), jitter=st.floats(0.0, 0.1), horizon=st.floats(0.0, 0.3), seed=st.integers(0, 2**16))
def test_rtc_requests_are_never_closer_than_the_execution_horizon_while_the_plan_holds(rtt, jitter, horizon, seed) -> None:
    # Chunks valid for 2 s from their observation never run short at round trips up to 0.4 s, so
    # the prefetch never has to ask early: every gap between requests is at least the horizon,
    # and at most the horizon or the round trip rounded up to the next tick (nothing idles).
    rng = np.random.default_rng(seed)
    lat = rtt + rng.uniform(0.0, jitter, 1000)
    b = rtc_broker(rtc_min_replan_s=horizon, initial_latency_s=rtt)
    sends: list[float] = []

    def on_tick(cmd) -> None:
        if cmd.request is not None and cmd.mode is Mode.POLICY:
            sends.append(cmd.time)

    simulate(b, ScriptedServer(policy=lambda obs, t, prefix: np.stack([reference(t + k * DT) for k in range(100)]),
                               dt=DT, latency=lambda i, t: float(lat[i % lat.size])), duration_s=4.0, on_tick=on_tick)
    gaps = np.diff(sends)
    assert gaps.size > 5
    assert gaps.min() >= horizon - 1e-6
    assert gaps.max() <= max(horizon, rtt + jitter) + DT + 1e-6


# ------------------------------------------------------------------ the fallback waiting on a held-up link


@pytest.mark.parametrize("merge", [MergeMode.REPLACE, MergeMode.RTC])
def test_the_fallback_keeps_asking_while_the_requests_in_flight_are_held_up(merge: MergeMode) -> None:
    # A stalled link holds the request in flight; the 1 s plan runs dry and the fallback holds.
    # Round trips measured with a tail (p95 1.1 s) beyond the chunk's coverage: the overlap rule
    # for a running plan keeps one request at a time (rtc: a long execution horizon keeps it from
    # re-planning). The fallback must not wait on the held one: it asks again every typical round
    # trip (0.5 s) shared among max_in_flight (4), up to that bound; before, nothing went out
    # until the held answer came or timed out.
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=DT, merge=merge, max_in_flight=4, request_timeout_s=10.0,
                            rtc_min_replan_s=10.0), initial_position=reference(0.0), limits=limits())
    first = b.tick(0.0, {"s": 0}).request
    assert first is not None
    b.on_sent(first.request_id, 0.0)
    b.on_chunk(chunk_on_reference(0.0, first.request_id), 0.05)
    feed_round_trips(b, [0.5] * 15 + [1.1] * 5)
    t, sends = 0.06, []
    while t < 2.0:
        cmd = b.tick(t, {"s": 1})
        if cmd.request is not None:
            b.on_sent(cmd.request.request_id, t)
            sends.append((t, cmd.mode))
        assert len(b.in_flight_ids) <= 4
        t = round(t + DT, 9)
    in_fallback = [s for s, mode in sends if mode is Mode.FALLBACK]
    assert sends[0][1] is not Mode.FALLBACK  # the prefetch's own request, while the plan ran
    assert len(in_fallback) == 3  # then the fallback's, up to max_in_flight
    assert in_fallback[0] <= 1.0 + 2 * DT  # as soon as the plan ran dry
    assert np.diff(in_fallback).min() >= 0.125 - 1e-9


def test_the_fallback_does_not_burst_before_a_round_trip_is_measured() -> None:
    # At start-up nothing says how long an answer takes: a request repeated every few ticks would
    # carry the same observation and fill every slot. One goes, and the fallback waits for it.
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=DT, max_in_flight=4), initial_position=reference(0.0), limits=limits())
    t, sent = 0.0, 0
    while t < 0.5:
        cmd = b.tick(t, {"s": 0})
        if cmd.request is not None:
            b.on_sent(cmd.request.request_id, t)
            sent += 1
        t = round(t + DT, 9)
    assert sent == 1
