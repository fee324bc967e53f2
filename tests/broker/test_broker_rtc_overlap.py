"""rtc with several requests in flight, and hand-overs at high latency (issue 19, 300 ms): a chunk
whose prefix predates a newer merge takes over where its own planning starts; a velocity
mismatch alone never refuses a chunk; in the fallback no prefix is sent; rtc's cross-fades bound
the jump in acceleration too; a fade meets a plan that ends at a tick a hair before its end.
Injected clocks only."""

from __future__ import annotations

import numpy as np
import pytest
from test_broker_rtc_pacing import _commands as commands  # one tick-driving helper for both rtc test files

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.timeline import MergeOutcome
from chunkline.safety import Limits, Mode
from chunkline.safety.filter import Verdict

A, DT, H = 2, 0.02, 50


def limits() -> Limits:
    return Limits(lower=[-10.0] * A, upper=[10.0] * A, max_velocity=2.0, max_acceleration=20.0, dt=DT)


def reference(t: float) -> np.ndarray:
    return 0.3 * np.sin(2 * np.pi * 0.3 * t + np.arange(A))


def on_reference(t0: float, rid: int, *, offset: float = 0.0, horizon: int = H, frozen: int = 0,
                 after: float = 0.0) -> ActionChunk:
    """A chunk on the reference from ``t0``; rows from ``frozen`` on moved by ``after`` (a policy
    that kept its frozen rows and re-planned the rest from a newer observation), eased in over 10
    rows so the chunk itself never jumps."""
    k = np.arange(horizon)
    ease = np.clip((k - frozen + 1) / 10.0, 0.0, 1.0)[:, None] if frozen else np.ones((horizon, 1))
    acts = np.stack([reference(t0 + i * DT) + offset for i in k]) + ease * after
    return ActionChunk(acts.astype(np.float32), t0, DT, t0 + horizon * DT, rid)


def broker(merge: MergeMode = MergeMode.RTC, **kw: object) -> Broker:
    cfg = BrokerConfig(**{"control_period_s": DT, "merge": merge, "initial_latency_s": 0.1, **kw})  # type: ignore[arg-type]
    return Broker(cfg, initial_position=reference(0.0), limits=limits())


def running(b: Broker, until: float = 0.6) -> float:
    r = b.tick(0.0, {"s": 0}).request
    assert r is not None
    b.on_sent(r.request_id, 0.0)
    b.on_chunk(on_reference(0.0, r.request_id, horizon=4 * H), 0.0)
    t = 0.0
    while t < until:
        b.tick(t)
        t = round(t + DT, 9)
    assert b.mode is Mode.POLICY
    return t


def ask(b: Broker, t: float) -> tuple[int, int]:
    """Issue and send a request at ``t`` (the broker asked to): its id and frozen count."""
    b._ask_again = True
    cmd = b.tick(t, {"s": 1})
    assert cmd.request is not None and cmd.request.prefix_delay is not None
    b.on_sent(cmd.request.request_id, t)
    return cmd.request.request_id, cmd.request.prefix_delay


def test_a_chunk_whose_prefix_predates_a_newer_merge_takes_over_where_its_planning_starts() -> None:
    # Two requests overlap: B's prefix is the plan as it was before A's answer changed it. B's
    # frozen rows are that stale plan; the plan runs on A's rows through them and B takes over
    # at its frozen end, faded in from A's (they disagree there: A re-planned too).
    b = broker()
    t = running(b)
    for x in [0.2] * 20:
        b.latency.add(x)  # 11 frozen rows
    rid_a, frozen_a = ask(b, t)
    t_b = round(t + 2 * DT, 9)
    _, _, t = commands(b, round(t + DT, 9), 1)
    rid_b, frozen_b = ask(b, t_b)
    assert frozen_a == frozen_b == 11
    t = round(t_b + DT, 9)
    chunk_a = on_reference(t_b - 2 * DT, rid_a, frozen=frozen_a, after=0.02)
    assert b.on_chunk(chunk_a, t) is MergeOutcome.MERGED and b.stats.rtc_deferred == 0  # nothing landed since its prefix
    chunk_b = on_reference(t_b, rid_b, frozen=frozen_b, after=0.03)
    assert b.on_chunk(chunk_b, t + 1e-3) is MergeOutcome.MERGED
    assert b.stats.rtc_deferred == 1 and b.stats.rtc_late == 0
    # Before B's frozen end the plan is A's (the newer rows there), not B's copy of the old plan.
    end_b = t_b + frozen_b * DT
    for tau in np.arange(t + DT, end_b - 1e-9, DT):
        k = int(round((tau - chunk_a.t0) / DT))
        np.testing.assert_allclose(b.timeline.plan_at(tau + 1e-6), chunk_a.actions[k], atol=1e-6)
    cmds, verdicts, t_end = commands(b, round(t + DT, 9), 40)
    assert all(v is Verdict.PASSED for v in verdicts)
    k = int(round((t_end - DT - t_b) / DT))
    np.testing.assert_allclose(cmds[-1], chunk_b.actions[k], atol=1e-6)  # B took over in the end


