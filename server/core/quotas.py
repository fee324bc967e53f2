"""Per-tenant quotas and the cost models that request classes plug in (sans-I/O).

A class brings a **cost** (:class:`PolicyCost`: one batch slot; :class:`TextCost`: prompt plus max
output tokens), and one :class:`QuotaManager` and admission core judge them all. Per tenant: open
sessions, requests in flight across models, a request-rate :class:`TokenBucket` and a text token
budget. Every method takes ``now``; nothing sleeps or spawns threads. The shell calls
``open_session``/``close_session`` at the handshake and close; admission calls ``check``, then
``acquire``, and ``release`` with the tokens actually used; ``update_registry`` on SIGHUP keeps the
counters and applies new limits to new work."""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.tenants import TenantInfo, TenantLimits, TenantRegistry
from chunkline.server.errors import QuotaLimit, Refusal

__all__ = [
    "TokenBucket",
    "Cost",
    "PolicyCost",
    "TextCost",
    "QuotaLimit",
    "quota_refusal",
    "TenantUsage",
    "QuotaManager",
]


@dataclasses.dataclass
class TokenBucket:
    """A token bucket on an injected clock.

    Args:
        rate: tokens added per second.
        burst: the bucket's depth (tokens it can hold).
        tokens: tokens now (defaults to full).
        stamp: time of the last refill.
    """

    rate: float
    burst: float
    tokens: float = math.nan
    stamp: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst > 0):
            raise ValueError("rate and burst must be positive")
        if math.isnan(self.tokens):
            self.tokens = self.burst

    def _refill(self, now: float) -> None:
        # A clock that steps back never adds tokens (and never removes any).
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def available(self, now: float) -> float:
        """Tokens in the bucket at ``now`` (may be negative after :meth:`force_take`)."""
        self._refill(now)
        return self.tokens

    def can_take(self, n: float, now: float) -> bool:
        """Whether ``n`` tokens are available at ``now`` (takes nothing)."""
        return self.available(now) >= n

    def take(self, n: float, now: float) -> bool:
        """Take ``n`` tokens if available; return whether it did."""
        if self.available(now) >= n:
            self.tokens -= n
            return True
        return False

    def force_take(self, n: float, now: float) -> None:
        """Take ``n`` tokens even into debt (usage reported above a reservation)."""
        self._refill(now)
        self.tokens -= n

    def give(self, n: float, now: float) -> None:
        """Return ``n`` tokens (an unused reservation), never above ``burst``."""
        self._refill(now)
        self.tokens = min(self.burst, self.tokens + n)

    def wait_time(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are available; ``inf`` if ``n`` exceeds the depth."""
        if n > self.burst:
            return math.inf
        missing = n - self.available(now)
        return 0.0 if missing <= 0 else missing / self.rate

    def reconfigure(self, rate: float, burst: float, now: float) -> None:
        """Change rate and depth in place, keeping the tokens (capped at the new depth)."""
        self._refill(now)
        self.rate = rate
        self.burst = burst
        self.tokens = min(self.tokens, burst)


# ----------------------------------------------------------------------------- cost models


@runtime_checkable
class Cost(Protocol):
    """What one request costs. Request classes provide one; the core never looks further.

    Attributes:
        slots: batch slots / concurrency units it occupies while running.
        tokens: text tokens reserved from the tenant's budget at admission (0 for policies).
        work: its size for fair sharing between tenants (same unit within one model).
    """

    @property
    def slots(self) -> int: ...

    @property
    def tokens(self) -> int: ...

    @property
    def work(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """A policy request: one slot of a batch, one unit of work, no tokens."""

    # Plain class constants (not dataclass fields: unannotated), read by admission several times
    # per request: attributes, not property calls. Frozen: an instance cannot change them.
    slots = 1
    tokens = 0
    work = 1.0


@dataclasses.dataclass(frozen=True)
class TextCost:
    """A text request: one sequence slot; reserves and weighs ``prompt_tokens + max_tokens``.

    Args:
        prompt_tokens: tokens in the prompt.
        max_tokens: most tokens it may generate.
    """

    prompt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.max_tokens < 0:
            raise ValueError("token counts must be non-negative")

    @property
    def slots(self) -> int:
        return 1

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def work(self) -> float:
        return float(max(1, self.prompt_tokens + self.max_tokens))


# ----------------------------------------------------------------------------- quotas


def quota_refusal(limit: QuotaLimit, message: str, retry_after_s: float | None = None) -> Refusal:
    """A ``quota_exceeded`` refusal naming its limit; ``retry_after_s`` ``None`` or infinite: unknown or never."""
    retry_ms = None if retry_after_s is None or math.isinf(retry_after_s) else max(1.0, retry_after_s * 1000.0)
    return Refusal(ErrorCode.QUOTA_EXCEEDED, f"{limit.value}: {message}", retry_ms, limit)


@dataclasses.dataclass(frozen=True)
class TenantUsage:
    """A tenant's counters now (for metrics, tests and ``/debug``)."""

    sessions: int
    in_flight: int
    rate_tokens: float | None
    text_tokens: float | None


class _TenantState:
    __slots__ = ("sessions", "in_flight", "rate", "text", "limits")

    def __init__(self, limits: TenantLimits, now: float) -> None:
        self.sessions = 0
        self.in_flight = 0
        self.rate: TokenBucket | None = None
        self.text: TokenBucket | None = None
        self.limits = TenantLimits()
        self.apply(limits, now)

    def apply(self, limits: TenantLimits, now: float) -> None:
        self.limits = limits
        if limits.rate_per_s is None:
            self.rate = None
        else:
            burst = float(limits.burst if limits.burst is not None else max(1.0, math.ceil(limits.rate_per_s)))
            if self.rate is None:
                self.rate = TokenBucket(limits.rate_per_s, burst, stamp=now)
            else:
                self.rate.reconfigure(limits.rate_per_s, burst, now)
        if limits.text_tokens_per_window is None:
            self.text = None
        else:
            # A fleet replica's lease can be 0 tokens (its share of a small fleet budget): a bucket
            # that never holds a whole token refuses every text request, as it should.
            cap = max(float(limits.text_tokens_per_window), 1e-9)
            rate = cap / limits.text_window_s
            if self.text is None:
                self.text = TokenBucket(rate, cap, stamp=now)
            else:
                self.text.reconfigure(rate, cap, now)

    @property
    def idle(self) -> bool:
        return self.sessions == 0 and self.in_flight == 0


class QuotaManager:
    """Per-tenant sessions, in-flight requests, request rate and text token budget.

    Args:
        registry: the current tenants. A tenant's buckets start full when it is first seen.
    """

    def __init__(self, registry: TenantRegistry) -> None:
        self._registry = registry
        self._state: dict[str, _TenantState] = {}
        # Per-tenant limits that replace the registry's: a fleet replica's lease of the tenant's
        # fleet-wide limits (see chunkline.server.cluster.fleetquota).
        self._overrides: dict[str, TenantLimits] = {}

    @property
    def registry(self) -> TenantRegistry:
        """The registry in force (admission controllers read tenants through it)."""
        return self._registry

    def update_registry(self, registry: TenantRegistry, now: float) -> None:
        """Swap in a reloaded registry. Counters are kept; changed limits apply from now on.

        A tenant removed from the file keeps its counters until its sessions and requests end;
        its new work is refused by admission (``forbidden``).
        """
        self._registry = registry
        self._reapply(now)

    def set_overrides(self, overrides: dict[str, TenantLimits], now: float) -> None:
        """Replace the limits of the tenants in ``overrides`` (the rest keep the registry's).

        A fleet replica receives its share of each tenant's fleet-wide limits this way; a new
        call replaces the previous overrides entirely. Counters are kept.
        """
        self._overrides = dict(overrides)
        self._reapply(now)

    def limits_for(self, name: str) -> TenantLimits:
        """The limits in force for tenant ``name``: its override, else the registry's."""
        override = self._overrides.get(name)
        if override is not None:
            return override
        tenant = self._registry.get(name)
        return tenant.limits if tenant is not None else TenantLimits()

    def _reapply(self, now: float) -> None:
        for name in list(self._state):
            st = self._state[name]
            if name in self._registry or name in self._overrides:
                st.apply(self.limits_for(name), now)
            elif st.idle:
                del self._state[name]

    def _get(self, name: str, now: float) -> _TenantState:
        st = self._state.get(name)
        if st is None:
            st = _TenantState(self.limits_for(name), now)
            self._state[name] = st
        return st

    def _forget_if_gone(self, name: str) -> None:
        st = self._state.get(name)
        if st is not None and st.idle and name not in self._registry:
            del self._state[name]

    # ------------------------------------------------------------------ sessions

    def open_session(self, tenant: str, now: float) -> Refusal | None:
        """Count a new session for ``tenant``, or refuse it (``max_sessions``).

        Args:
            tenant: the authenticated tenant's name.
            now: current time.
        """
        st = self._get(tenant, now)
        limit = st.limits.max_sessions
        if limit is not None and st.sessions >= limit:
            return quota_refusal(QuotaLimit.MAX_SESSIONS, f"tenant has {st.sessions} sessions open, its limit is {limit}")
        st.sessions += 1
        return None

    def close_session(self, tenant: str) -> None:
        """A session of ``tenant`` ended."""
        st = self._state.get(tenant)
        if st is not None and st.sessions > 0:
            st.sessions -= 1
            self._forget_if_gone(tenant)

    # ------------------------------------------------------------------ requests

    def check(self, tenant: TenantInfo, cost: Cost, now: float) -> Refusal | None:
        """Whether ``tenant`` may start one more request of ``cost`` now (changes nothing).

        Args:
            tenant: the tenant.
            cost: the request's cost.
            now: current time.
        """
        st = self._get(tenant.name, now)
        lim = st.limits
        if lim.max_in_flight is not None and st.in_flight + 1 > lim.max_in_flight:
            return quota_refusal(
                QuotaLimit.MAX_IN_FLIGHT, f"tenant has {st.in_flight} requests in flight, its limit is {lim.max_in_flight}"
            )
        if st.rate is not None and not st.rate.can_take(1.0, now):
            return quota_refusal(
                QuotaLimit.RATE,
                f"tenant request rate limit: {lim.rate_per_s:g}/s, burst {st.rate.burst:g}",
                st.rate.wait_time(1.0, now),
            )
        if cost.tokens > 0 and st.text is not None:
            if cost.tokens > st.text.burst:
                return quota_refusal(
                    QuotaLimit.TEXT_TOKENS,
                    f"request reserves {cost.tokens} tokens, more than the tenant's whole budget"
                    f" of {st.text.burst:g} per {lim.text_window_s:g} s",
                )
            if not st.text.can_take(cost.tokens, now):
                return quota_refusal(
                    QuotaLimit.TEXT_TOKENS,
                    f"tenant text token budget exhausted ({lim.text_tokens_per_window} per {lim.text_window_s:g} s)",
                    st.text.wait_time(cost.tokens, now),
                )
        return None

    def acquire(self, tenant: TenantInfo, cost: Cost, now: float) -> None:
        """Commit an admitted request: one in flight, one rate token, its text tokens reserved.

        Call only right after :meth:`check` passed at the same ``now``.
        """
        st = self._get(tenant.name, now)
        st.in_flight += 1
        if st.rate is not None:
            st.rate.force_take(1.0, now)
        if cost.tokens > 0 and st.text is not None:
            st.text.force_take(cost.tokens, now)

    def release(self, tenant: str, cost: Cost, now: float, used_tokens: int | None = None) -> None:
        """A request ended: free its in-flight count and reconcile its token reservation.

        Args:
            tenant: the tenant's name.
            cost: the cost it was admitted with.
            now: current time.
            used_tokens: tokens it actually consumed (prompt + generated); ``None`` counts the
                whole reservation as used; 0 for work that never ran.
        """
        st = self._state.get(tenant)
        if st is None:
            return
        if st.in_flight > 0:
            st.in_flight -= 1
        if cost.tokens > 0 and st.text is not None and used_tokens is not None:
            delta = cost.tokens - used_tokens
            if delta > 0:
                st.text.give(delta, now)
            elif delta < 0:
                st.text.force_take(-delta, now)
        self._forget_if_gone(tenant)

    def usage(self, tenant: str, now: float) -> TenantUsage:
        """The counters of ``tenant`` at ``now``."""
        st = self._state.get(tenant)
        if st is None:
            return TenantUsage(0, 0, None, None)
        return TenantUsage(
            st.sessions,
            st.in_flight,
            st.rate.available(now) if st.rate is not None else None,
            st.text.available(now) if st.text is not None else None,
        )
