"""Quotas: token buckets, per-tenant sessions / in-flight / rate / text token budgets."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.core.quotas import PolicyCost, QuotaManager, TextCost, TokenBucket
from chunkline.server.core.tenants import TenantInfo, TenantLimits, TenantRegistry
from chunkline.server.errors import QuotaLimit


def _reg(**limits: TenantLimits) -> TenantRegistry:
    return TenantRegistry({name: TenantInfo(name, limits=lim) for name, lim in limits.items()})


def test_token_bucket_basics() -> None:
    b = TokenBucket(rate=2.0, burst=4.0, stamp=0.0)
    assert b.available(0.0) == 4.0
    assert all(b.take(1, 0.0) for _ in range(4))
    assert not b.take(1, 0.0)
    assert b.wait_time(1, 0.0) == pytest.approx(0.5)
    assert b.take(1, 0.5)
    assert b.available(100.0) == 4.0  # capped at burst
    assert b.wait_time(5, 100.0) == math.inf
    b.give(10, 100.0)
    assert b.available(100.0) == 4.0
    b.force_take(6, 100.0)
    assert b.available(100.0) == -2.0
    assert b.available(99.0) == -2.0  # a clock stepping back adds nothing
    b.reconfigure(1.0, 1.0, 100.0)
    assert b.available(101.0) == -1.0 and b.burst == 1.0
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0.1, 100),
    st.floats(1, 50),
    st.lists(st.tuples(st.floats(0, 2), st.floats(0, 10)), max_size=40),
)
def test_token_bucket_never_exceeds_its_rate(rate: float, burst: float, ops: list[tuple[float, float]]) -> None:
    b = TokenBucket(rate, burst, stamp=0.0)
    t = 0.0
    taken = 0.0
    for dt_, n in ops:
        t += dt_
        before = b.available(t)
        assert before <= burst + 1e-9
        ok = b.take(n, t)
        assert ok == (before >= n)
        if ok:
            taken += n
    # over any run, what was taken is at most the initial burst plus what refilled
    assert taken <= burst + rate * t + 1e-6


def test_sessions_limit() -> None:
    q = QuotaManager(_reg(a=TenantLimits(max_sessions=2)))
    assert q.open_session("a", 0) is None and q.open_session("a", 0) is None
    r = q.open_session("a", 0)
    assert r is not None and r.limit is QuotaLimit.MAX_SESSIONS and "2" in r.message
    q.close_session("a")
    assert q.open_session("a", 0) is None
    assert q.usage("a", 0).sessions == 2


def test_in_flight_and_rate_limits() -> None:
    reg = _reg(a=TenantLimits(max_in_flight=2, rate_per_s=10.0, burst=3))
    q = QuotaManager(reg)
    a = reg.get("a")
    assert a is not None
    for _ in range(2):
        assert q.check(a, PolicyCost(), 0.0) is None
        q.acquire(a, PolicyCost(), 0.0)
    r = q.check(a, PolicyCost(), 0.0)
    assert r is not None and r.limit is QuotaLimit.MAX_IN_FLIGHT
    q.release("a", PolicyCost(), 0.0)
    assert q.check(a, PolicyCost(), 0.0) is None
    q.acquire(a, PolicyCost(), 0.0)  # third rate token of 3
    q.release("a", PolicyCost(), 0.0)
    q.release("a", PolicyCost(), 0.0)
    r = q.check(a, PolicyCost(), 0.0)
    assert r is not None and r.limit is QuotaLimit.RATE and r.retry_after_ms == pytest.approx(100.0)
    assert q.check(a, PolicyCost(), 0.1) is None


def test_text_tokens_reserved_then_reconciled() -> None:
    reg = _reg(a=TenantLimits(text_tokens_per_window=1000, text_window_s=100.0))  # refills 10 tokens/s
    q = QuotaManager(reg)
    a = reg.get("a")
    assert a is not None
    big = TextCost(prompt_tokens=200, max_tokens=600)
    assert q.check(a, big, 0.0) is None
    q.acquire(a, big, 0.0)
    assert q.usage("a", 0.0).text_tokens == 200
    r = q.check(a, big, 0.0)
    assert r is not None and r.limit is QuotaLimit.TEXT_TOKENS and r.retry_after_ms == pytest.approx(60000.0)
    # it used 300 of the 800 reserved: 500 come back
    q.release("a", big, 0.0, used_tokens=300)
    assert q.usage("a", 0.0).text_tokens == 700
    assert q.check(a, TextCost(200, 500), 0.0) is None
    assert q.check(a, TextCost(200, 501), 0.0) is not None
    # usage above the reservation is charged (debt)
    q.acquire(a, TextCost(10, 10), 0.0)
    q.release("a", TextCost(10, 10), 0.0, used_tokens=120)
    assert q.usage("a", 0.0).text_tokens == 580
    # a request larger than the whole budget can never pass: no retry hint
    r = q.check(a, TextCost(900, 200), 0.0)
    assert r is not None and r.limit is QuotaLimit.TEXT_TOKENS and r.retry_after_ms is None
    # policy requests do not touch the text budget
    assert q.check(a, PolicyCost(), 0.0) is None


def test_release_without_usage_counts_the_whole_reservation() -> None:
    reg = _reg(a=TenantLimits(text_tokens_per_window=100, text_window_s=1e6))
    q = QuotaManager(reg)
    a = reg.get("a")
    assert a is not None
    q.acquire(a, TextCost(10, 40), 0.0)
    q.release("a", TextCost(10, 40), 0.0)
    assert q.usage("a", 0.0).text_tokens == pytest.approx(50, abs=1e-3)
    q.acquire(a, TextCost(10, 40), 0.0)
    q.release("a", TextCost(10, 40), 0.0, used_tokens=0)  # never ran
    assert q.usage("a", 0.0).text_tokens == pytest.approx(50, abs=1e-3)


def test_reload_keeps_counters_and_applies_new_limits() -> None:
    q = QuotaManager(_reg(a=TenantLimits(max_sessions=5), b=TenantLimits()))
    for _ in range(3):
        assert q.open_session("a", 0) is None
    q.open_session("b", 0)
    q.update_registry(_reg(a=TenantLimits(max_sessions=2)), 1.0)
    assert q.usage("a", 1.0).sessions == 3  # nobody is dropped
    r = q.open_session("a", 1.0)
    assert r is not None and r.limit is QuotaLimit.MAX_SESSIONS
    # b was removed from the file: its counters live until its last session closes
    assert q.usage("b", 1.0).sessions == 1
    q.close_session("b")
    assert q.usage("b", 1.0).sessions == 0
    assert "b" not in q._state


def test_unlimited_tenant_passes_everything() -> None:
    reg = _reg(a=TenantLimits())
    q = QuotaManager(reg)
    a = reg.get("a")
    assert a is not None
    for _ in range(1000):
        assert q.check(a, TextCost(1000, 1000), 0.0) is None
        q.acquire(a, TextCost(1000, 1000), 0.0)
    assert q.usage("a", 0.0).in_flight == 1000
