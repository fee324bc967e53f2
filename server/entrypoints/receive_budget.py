"""The bytes WebSocket clients make the server hold in messages the session has not taken yet,
bounded per process and per tenant.

``max_message_bytes`` bounds one message, but a client may start a large message and never finish
it: its bytes sit in the connection's read buffer (a frame not yet complete) and in the frames
of a fragmented message not yet ended. Across up to ``max_connections`` sessions that is
gigabytes. :class:`ReceiveBudget` counts those bytes per connection (what websockets' parser
holds: the partial frame in its reader plus the fragments of the current message), and when a
connection's growth would take its tenant past its share, or the process past the total, it
closes the connection holding the most such bytes in that scope (the grower itself when it is
the largest) with **1013** (try again later). Closing the largest holder rather than the grower
keeps a robot's ordinary observation flowing while a client sits on a half-sent huge frame.

Complete messages waiting in websockets' queue for the session count too: a client that sends
faster than its session reads (the session waiting on a slow send, or on an off-loop decode)
would otherwise make the server hold up to ``max_queue`` whole messages per connection (16 of
16 MiB by default) outside any budget. Bytes are released when the session takes the message
(``recv``) or the connection closes.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ReceiveBudget", "RECEIVE_BUDGET_REASON", "UNAUTHENTICATED"]

#: The tenant a connection's bytes count for before its handshake is authenticated.
UNAUTHENTICATED = ""

_NOTHING = ("", 0)

#: The refusal reason counted in ``chunkline_refusals_total`` when a connection is closed for it.
RECEIVE_BUDGET_REASON = "receive_budget"


class ReceiveBudget:
    """Per-connection counts of bytes held in unfinished messages, with a process total and a
    per-tenant share (sans-I/O: the caller closes the connections it is told to).

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
        # A plain dict, not a Counter: three updates per message received make its Python-level
        # ``__delitem__`` and ``__missing__`` count.
        self._held_by_tenant: dict[str, int] = {}
        self._holders: dict[object, tuple[str, int]] = {}

    def held_by(self, tenant: str) -> int:
        """Bytes held by ``tenant``'s connections."""
        return self._held_by_tenant.get(tenant, 0)

    def update(self, holder: object, tenant: str, held: int) -> list[object]:
        """Set what ``holder`` (a connection of ``tenant``) holds now.

        Returns:
            the holders to close (largest first; their bytes are already released), so that
            the rest fits: empty when it fits as it is. ``holder`` itself may be among them.
        """
        self._set(holder, tenant, held)
        if self.held <= self.tenant_bytes:
            # The usual case, decided without a lookup: no tenant holds more than all of them
            # together, and tenant_bytes <= total_bytes.
            return []
        by_tenant = self._held_by_tenant
        evicted: list[object] = []
        while by_tenant.get(tenant, 0) > self.tenant_bytes or self.held > self.total_bytes:
            scope = tenant if by_tenant.get(tenant, 0) > self.tenant_bytes else None
            victim = max((h for h, (t, _) in self._holders.items() if scope is None or t == scope),
                         key=lambda h: self._holders[h][1])
            self.release(victim)
            evicted.append(victim)
        return evicted

    def release(self, holder: object) -> None:
        """Forget ``holder`` (its message completed or its connection closed)."""
        self._set(holder, "", 0)

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
