"""The memory account of every byte the server holds for WebSocket clients, per connection and
per tenant: partial frames, fragments, complete messages the session has not taken, and decoded
arrays reserved before a decode (:meth:`ReceiveBudget.reserve`).

Invariants: the process total stays within ``total_bytes`` and a tenant's within its share; to
get there a connection is closed (1013) only if its tenant holds more than its fair share (the
smaller of its configured share and the total over the tenants holding bytes), the largest holder
of the tenant furthest over its fair share first. A tenant within its fair share is never evicted:
a robot sending ordinary observations keeps flowing while others sit on half-sent frames.
Sans-I/O: the caller closes the connections it is told to.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ReceiveBudget", "RECEIVE_BUDGET_REASON", "Reservation", "UNAUTHENTICATED"]

#: The tenant a connection's bytes count for before its handshake is authenticated.
UNAUTHENTICATED = ""

_NOTHING = ("", 0)

#: The refusal reason counted in ``chunkline_refusals_total`` when a connection is closed for it.
RECEIVE_BUDGET_REASON = "receive_budget"


class ReceiveBudget:
    """Per-connection counts of bytes held, with a process total and a per-tenant share.

    Args:
        total_bytes: most bytes held by every connection together.
        tenant_share: the fraction of ``total_bytes`` one tenant's connections may hold.
        on_refused: called once for every connection closed for the budget (a metric).
    """

    def __init__(self, total_bytes: int, tenant_share: float, on_refused: Callable[[], None] | None = None) -> None:
        if total_bytes < 1 or not 0 < tenant_share <= 1:
            raise ValueError("total_bytes must be positive and tenant_share in (0, 1]")
        self.on_refused = on_refused
        self.total_bytes = total_bytes
        self.tenant_bytes = max(1, int(total_bytes * tenant_share))
        self.held = 0
        self._held_by_tenant: dict[str, int] = {}
        self._holders: dict[object, tuple[str, int]] = {}

    def held_by(self, tenant: str) -> int:
        """Bytes held by ``tenant``'s connections."""
        return self._held_by_tenant.get(tenant, 0)

    def holding(self, holder: object) -> int:
        """Bytes ``holder`` is counted for."""
        return self._holders.get(holder, _NOTHING)[1]

    def fair_share(self) -> int:
        """What each tenant holding bytes may hold when the total is contended."""
        return min(self.tenant_bytes, self.total_bytes // max(1, len(self._held_by_tenant)))

    def update(self, holder: object, tenant: str, held: int) -> list[object]:
        """Set what ``holder`` (a connection of ``tenant``) holds now.

        Returns:
            the holders to close (their bytes already released), so that the rest fits: empty
            when it fits as it is. ``holder`` itself may be among them.
        """
        self._set(holder, tenant, held)
        if self.held <= self.tenant_bytes:
            return []  # the usual case: no tenant holds more than all of them together
        return self._evict(tenant)

    def fits(self, tenant: str, nbytes: int, share: float = 1.0) -> bool:
        """Whether ``tenant`` may hold ``nbytes`` more without going past ``share`` of its share, or
        past the total while over that much of its fair share (then the request should be refused,
        not anyone evicted)."""
        mine = self.held_by(tenant) + nbytes
        if mine > self.tenant_bytes * share:
            return False
        return self.held + nbytes <= self.total_bytes or mine <= self.fair_share() * share

    def release(self, holder: object) -> None:
        """Forget ``holder`` (its connection closed or was evicted)."""
        self._set(holder, "", 0)

    def _evict(self, tenant: str) -> list[object]:
        by_tenant = self._held_by_tenant
        evicted: list[object] = []
        while True:
            if by_tenant.get(tenant, 0) > self.tenant_bytes:
                scope = tenant
            elif self.held > self.total_bytes:
                # Some tenant is over total / tenants: the held bytes would not add up otherwise.
                fair = self.total_bytes // len(by_tenant)
                scope = max(by_tenant, key=lambda t: by_tenant[t] - fair)
            else:
                return evicted
            victim = max((h for h, (t, _) in self._holders.items() if t == scope), key=lambda h: self._holders[h][1])
            self.release(victim)
            evicted.append(victim)

    def _set(self, holder: object, tenant: str, held: int) -> None:
        old_tenant, old = self._holders.pop(holder, _NOTHING)
        by_tenant = self._held_by_tenant
        if old:
            self.held -= old
            left = by_tenant[old_tenant] - old
            if left:
                by_tenant[old_tenant] = left
            else:
                del by_tenant[old_tenant]
        if held > 0:
            self._holders[holder] = (tenant, held)
            self.held += held
            by_tenant[tenant] = by_tenant.get(tenant, 0) + held


class Reservation:
    """Bytes counted for a holder until :meth:`release` (decoded arrays a request produces):
    ``release`` gives them back once, through the holder's ``give_back``."""

    __slots__ = ("_give_back", "nbytes")

    def __init__(self, give_back: Callable[[int], None], nbytes: int) -> None:
        self._give_back: Callable[[int], None] | None = give_back
        self.nbytes = nbytes

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back(self.nbytes)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
