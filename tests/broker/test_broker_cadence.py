"""The in-flight window and the request cadence from the latency model (``broker/cadence.py``):
the configured window wherever a chunk outlasts the tail round trip, a wider one where that round
trip nears the chunk's coverage. Pure functions and injected clocks only."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.cadence import plan_cadence
from chunkline.broker.exceptions import BrokerConfigError
from chunkline.broker.settings import RobotSettings
from chunkline.safety import Limits, Mode

A, DT, H = 2, 0.02, 50
LEAD = 0.02 + DT  # the default prefetch margin plus a period


def limits() -> Limits:
    return Limits(lower=[-10.0] * A, upper=[10.0] * A, max_velocity=2.0, max_acceleration=20.0, dt=DT)


def reference(t: float) -> np.ndarray:
    return 0.3 * np.sin(2 * np.pi * 0.3 * t + np.arange(A))


def chunk_on_reference(t0: float, rid: int, horizon: int) -> ActionChunk:
    acts = np.stack([reference(t0 + k * DT) for k in range(horizon)]).astype(np.float32)
    return ActionChunk(acts, t0, DT, t0 + horizon * DT, rid)


def cadence(**kw: float | int | None):  # type: ignore[no-untyped-def]
    args = {"typical": 0.64, "expected": 1.01, "coverage": 1.0, "lead": LEAD, "period": DT, "min_replan": 0.1,
            "window": 4, "max_window": 8, **kw}
    return plan_cadence(**args)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the pure rule


def test_a_chunk_that_outlasts_the_tail_round_trip_keeps_the_configured_window_and_paces() -> None:
    # 200 ms one way with 2 s chunks: 0.45 s typical, 0.75 s tail; 2 s of coverage leaves 1.2 s.
    c = cadence(typical=0.45, expected=0.75, coverage=2.0)
    assert c.window == 4 and not c.stretched
    assert math.isclose(c.rtc_pace, 0.225)  # half a typical round trip, as before
    assert math.isclose(c.dry_pace, 0.45 / 4)  # a typical round trip shared among four
    # Before any chunk has come nothing is known of its coverage: the configured window.
    assert cadence(coverage=None).window == 4


def test_a_tail_round_trip_beyond_the_chunks_coverage_widens_the_window() -> None:
    # 300 ms one way with 1 s chunks: the tail round trip (1.01 s) outlasts the chunk. At the
    # execution horizon (0.1 s) it holds 11 requests: the window grows to them, up to max_window.
    c = cadence()
    assert c.window == 8 and c.stretched
    assert math.isclose(c.rtc_pace, 0.1)  # the execution horizon, no longer 0.64 / 4
    assert math.isclose(c.dry_pace, 0.64 / 8)
    wide = cadence(max_window=16)
    assert wide.window == 11 and math.isclose(wide.dry_pace, 0.64 / 11)
    fixed = cadence(max_window=4)  # max_in_flight = in_flight_window: a fixed window, as before
    assert fixed.window == 4 and math.isclose(fixed.rtc_pace, 0.16) and math.isclose(fixed.dry_pace, 0.16)


def test_a_plan_with_little_room_widens_only_as_far_as_the_round_trip_holds_requests() -> None:
    # 200 ms one way with 1 s chunks: 0.2 s spare at the tail, a little under half a typical
    # round trip; 0.75 s holds four requests at that pace: the window stays four.
    c = cadence(typical=0.46, expected=0.75, coverage=1.0)
    assert c.window == 4 and math.isclose(c.rtc_pace, 1.0 - 0.75 - LEAD)


@given(typical=st.floats(0.0, 2.0), extra=st.floats(0.0, 2.0), coverage=st.none() | st.floats(0.0, 4.0),
       min_replan=st.floats(0.0, 0.3), window=st.integers(1, 8), max_window=st.integers(1, 32), more=st.floats(0.0, 1.0))
def test_the_cadence_keeps_its_bounds(typical: float, extra: float, coverage: float | None, min_replan: float,
                                      window: int, max_window: int, more: float) -> None:
    expected = typical + extra
    c = cadence(typical=typical, expected=expected, coverage=coverage, min_replan=min_replan, window=window,
                max_window=max_window)
    base = min(window, max_window)
    assert base <= c.window <= max(base, max_window)
    assert c.stretched == (c.window > base)
    # never more than one request per tick, never sooner than the execution horizon, never a burst
    assert c.rtc_pace >= max(DT, min_replan) and c.dry_pace >= DT
    assert c.rtc_pace >= typical / c.window - 1e-12 and c.dry_pace >= typical / c.window - 1e-12
    spare = 0.5 * typical if coverage is None else coverage - expected - LEAD
    if spare >= 0.5 * typical:
        assert c.window == base  # the chunk outlasts the tail round trip: nothing changes
    if c.stretched and c.window < max_window:
        # the tail round trip never fills the window at the pace the plan needs
        assert c.window * max(min(0.5 * typical, spare), DT, min_replan) >= expected - 1e-9
    # a longer tail never narrows the window
    assert cadence(typical=typical, expected=expected + more, coverage=coverage, min_replan=min_replan, window=window,
                   max_window=max_window).window >= c.window


def test_in_flight_window_is_validated_and_reaches_the_settings_file() -> None:
    with pytest.raises(BrokerConfigError, match="in_flight_window"):
        BrokerConfig(in_flight_window=0)
    cfg = RobotSettings.model_validate({"broker": {"in_flight_window": 3, "max_in_flight": 12}}).broker_config()
    assert cfg.in_flight_window == 3 and cfg.max_in_flight == 12
    assert BrokerConfig().in_flight_window == 4 and BrokerConfig().max_in_flight == 8


# ------------------------------------------------------------------ the broker


def _held_up(coverage_rows: int, rtts: list[float], **kw: object) -> tuple[Broker, list[float]]:
    """An rtc broker whose plan runs on a chunk of ``coverage_rows`` rows refreshed by hand, with
    ``rtts`` measured; then 1.2 s of ticks in which no answer comes (a stalled link)."""
    b = Broker(BrokerConfig(control_period_s=DT, merge=MergeMode.RTC, request_timeout_s=10.0, **kw),  # type: ignore[arg-type]
               initial_position=reference(0.0), limits=limits())
    r = b.tick(0.0, {"s": 0}).request
    assert r is not None
    b.on_sent(r.request_id, 0.0)
    for x in rtts:  # the round trips measured before this chunk (its own is in the window too)
        b.latency.add(x)
    b.on_chunk(chunk_on_reference(0.0, r.request_id, coverage_rows), rtts[-1] if rtts else 0.0)
    t = round(math.ceil(b.latency.last / DT) * DT, 9) if b.latency.last is not None else 0.0
    # keep the plan running: the test is about the requests, not about an empty plan
    b.timeline.add(chunk_on_reference(0.0, 10_000, 400), 10_000, t)
    sends = []
    end = t + 1.2
    while t < end:
        cmd = b.tick(t, {"s": 1})
        assert cmd.mode is not Mode.FALLBACK
        if cmd.request is not None:
            b.on_sent(cmd.request.request_id, t)
            sends.append(t)
        assert len(b.in_flight_ids) <= b.in_flight_window <= b.config.max_in_flight
        t = round(t + DT, 9)
    return b, sends


def test_a_stalled_link_holds_more_requests_where_the_tail_round_trip_outlasts_the_chunk() -> None:
    # 300 ms one way with 1 s chunks (p75 0.64 s, a 1.2 s tail): with four slots, four held-up
    # requests kept every fresh observation back until the stall cleared, and the plan ran dry a
    # round trip later. The window now holds what the tail round trip does at the execution
    # horizon: eight requests, one per 0.1 s.
    rtts = [0.6] * 12 + [0.64] * 5 + [1.2] * 3
    b, sends = _held_up(H, rtts)
    assert b.in_flight_window == 8
    assert len(b.in_flight_ids) == 8 and len(sends) == 8
    assert np.diff(sends).min() >= 0.1 - 1e-9
    # The same latency with 2 s chunks, which outlast the tail: four, at half a typical round trip.
    b, sends = _held_up(2 * H, rtts)
    assert b.in_flight_window == 4 and len(b.in_flight_ids) == 4
    assert np.diff(sends).min() >= 0.32 - 1e-9
    # A fixed window (max_in_flight = in_flight_window) keeps the old behaviour.
    b, sends = _held_up(H, rtts, max_in_flight=4)
    assert b.in_flight_window == 4 and len(b.in_flight_ids) == 4
    assert np.diff(sends).min() >= 0.16 - 1e-9


def test_the_broker_keeps_its_attributes_within_cpythons_shared_key_layout() -> None:
    # CPython 3.11 keeps an instance's attributes in the shared-key layout that specialised
    # attribute reads use only up to 30 of them; a 31st (the window, first kept on its own) made
    # every tick 10-15 % slower in `chunkline bench broker` (p50 25.4 -> 27.9 us, same session).
    b = Broker(BrokerConfig(control_period_s=DT, merge=MergeMode.RTC), initial_position=[0.0] * A, limits=limits())
    assert len(vars(b)) <= 30
