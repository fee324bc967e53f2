"""The timeline: due-time lookup, staleness, expiry, late chunks, merges, prefix."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chunkline.broker import ActionChunk, ChunkError, MergeMode, MergeOutcome, Timeline
from chunkline.safety import FallbackReason

DT = 0.02


def chunk(t0: float, h: int = 10, a: int = 2, base: float = 0.0, expires: float | None = None, dt: float = DT, rid: int = 1) -> ActionChunk:
    acts = base + np.arange(h, dtype=np.float32)[:, None] * np.ones((1, a), np.float32)
    return ActionChunk(acts, t0, dt, t0 + h * dt if expires is None else expires, rid)


def test_lookup_returns_the_latest_action_whose_time_has_come() -> None:
    tl = Timeline(2)
    assert tl.lookup(0.0) is FallbackReason.NO_CHUNK
    assert tl.add(chunk(1.0), 1, now=1.0) is MergeOutcome.MERGED
    assert tl.lookup(0.99) is FallbackReason.NO_CHUNK
    for k in range(10):
        assert tl.lookup(1.0 + k * DT) == k
        assert tl.lookup(1.0 + k * DT + 0.019) == k
    hit = tl.act(1.0 + 3 * DT + 0.005)
    assert hit.index == 3 and hit.seq == 1 and hit.action.tolist() == [3.0, 3.0]
    assert hit.age == pytest.approx(0.005)


def test_no_action_runs_late_beyond_the_tolerance_or_after_expiry() -> None:
    tl = Timeline(2)
    tl.add(chunk(0.0, h=10), 1, now=0.0)
    # The last action (due 0.18) holds for one dt, then the timeline is dry.
    assert tl.lookup(0.18 + 0.0199) == 9
    assert tl.lookup(0.2001) is FallbackReason.EXPIRED  # expires = t0 + H dt = 0.2
    tl2 = Timeline(2)
    tl2.add(chunk(0.0, h=10, expires=10.0), 1, now=0.0)
    assert tl2.lookup(0.2001) is FallbackReason.STALE
    tl3 = Timeline(2)
    tl3.add(chunk(0.0, h=10, expires=0.1), 1, now=0.0)
    assert tl3.lookup(0.1) == 5
    assert tl3.lookup(0.1001) is FallbackReason.EXPIRED


def test_a_tighter_tolerance_marks_the_tail_of_each_slot_stale() -> None:
    tl = Timeline(2, max_age_s=0.005)
    tl.add(chunk(0.0, expires=10.0), 1, now=0.0)
    assert tl.lookup(0.045) == 2
    assert tl.lookup(0.046) is FallbackReason.STALE
    assert tl.valid_until == pytest.approx(0.2)  # slot tails are not "running dry"


def test_lead_lets_an_action_start_slightly_early() -> None:
    tl = Timeline(2, lead_s=0.002)
    tl.add(chunk(0.0), 1, now=0.0)
    assert tl.lookup(0.0385) == 2
    assert tl.lookup(0.0375) == 1


def test_the_default_lead_runs_each_row_once_on_ticks_that_jitter_about_the_plans_grid() -> None:
    # A plan starts at the tick that observed; later ticks wake a little more or less late than
    # that one. Without a lead, one a hair less late takes the row before: a row twice, then one skipped.
    from chunkline.broker import BrokerConfig

    jitter = [0.0, -0.0015, 0.002, -0.0004, 0.001, -0.0018, 0.0, -0.001, 0.0015, -0.0005]
    for lead, in_order in ((BrokerConfig(control_period_s=DT).lead, True), (0.0, False)):
        tl = Timeline(2, lead_s=lead)
        tl.add(chunk(0.0, h=10, expires=10.0), 1, now=0.0)
        rows = [tl.lookup(k * DT + j) for k, j in enumerate(jitter)]
        assert (rows == list(range(10))) is in_order


def test_a_late_chunk_has_its_past_actions_discarded() -> None:
    tl = Timeline(2)
    # Observation at 1.0, reply arrives 90 ms later: actions 0..3 are already past.
    tl.add(chunk(1.0, h=10), 1, now=1.09)
    assert len(tl) == 6
    assert tl.lookup(1.09) == 0 and tl.row(0).tolist() == [4.0, 4.0]
    assert tl.due(0) == pytest.approx(1.08)
    assert tl.lookup(1.05) is FallbackReason.NO_CHUNK  # nothing before the arrival is kept
    assert tl.add(chunk(2.0, h=10, expires=9.0), 2, now=2.5) is MergeOutcome.LATE
    assert tl.add(chunk(3.0, h=10, expires=3.05), 3, now=3.06) is MergeOutcome.EXPIRED
    assert tl.add(chunk(0.5, h=10), 4, now=3.07) is MergeOutcome.OUT_OF_ORDER


def test_replace_takes_over_from_the_first_slot_not_yet_executed() -> None:
    tl = Timeline(2)
    tl.add(chunk(0.0, h=10, base=0.0), 1, now=0.0)
    tl.add(chunk(0.06, h=10, base=100.0), 2, now=0.07)
    k = tl.lookup(0.08)
    assert tl.row(k).tolist() == [101.0, 101.0] and tl.row_seq(k) == 2
    # Nothing from the old chunk survives after the hand-over.
    assert all(tl.row_seq(i) == 2 for i in range(len(tl)))


def test_a_chunk_starting_in_the_future_keeps_the_old_plan_until_its_t0() -> None:
    tl = Timeline(2)
    tl.add(chunk(0.0, h=10, base=0.0), 1, now=0.0)
    tl.add(chunk(0.1, h=10, base=100.0), 2, now=0.05)
    assert tl.row(tl.lookup(0.06)).tolist() == [3.0, 3.0]
    assert tl.row_seq(tl.lookup(0.06)) == 1
    assert tl.row(tl.lookup(0.1)).tolist() == [100.0, 100.0]
    # With no old plan, the time before t0 has no action.
    tl2 = Timeline(2)
    tl2.add(chunk(0.1, h=10), 1, now=0.05)
    assert tl2.lookup(0.06) is FallbackReason.NO_CHUNK
    assert tl2.lookup(0.1) == 0


def test_blend_mixes_over_the_window_then_the_new_chunk_rules() -> None:
    tl = Timeline(1, merge=MergeMode.BLEND, blend_weights=(0.25, 0.5, 0.75))
    tl.add(ActionChunk(np.zeros((20, 1), np.float32), 0.0, DT, 1.0, 1), 1, now=0.0)
    tl.add(ActionChunk(np.ones((20, 1), np.float32), 0.1, DT, 1.0, 2), 2, now=0.1)
    values = [tl.row(tl.lookup(0.1 + j * DT))[0] for j in range(5)]
    assert values == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    # Where the old plan has nothing, the new chunk runs alone.
    tl.add(ActionChunk(np.full((20, 1), 2.0, np.float32), 0.3, DT, 2.0, 3), 3, now=0.3)
    late = tl.lookup(0.3 + 15 * DT)
    assert tl.row(late)[0] == pytest.approx(2.0)


def test_blended_rows_respect_the_old_chunks_expiry() -> None:
    tl = Timeline(1, merge=MergeMode.BLEND, blend_weights=(0.5, 0.5, 0.5))
    tl.add(ActionChunk(np.zeros((20, 1), np.float32), 0.0, DT, 0.13, 1), 1, now=0.0)
    tl.add(ActionChunk(np.ones((20, 1), np.float32), 0.1, DT, 1.0, 2), 2, now=0.1)
    assert tl.row(tl.lookup(0.1))[0] == pytest.approx(0.5)
    assert tl.row(tl.lookup(0.12))[0] == pytest.approx(0.5)
    assert tl.row(tl.lookup(0.14))[0] == pytest.approx(1.0)  # old expired at 0.13: new alone


def test_ensemble_is_act_temporal_ensembling() -> None:
    m = 0.5
    tl = Timeline(1, merge=MergeMode.ENSEMBLE, ensemble_decay=m)
    values = [10.0, 20.0, 40.0]
    for i, v in enumerate(values):
        t0 = i * DT
        tl.add(ActionChunk(np.full((10, 1), v, np.float32), t0, DT, 1.0, i + 1), i + 1, now=t0)
    # The slot due at 2*DT was predicted by all three chunks (oldest first): weights exp(-m i).
    w = np.exp(-m * np.arange(3))
    expected = float((w * values).sum() / w.sum())
    assert tl.row(tl.lookup(2 * DT))[0] == pytest.approx(expected)
    # Slots only the newest predicted... do not exist here (all end together); the old weigh more.
    assert expected < np.mean(values)


def test_ensemble_with_zero_decay_is_the_plain_mean() -> None:
    tl = Timeline(1, merge=MergeMode.ENSEMBLE, ensemble_decay=0.0)
    tl.add(ActionChunk(np.full((10, 1), 1.0, np.float32), 0.0, DT, 1.0, 1), 1, now=0.0)
    tl.add(ActionChunk(np.full((10, 1), 3.0, np.float32), DT, DT, 1.0, 2), 2, now=DT)
    assert tl.row(tl.lookup(2 * DT))[0] == pytest.approx(2.0)
    assert tl.row(tl.lookup(10 * DT))[0] == pytest.approx(3.0)  # only the second reaches this far


def test_valid_until_and_prefix() -> None:
    tl = Timeline(2)
    assert tl.valid_until == -math.inf and tl.prefix(0.0, 0.1) is None
    tl.add(chunk(0.0, h=10), 1, now=0.0)
    assert tl.valid_until == pytest.approx(0.2)
    p = tl.prefix(0.041, 0.05)
    assert p.dtype == np.float32 and p[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert len(tl.prefix(0.17, 1.0)) == 2  # stops at the end of the plan
    tl2 = Timeline(2)
    tl2.add(chunk(0.0, h=10, expires=0.1), 1, now=0.0)
    assert tl2.valid_until == pytest.approx(0.1)


def test_chunk_validation() -> None:
    tl = Timeline(2)
    with pytest.raises(ChunkError):
        tl.add(chunk(0.0, a=3), 1, now=0.0)
    with pytest.raises(ChunkError):
        ActionChunk(np.zeros((3, 2)), None, DT, None)  # type: ignore[arg-type]
    with pytest.raises(ChunkError):
        ActionChunk(np.zeros((3, 2)), 0.0, 0.0, None)
    with pytest.raises(ChunkError):
        ActionChunk(np.zeros(3), 0.0, DT, None)
    with pytest.raises(ChunkError):
        ActionChunk(np.zeros((3, 2)), math.nan, DT, None)
    c = ActionChunk(np.zeros((3, 2), np.float64), 0.0, DT, None)
    assert c.actions.dtype == np.float32 and not c.actions.flags.writeable and c.expiry == math.inf


def test_chunk_from_reply() -> None:
    class Reply:
        id = 7
        actions = np.ones((4, 2), np.float32)
        t0 = 1.0
        dt = DT
        expires = 1.08
        model = "m"
        fingerprint = "sha256:x"
        timing = {"server_ms": 3.0}

    c = ActionChunk.from_reply(Reply(), received_at=1.05, request_id=3)
    assert c.request_id == 3 and c.model == "m" and c.timing == {"server_ms": 3.0} and c.received_at == 1.05
    assert ActionChunk.from_reply(Reply(), received_at=1.05).request_id == 7


@pytest.mark.parametrize("merge", [MergeMode.REPLACE, MergeMode.RTC])
def test_the_plain_hand_over_fast_path_builds_the_same_plan_as_the_general_merge(merge: MergeMode) -> None:
    # blend with no weights is replace through the general merge (old-plan sampling and all):
    # the fast path for a chunk that has started and takes over unfaded must agree with it.
    rng = np.random.default_rng(7)
    fast, general = Timeline(3, merge=merge), Timeline(3, merge=MergeMode.BLEND, blend_weights=())
    now = 0.0
    for seq in range(1, 200):
        now = round(now + rng.uniform(0.0, 0.12), 6)
        t0 = now - rng.uniform(-0.05, 0.15)  # mostly started (the fast path), now and then later
        h = int(rng.integers(1, 30))
        acts = rng.normal(size=(h, 3)).astype(np.float32)
        expiry = t0 + h * DT * rng.uniform(0.5, 1.2)
        c = ActionChunk(acts, t0, DT, expiry, seq)
        assert fast.add(c, seq, now) is general.add(c, seq, now)
        assert len(fast) == len(general) and fast.valid_until == general.valid_until
        for j in range(len(fast)):
            assert np.array_equal(fast.row(j), general.row(j)) and fast.row_seq(j) == general.row_seq(j)
        for tau in now + np.arange(-2, 40) * DT / 3:
            assert fast.lookup(tau) == general.lookup(tau)
            p, q = fast.prefix(tau, 0.3), general.prefix(tau, 0.3)
            assert (p is None and q is None) or np.array_equal(p, q)


@pytest.mark.parametrize("t0", [0.25, 23009.973, 23041.267, 1.0e6 + 0.3, 1.0e8 + 0.3])
@pytest.mark.parametrize("dt", [0.02, 0.05, 0.1])
def test_a_chunk_stays_valid_for_all_its_rows_whatever_the_robot_clocks_magnitude(t0: float, dt: float) -> None:
    # A robot's monotonic clock reads hours after boot: due times and their sums then differ by
    # more than an absolute 1e-12, which broke the plan into pieces (0.15 s left of a 0.5 s chunk).
    tl = Timeline(2)
    n = 10
    tl.add(ActionChunk(np.outer(np.arange(1, n + 1) * 0.01, np.ones(2)), t0, dt, t0 + n * dt), 1, t0)
    assert tl.valid_until - t0 == pytest.approx(n * dt, abs=1e-6)


@pytest.mark.parametrize("clock", [0.25, 23009.973])
@pytest.mark.parametrize(("old_end", "take_from", "land", "tick"),
                         [(0.0995, 2, 0.083, 0.1003), (0.1008, 3, 0.1238, 0.1502), (0.1, 2, 0.083, 0.1003)])
def test_rows_a_chunk_takes_over_later_keep_the_plan_valid_until_its_own_rows_start(clock: float, old_end: float,
                                                                                    take_from: int, land: float,
                                                                                    tick: float) -> None:
    # rtc after a resumed chunk: the plan's grid lies a tick's jitter off the new chunk's (its t0 is
    # the observation's tick), and the plan ends within the slot of the last row the chunk froze.
    # The chunk was planned with those rows frozen: it stands for them to the end of their slots,
    # so its own rows carry the plan on and it runs dry at the chunk's end, not where the old plan did.
    dt, n = 0.05, 7
    tl = Timeline(2, merge=MergeMode.RTC)
    old_t0 = clock + old_end - 6 * dt
    tl.add(ActionChunk(np.outer(np.arange(6) * 0.01, np.ones(2)), old_t0, dt, old_t0 + 6 * dt), 1, old_t0)
    assert tl.valid_until == pytest.approx(clock + old_end, abs=1e-9)
    acts = np.outer(np.arange(n) * 0.01, np.ones(2))
    new = ActionChunk(acts, clock, dt, clock + n * dt)
    assert tl.add(new, 2, clock + land, tick=clock + tick, take_from=take_from) is MergeOutcome.MERGED
    assert tl.valid_until == pytest.approx(clock + n * dt, abs=1e-9)
    for j in range(take_from, n):  # every tick from the next on plays the chunk's own rows
        hit = tl.act(clock + tick + (j - take_from) * dt)
        assert not isinstance(hit, FallbackReason) and hit.seq == 2
        np.testing.assert_allclose(hit.action, acts[j], atol=1e-6)
    p = tl.prefix(clock + tick, 1.0)
    assert p is not None and len(p) == n - take_from


@pytest.mark.parametrize("merge", [MergeMode.RTC, MergeMode.REPLACE, MergeMode.BLEND, MergeMode.ENSEMBLE])
@pytest.mark.parametrize("old_end", [0.0995, 0.1, 0.1005])
@pytest.mark.parametrize("fade", [0, 3])
def test_a_chunk_mixed_with_a_plan_off_its_grid_runs_to_its_end(merge: MergeMode, old_end: float, fade: int) -> None:
    # The old plan ends within a slot of the new chunk's grid (a tick's jitter off it) where the
    # two mix (a blend, an ensemble, a cross-fade): the mixed row stands to its slot's end, and
    # the plan runs dry at the chunk's end, not where the old plan did.
    dt, n, clock = 0.05, 7, 23009.973
    tl = Timeline(2, merge=merge)
    old_t0 = clock + old_end - 6 * dt
    tl.add(ActionChunk(np.outer(np.arange(6) * 0.01, np.ones(2)), old_t0, dt, old_t0 + 6 * dt), 1, old_t0)
    new = ActionChunk(np.outer(np.arange(n) * 0.01, np.ones(2)), clock, dt, clock + n * dt)
    assert tl.add(new, 2, clock + 0.03, transition=fade, tick=clock + 0.0503) is MergeOutcome.MERGED
    assert tl.valid_until == pytest.approx(clock + n * dt, abs=1e-9)
    for j in range(1, n):
        assert not isinstance(tl.lookup(clock + j * dt + 0.0003), FallbackReason)
