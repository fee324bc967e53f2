"""How far ahead a paced request goes: the configured rows at most, fewer where that makes
requests go out every two round trips (the chunk's length and the measured round trip say)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, BrokerConfigError
from chunkline.broker.latency import LatencyWindow
from chunkline.broker.pacing import paced_ahead_s

A = 2
STEP = 0.01


#: a fleet that starts together: its first answers queued behind all of it
STARTUP = (1.0, 1.0, 1.0, 1.0)


def _window(*round_trips: float, startup: tuple[float, ...] = STARTUP) -> LatencyWindow:
    w = LatencyWindow()
    for r in (*startup, *round_trips):
        w.add(r)
    return w


def test_the_lead_waits_for_a_few_round_trips_and_never_exceeds_the_configured_rows() -> None:
    assert paced_ahead_s(2, None, _window(startup=()), 0.05) == pytest.approx(0.1)
    assert paced_ahead_s(2, 0.35, _window(startup=(0.5, 0.2, 0.2, 0.2)), 0.05) == pytest.approx(0.1)
    assert paced_ahead_s(2, 0.35, _window(0.5, 0.2, 0.2), 0.05) == pytest.approx(0.1)
    assert paced_ahead_s(2, 0.35, _window(0.5, 0.2, 0.2, 0.2), 0.05) == pytest.approx(0.05)
    # A long chunk on a fast server: two round trips would ask further ahead; the configured rows cap it.
    assert paced_ahead_s(2, 0.55, _window(0.1, 0.1, 0.1, 0.1), 0.05) == pytest.approx(0.1)
    assert paced_ahead_s(0, 0.35, _window(0.2, 0.2, 0.2, 0.2), 0.05) == 0.0  # ask once dry


def test_the_first_round_trips_do_not_set_the_lead_for_the_rest_of_the_window() -> None:
    # Served at once after a start-up that queued behind the fleet: the lead follows the round
    # trips after it (counted in the median, the start-up's would cut it to one row for good).
    w = _window(0.09, 0.09, 0.09, 0.09, 0.12, startup=(0.3, 0.3, 0.3, 0.3))
    assert paced_ahead_s(2, 0.3, w, 0.05) == pytest.approx(0.1)
    assert math.ceil(w.median / 0.05) == 3  # the whole window's median: (6 - 3) // 2 = one row
    # Once the window has dropped them, every round trip it holds counts.
    full = _window(*[0.12] * 50, startup=(0.09,) * 4)
    assert full.median_after(4) == pytest.approx(0.12) and paced_ahead_s(2, 0.3, full, 0.05) == pytest.approx(0.05)


def test_a_chunk_that_barely_outlasts_the_round_trip_is_asked_for_at_its_last_row() -> None:
    busy = _window(0.2, 0.19, 0.21, 0.2, 0.2)  # the median answer lands 4 ticks after its observation
    assert paced_ahead_s(2, 0.35, busy, 0.05) == pytest.approx(0.05)  # 7 rows: 1
    assert paced_ahead_s(2, 0.55, busy, 0.05) == pytest.approx(0.1)  # 11 rows: 2
    # Served at once (a weighted robot alone in its batch): asked ahead.
    assert paced_ahead_s(2, 0.35, _window(0.09, 0.09, 0.08, 0.09), 0.05) == pytest.approx(0.1)
    # Queued long (the others of a weighted fleet): at its last row.
    assert paced_ahead_s(2, 0.55, _window(0.38, 0.38, 0.39, 0.38), 0.05) == pytest.approx(0.05)
    # Never less than one row, whatever the round trip.
    assert paced_ahead_s(2, 0.35, _window(2.0, 2.0, 2.0, 2.0), 0.05) == pytest.approx(0.05)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 60), ticks=st.integers(1, 60), most=st.integers(1, 8),
       period=st.sampled_from([0.01, 0.02, 0.05]))
def test_requests_go_out_every_two_round_trips_unless_that_asks_beyond_the_configured_rows(
        rows: int, ticks: int, most: int, period: float) -> None:
    # A round trip a bit under `ticks` periods lands on that tick.
    k = round(paced_ahead_s(most, rows * period, _window(*[(ticks - 0.3) * period] * 5), period) / period)
    assert 1 <= k <= most
    cycle = rows + ticks - 2 * k  # hold ticks - k, then rows - k rows, then the next request
    if k < most:  # two round trips, or as near as one row at least allows
        assert cycle <= 2 * ticks + 1 and (k == 1 or cycle >= 2 * ticks)
    elif rows - ticks >= 2 * most:  # two round trips would ask further ahead than the configured rows
        assert cycle >= 2 * ticks


def test_a_negative_lead_is_refused() -> None:
    with pytest.raises(BrokerConfigError):
        BrokerConfig(paced_lead_rows=-1)


def _answer(req, rows: int, period: float) -> ActionChunk:
    """An answer reproducing the request's frozen prefix, then a ramp from its last row."""
    d = req.prefix_delay or 0
    start = np.zeros(A) if not d else np.asarray(req.prefix[d - 1], dtype=np.float64)
    out = start[None, :] + STEP * np.arange(1, rows - d + 1)[:, None]
    if d:
        out = np.concatenate([np.asarray(req.prefix[:d], dtype=np.float64), out])
    return ActionChunk(out, req.obs_time, period, req.obs_time + rows * period, request_id=req.request_id,
                       timing={"queue_ms": 120.0, "infer_ms": 110.0, "batch_size": 3.0})


@pytest.mark.parametrize(("rows", "expected"), [(11, 2), (7, 1)])
def test_a_saturated_broker_freezes_the_rows_its_round_trip_calls_for(rows: int, expected: int) -> None:
    period, rtt_ticks = 0.05, 5  # a chunk shorter than two round trips: never prefetched
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=period, resume_steps=1), initial_position=np.zeros(A), limits=None,
               verify_fallback=False)
    t, pending, leads = 0.0, None, []
    for k in range(400):
        t = round(k * period, 9)
        if pending is not None and t >= pending[1]:
            b.on_chunk(_answer(pending[0], rows, period), round(pending[1] - 0.3 * period, 9))
            pending = None
        req = b.tick(t, {"s": k}).request
        if req is not None:
            b.on_sent(req.request_id, t)
            leads.append(req.prefix_delay or 0)
            pending = (req, round(t + rtt_ticks * period, 9))
    # Answers land 4.7 ticks after their observation: the first (from the start-up hold) and the
    # next few at the first lead; from the fourth round trip measured after the first four (left
    # out: a start-up's) the lead follows it.
    assert len(leads) > 14 and leads[1] == 2 and leads[6] == 2
    assert set(leads[10:]) == {expected}
    assert math.isclose(b.latency.median, (rtt_ticks - 0.3) * period)