def test_a_chunk_on_the_plan_since_its_prefix_is_taken_at_once() -> None:
    # The usual hand-over: nothing landed since the request took its prefix, so its frozen rows
    # are the plan's and it takes over at the next tick (the fast path, no fade, no deferral).
    b = broker()
    t = running(b)
    for x in [0.1] * 20:
        b.latency.add(x)  # 6 frozen rows
    rid, frozen = ask(b, t)
    chunk = on_reference(t, rid, frozen=frozen, after=0.01)
    b.on_chunk(chunk, round(t + 2 * DT, 9))
    assert b.stats.rtc_deferred == 0 and b.stats.chunks_faded == 0
    assert b.timeline.row_seq(b.timeline.lookup(round(t + 3 * DT, 9))) == b._seq


def test_an_answer_landing_just_as_its_frozen_rows_end_is_on_time() -> None:
    # Its first playable row is the first one it planned itself: nothing of its own plan was
    # missed, and its frozen rows are the plan's, so it takes over as it is (not as a late one,
    # faded in: at a steady 300 ms with 1 s chunks that was most hand-overs).
    b = broker()
    t = running(b)
    for x in [0.1] * 20:
        b.latency.add(x)
    rid, frozen = ask(b, t)
    chunk = on_reference(t, rid, frozen=frozen, after=0.004)
    commands(b, round(t + DT, 9), frozen - 1)  # the ticks up to row frozen - 1 run the plan
    b.on_chunk(chunk, round(t + (frozen - 1) * DT, 9) + 1e-3)  # the next tick plays row `frozen`
    assert b.stats.rtc_late == 0 and b.stats.chunks_faded == 0
    for k in range(frozen, frozen + 10):
        np.testing.assert_allclose(b.timeline.plan_at(t + k * DT + 1e-6), chunk.actions[k], atol=1e-7)


def test_a_velocity_mismatch_alone_never_refuses_a_chunk() -> None:
    # A late rtc answer at the plan's position but 0.3 rad/s faster: switching at once would pass
    # the filter, but rtc fades a disagreement in at a quarter of the budget, which for this
    # velocity mismatch takes 54 ticks, more than max_switch_steps (25). Only the position gap
    # makes a chunk too far: this one takes the longest fade, and the filter cuts nothing.
    b = broker()
    t = running(b)
    rid, _ = ask(b, t)
    _, _, t = commands(b, round(t + DT, 9), 12)  # past its frozen rows: late
    base = b.timeline.plan_at(t + 1e-6).copy()
    t0 = round(t - 12 * DT, 9)
    acts = np.stack([base + (reference(t0 + k * DT) - reference(t)) + 0.3 * (k - 12) * DT for k in range(H)])
    outcome = b.on_chunk(ActionChunk(acts.astype(np.float32), t0, DT, t0 + H * DT, rid), t - DT / 2)
    assert outcome is MergeOutcome.MERGED and b.stats.chunks_far == 0 and b.stats.chunks_faded == 1
    _, verdicts, _ = commands(b, t, 35)
    assert all(v is Verdict.PASSED for v in verdicts)


def test_a_far_position_gap_is_still_refused() -> None:
    b = broker(MergeMode.RTC)
    t = running(b)
    rid, _ = ask(b, t)
    assert b.on_chunk(on_reference(t, rid, offset=3.0), t + 1e-3) is MergeOutcome.FAR and b.stats.chunks_far == 1


