"""Step summaries: percentiles, goodput under each request's deadline, and counts that add up."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.bench.records import ADMISSION_REFUSALS, OK, RequestRecord, goodput, is_good, summarize
from chunkline.bench.stats import percentiles


def ok(latency_ms: float, deadline_ms: float | None = 100.0, *, late: bool = False, batch: float = 1.0,
       scheduled: float = 0.0, lag_ms: float = 0.0) -> RequestRecord:
    return RequestRecord(scheduled=scheduled, sent=scheduled + lag_ms / 1000, robot=0, outcome=OK,
                         latency_s=latency_ms / 1000, deadline_ms=deadline_ms, late=late,
                         server={"batch_size": batch})


def refused(code: str = "overloaded", answer_ms: float = 2.0, lag_ms: float = 0.0) -> RequestRecord:
    return RequestRecord(scheduled=0.0, sent=lag_ms / 1000, robot=0, outcome=code, latency_s=(lag_ms + answer_ms) / 1000,
                         deadline_ms=100.0)


def test_percentiles_interpolate_linearly() -> None:
    p = percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_good_means_a_chunk_in_time_and_not_late() -> None:
    assert is_good(ok(99.9))
    assert is_good(ok(100.0))
    assert not is_good(ok(100.1))
    assert not is_good(ok(10.0, late=True))
    assert is_good(ok(5000.0, deadline_ms=None))
    assert not is_good(refused())
    assert not is_good(RequestRecord(scheduled=0, sent=0, robot=0, outcome=OK))  # no latency measured


def test_goodput_counts_in_deadline_chunks_per_second() -> None:
    records = [ok(10)] * 30 + [ok(150)] * 10 + [refused()] * 10
    assert goodput(records, 2.0) == pytest.approx(15.0)
    with pytest.raises(ValueError):
        goodput(records, 0.0)


def test_summary_of_a_mixed_step() -> None:
    records = (
        [ok(10.0 + i, batch=4.0, lag_ms=1.0) for i in range(90)]  # 10..99 ms: good
        + [ok(120.0, batch=2.0)] * 5  # too slow
        + [ok(20.0, late=True)] * 1  # the server said late
        + [refused("overloaded", answer_ms=1.0)] * 3
        + [refused("deadline_unmeetable", answer_ms=3.0)]
        + [RequestRecord(scheduled=0, sent=0.0, robot=0, outcome="deadline_exceeded", latency_s=0.1)] * 2
        + [RequestRecord(scheduled=0, sent=0.0, robot=0, outcome="timeout")]
        + [RequestRecord(scheduled=0, sent=math.nan, robot=0, outcome="unsupported", cls="text")]
    )
    s = summarize(records, duration=4.0, label="A", rate=26.0, server_cpu_percent=55.0, server_rss_mb=300.0)
    assert s.offered == 104
    assert s.sent == 103
    assert s.refused == {"deadline_unmeetable": 1, "overloaded": 3}
    assert s.errors == {"deadline_exceeded": 2, "timeout": 1, "unsupported": 1}
    assert s.admitted == 103 - 4
    assert s.completed == 96
    assert s.good == 90
    assert s.late == 1
    assert s.goodput == pytest.approx(90 / 4.0)
    assert s.goodput_ratio == pytest.approx(90 / 104)
    assert s.offered_rate == pytest.approx(26.0)
    assert s.mean_batch_size == pytest.approx((90 * 4 + 5 * 2 + 1) / 96)
    assert s.latency["p50"] == pytest.approx(percentiles([r.latency_s for r in records if r.outcome == OK])["p50"])
    # Refusal latency is counted from the actual send: 1 ms three times, 3 ms once.
    assert s.refusal_latency["p50"] == pytest.approx(0.001)
    assert s.refusal_latency["p99"] == pytest.approx(percentiles([0.001] * 3 + [0.003])["p99"])
    assert s.server_cpu_percent == 55.0 and s.server_rss_mb == 300.0
    assert s.as_dict()["refused"] == s.refused


def test_summary_without_batch_sizes_reports_nan() -> None:
    r = ok(5.0)
    r.server = {}
    assert math.isnan(summarize([r], duration=1.0).mean_batch_size)


def test_record_round_trips_through_a_dict() -> None:
    r = ok(12.0, late=True)
    r.client = {"encode_ms": 0.1}
    assert RequestRecord.from_dict(r.as_dict()) == r
    d = r.as_dict() | {"latency_s": None, "label": "A"}  # JSON writes NaN as null; extra keys are ignored
    assert math.isnan(RequestRecord.from_dict(d).latency_s)


_outcomes = st.sampled_from([OK, "timeout", "connection_lost", "not_sent", "unsupported", "deadline_exceeded",
                             "policy_failed", *sorted(ADMISSION_REFUSALS)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_outcomes, st.floats(0.0, 0.5), st.booleans(), st.one_of(st.none(), st.floats(1.0, 300.0))),
                max_size=60),
       st.floats(0.1, 100.0))
def test_counts_always_add_up(rows: list[tuple[str, float, bool, float | None]], duration: float) -> None:
    records = [RequestRecord(scheduled=0.0, sent=math.nan if o in ("not_sent", "unsupported") else 0.0, robot=0,
                             outcome=o, latency_s=lat if o != "timeout" else math.nan, late=late, deadline_ms=d)
               for o, lat, late, d in rows]
    s = summarize(records, duration=duration)
    assert s.offered == len(records)
    assert s.offered == s.completed + sum(s.refused.values()) + sum(s.errors.values())
    assert s.admitted == s.sent - sum(s.refused.values())
    assert 0 <= s.good <= s.completed <= s.admitted <= s.sent <= s.offered
    assert s.goodput == pytest.approx(s.good / duration)
    assert set(s.refused) <= ADMISSION_REFUSALS
    assert not set(s.errors) & ADMISSION_REFUSALS


def test_summary_needs_a_duration() -> None:
    with pytest.raises(ValueError):
        summarize([], duration=0.0)
