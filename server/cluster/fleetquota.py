"""Tenant limits that hold for the whole fleet, not per replica (sans-I/O).

The directory's :class:`FleetQuota` counts a session accepted at a handshake as *pending* on its
replica until the replica confirms its id or a report taken after ``confirm_s`` arrives; replica
reports are the truth for that replica; ``leases(now)`` gives each replica the per-replica limits
its own quota manager enforces. Pending sessions are never dropped because a replica went quiet
(only by a report, ``forget_replica`` or, as a last resort, ``abandon_s``), so the count never falls
under the truth for sessions placed by the directory. A robot reconnecting straight to replicas is
bounded by their leases: two such reconnects between reports can exceed ``max_sessions``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction

from chunkline.server.core.quotas import QuotaLimit, quota_refusal
from chunkline.server.core.tenants import TenantLimits
from chunkline.server.errors import Refusal

__all__ = ["FleetQuota", "split_integer"]


@dataclasses.dataclass
class _Pending:
    tenant: str
    replica: str
    placed: float


@dataclasses.dataclass
class _Report:
    counts: dict[str, int]
    at: float


def split_integer(total: int, weights: Mapping[str, Fraction]) -> dict[str, int]:
    """Split ``total`` in proportion to ``weights`` with largest-remainder rounding.

    The parts sum to exactly ``total`` (when the weights sum to 1); each is the floor of its
    exact share or one more. Ties in the remainder go to the smallest key.

    Args:
        total: a non-negative integer.
        weights: key to its exact share (non-negative ``Fraction``s summing to 1).
    """
    names = sorted(weights)
    exact = {n: total * weights[n] for n in names}
    parts = {n: math.floor(exact[n]) for n in names}
    left = total - sum(parts.values())
    for n in sorted(names, key=lambda n: (-(exact[n] - parts[n]), n))[: max(0, left)]:
        parts[n] += 1
    return parts


class FleetQuota:
    """Fleet-wide session counts per tenant, and the per-replica share of each tenant's limits.

    Args:
        limits_of: the fleet limits of a tenant (usually ``registry.get(t).limits``).
        confirm_s: how long after a placement a report surely shows the session if it connected;
            set it to the placement token's ``ttl_s`` plus the report delay.
        abandon_s: a pending session on a replica that never reports again stops counting after
            this long (the shell should have called :meth:`forget_replica` well before).
        floor_share: the part of a tenant's rate, in-flight and text-token limits set aside for
            replicas where it has no session, split evenly among them, so a robot that lands there
            before the next lease push is served slowly rather than refused outright. Replicas
            with sessions share the rest by session count. Integer limits may still round to 0
            there.
    """

    def __init__(
        self,
        limits_of: Callable[[str], TenantLimits],
        *,
        confirm_s: float = 35.0,
        abandon_s: float = 300.0,
        floor_share: float = 0.05,
    ) -> None:
        if not (confirm_s > 0 and abandon_s >= confirm_s and 0.0 < floor_share < 1.0):
            raise ValueError("confirm_s > 0, abandon_s >= confirm_s and floor_share in (0, 1)")
        self._limits_of = limits_of
        self.confirm_s = confirm_s
        self.abandon_s = abandon_s
        # The decimal the operator wrote (0.05 is 1/20), not its binary neighbour: exact ties stay ties.
        self._floor = Fraction(floor_share).limit_denominator(1_000_000)
        self._reports: dict[str, _Report] = {}
        self._pending: dict[str, _Pending] = {}

    # ------------------------------------------------------------------ counting

    def _expire(self, now: float) -> None:
        gone = [sid for sid, p in self._pending.items() if now - p.placed >= self.abandon_s]
        for sid in gone:
            del self._pending[sid]

    def _per_replica(self, tenant: str) -> dict[str, int]:
        counts = {r: rep.counts.get(tenant, 0) for r, rep in self._reports.items()}
        for p in self._pending.values():
            if p.tenant == tenant:
                counts[p.replica] = counts.get(p.replica, 0) + 1
        return counts

    def sessions(self, tenant: str, now: float) -> int:
        """The tenant's sessions across the fleet: reported plus placed and not yet shown."""
        self._expire(now)
        return sum(self._per_replica(tenant).values())

    @property
    def replicas(self) -> frozenset[str]:
        """Replicas known: those that reported and those with pending placements."""
        return frozenset(self._reports) | {p.replica for p in self._pending.values()}

    def try_open(self, tenant: str, replica: str, session: str, now: float) -> Refusal | None:
        """Count a new session of ``tenant`` placed on ``replica``, or refuse it.

        Args:
            tenant: the authenticated tenant.
            replica: where the session is placed.
            session: the placement's session id (``PlacementClaims.session``); opening the same
                id twice counts it once.
            now: the directory's clock.

        Returns:
            ``None`` when counted; a ``max_sessions`` :class:`~chunkline.server.errors.Refusal` otherwise.
        """
        self._expire(now)
        if session in self._pending:
            return None
        limit = self._limits_of(tenant).max_sessions
        if limit is not None:
            have = sum(self._per_replica(tenant).values())
            if have >= limit:
                mine = [p.placed for p in self._pending.values() if p.tenant == tenant]
                # A pending placement may turn out never to connect; that is the earliest a slot
                # can free up that this object knows of.
                retry = max(0.0, min(mine) + self.confirm_s - now) if mine else None
                return quota_refusal(QuotaLimit.MAX_SESSIONS, f"tenant has {have} sessions in the fleet, its limit is {limit}", retry)
        self._pending[session] = _Pending(tenant, replica, now)
        return None

    def report(self, replica: str, sessions_by_tenant: Mapping[str, int], now: float, confirmed: Iterable[str] = ()) -> None:
        """Take a replica's session counts (its whole truth: a tenant absent has none there).

        Args:
            replica: the reporting replica.
            sessions_by_tenant: tenant to sessions open on it when the report was taken.
            now: the directory's clock when the report was taken (an older report than the one
                held is ignored).
            confirmed: placement session ids it has accepted that these counts include (repeats
                and unknown ids are harmless).
        """
        counts = {t: int(n) for t, n in sessions_by_tenant.items() if n}
        if any(n < 0 for n in counts.values()):
            raise ValueError("session counts must be non-negative")
        old = self._reports.get(replica)
        if old is not None and now < old.at:
            return
        self._reports[replica] = _Report(counts, now)
        for sid in set(confirmed):
            p = self._pending.get(sid)
            if p is not None and p.replica == replica:
                del self._pending[sid]
        late = [sid for sid, p in self._pending.items() if p.replica == replica and now - p.placed >= self.confirm_s]
        for sid in late:
            del self._pending[sid]
        self._expire(now)

    def forget_replica(self, replica: str) -> None:
        """``replica`` is gone (stopped, killed): its sessions and placements no longer count."""
        self._reports.pop(replica, None)
        for sid in [sid for sid, p in self._pending.items() if p.replica == replica]:
            del self._pending[sid]

    # ------------------------------------------------------------------ leases

    def _weights(self, counts: Mapping[str, int], replicas: Iterable[str]) -> dict[str, Fraction]:
        names = sorted(set(replicas))
        total = sum(counts.get(r, 0) for r in names)
        if total == 0:
            return {r: Fraction(1, len(names)) for r in names}
        empty = [r for r in names if counts.get(r, 0) == 0]
        keep = Fraction(1) - self._floor if empty else Fraction(1)
        w = {r: keep * Fraction(counts.get(r, 0), total) for r in names}
        for r in empty:
            w[r] = self._floor / len(empty)
        return w

    def _lease_all(self, tenant: str, replicas: Iterable[str]) -> dict[str, TenantLimits]:
        names = sorted(set(replicas))
        if not names:
            return {}
        fleet = self._limits_of(tenant)
        counts = self._per_replica(tenant)
        weights = self._weights(counts, names)
        total = sum(counts.get(r, 0) for r in names)
        in_flight = split_integer(fleet.max_in_flight, weights) if fleet.max_in_flight is not None else None
        text = split_integer(fleet.text_tokens_per_window, weights) if fleet.text_tokens_per_window is not None else None
        out: dict[str, TenantLimits] = {}
        for r in names:
            w = weights[r]
            rate = burst = None
            if fleet.rate_per_s is not None:
                rate = float(fleet.rate_per_s * w)
                depth = fleet.burst if fleet.burst is not None else max(1.0, math.ceil(fleet.rate_per_s))
                # A bucket shallower than one request never admits anything: at least 1.
                burst = max(1.0, float(depth * w))
            out[r] = TenantLimits(
                max_sessions=None if fleet.max_sessions is None else max(0, fleet.max_sessions - (total - counts.get(r, 0))),
                max_in_flight=None if in_flight is None else in_flight[r],
                rate_per_s=rate,
                burst=burst,
                text_tokens_per_window=None if text is None else text[r],
                text_window_s=fleet.text_window_s,
            )
        return out

    def lease(self, tenant: str, replica: str, now: float) -> TenantLimits:
        """The limits ``replica`` should enforce for ``tenant`` now (also for a replica or tenant
        not seen yet: the replica is counted in, with no sessions)."""
        self._expire(now)
        return self._lease_all(tenant, self.replicas | {replica})[replica]

    def leases(self, now: float, tenants: Iterable[str] = ()) -> dict[str, dict[str, TenantLimits]]:
        """Per-replica limits whose sum is each tenant's fleet limit.

        For each known replica and each tenant with sessions in the fleet (plus ``tenants``):

        * ``rate_per_s``, ``max_in_flight`` and ``text_tokens_per_window`` are split by the
          tenant's session count on each replica (pending ones included); replicas where it has
          none share ``floor_share`` of the limit evenly (all replicas share evenly when it has
          none anywhere). Integers use largest-remainder rounding, so they sum to exactly the
          fleet limit; rates sum to it up to float rounding. ``burst`` is split the same way
          but never below 1 (so the leased bursts may exceed the fleet's by at most one each).
        * ``max_sessions`` is the fleet limit minus the tenant's sessions on the other replicas,
          so a robot reconnecting straight to a replica cannot take the fleet over its cap.
        * Unlimited (``None``) stays ``None``; ``text_window_s`` is the fleet's.

        Args:
            now: the directory's clock.
            tenants: tenants to include even without sessions (e.g. every tenant in the registry).

        Returns:
            replica to tenant to :class:`TenantLimits`.
        """
        self._expire(now)
        names = set(tenants)
        for rep in self._reports.values():
            names.update(t for t, n in rep.counts.items() if n > 0)
        names.update(p.tenant for p in self._pending.values())
        replicas = self.replicas
        out: dict[str, dict[str, TenantLimits]] = {r: {} for r in replicas}
        for t in sorted(names):
            for r, lim in self._lease_all(t, replicas).items():
                out[r][t] = lim
        return out