def test_after_an_unreachable_chunk_the_next_request_carries_no_prefix() -> None:
    # A chunk whose action due now is out of reach of the held command is refused; a prefix of its
    # rows would ask the policy to continue them, and stay out of reach (at 300 ms one way, a first
    # answer 1.2 s late was refused and every answer after it continued it: a whole episode in
    # the fallback). In the fallback the request carries no prefix: the policy plans from the
    # observed state.
    b = broker(unreachable_backoff_s=0.0)
    r = b.tick(0.0, {"s": 0}).request
    assert r is not None and r.prefix is None
    b.on_sent(r.request_id, 0.0)
    b.on_chunk(on_reference(0.0, r.request_id, offset=2.5), 0.02)
    cmd = b.tick(0.02, {"s": 1})
    assert b.watchdog.reason is not None and b.watchdog.reason.value == "unreachable"
    if cmd.request is None:
        cmd = b.tick(0.04, {"s": 1})
    assert cmd.request is not None and cmd.request.prefix is None and cmd.request.prefix_delay is None


def test_an_rtc_fade_keeps_the_jump_in_acceleration_within_its_share() -> None:
    # A late answer 3 cm off the plan: rtc fades it in long enough that the command's acceleration
    # changes by at most a fifth of the limit from one tick to the next (plus the reference's own,
    # ~0.04 rad/s^2 per tick); replace's fade only keeps the acceleration itself within its budget
    # (7 ticks for 3 cm: 13 rad/s^2 from one tick to the next).
    jumps = {}
    for merge in (MergeMode.RTC, MergeMode.REPLACE):
        b = broker(merge)
        t = running(b)
        b._ask_again = True
        cmd = b.tick(t, {"s": 1})
        assert cmd.request is not None
        b.on_sent(cmd.request.request_id, t)
        before, _, t2 = commands(b, round(t + DT, 9), 15)  # past any frozen rows: late
        acts = np.stack([reference(t + k * DT) + 0.03 for k in range(H)]).astype(np.float32)
        assert b.on_chunk(ActionChunk(acts, t, DT, t + H * DT, cmd.request.request_id), t2 - DT / 2) is MergeOutcome.MERGED
        after, verdicts, _ = commands(b, t2, 30)  # the chunk's last row is due 35 ticks after t
        assert all(v is Verdict.PASSED for v in verdicts)
        cmds = np.concatenate([before, after])
        acc = np.diff(cmds, n=2, axis=0) / DT**2
        jumps[merge] = float(np.max(np.abs(np.diff(acc, axis=0))))
    assert jumps[MergeMode.RTC] <= 0.2 * 20.0 + 0.05, jumps
    assert jumps[MergeMode.REPLACE] > 2 * jumps[MergeMode.RTC], jumps


def test_a_tick_a_hair_before_the_plans_end_is_past_it() -> None:
    # Tick times are sums of float periods: 4.279999999999999 for a plan that runs until 4.28.
    # lookup() counts it as the (missing) next row, so the plan is not valid there; continued_at()
    # must then continue the plan, not answer "nothing" (a switch there skipped its fade).
    from chunkline.broker.timeline import Timeline

    tl = Timeline(A)
    t0 = 3.8200000000000003
    rows = np.stack([np.array([0.01 * k, -0.02 * k]) for k in range(23)]).astype(np.float32)
    tl.add(ActionChunk(rows, t0, DT, 4.28, 1), 1, now=t0)
    t = 4.279999999999999
    assert tl.valid_until == pytest.approx(4.28) and t < tl.valid_until
    assert tl.plan_at(t) is None
    np.testing.assert_allclose(tl.continued_at(t), rows[22] + (rows[22] - rows[21]), atol=1e-6)
    # and a fade from there continues the old plan rather than taking the new rows at once
    nxt = np.stack([np.array([0.23 + 0.005 + 0.01 * k, -0.46 - 0.02 * k]) for k in range(30)]).astype(np.float32)
    tl.add(ActionChunk(nxt, t, DT, None, 2), 2, now=t - 0.005, transition=8, tick=t)
    cmds = np.stack([rows[20], rows[21], rows[22]] + [tl.plan_at(t + k * DT + 1e-6) for k in range(10)])
    step = np.diff(cmds[:, 0])
    assert np.all(step > 0.0095) and np.all(step < 0.0112), step
