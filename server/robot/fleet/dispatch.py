"""The fleet strategy as admission's batch chooser: queued requests in, the next batch out.

Admission keeps what it owns (refusal at the door, expiry, promises, accounting); the strategy
only picks among what is queued. A request's payload says how urgent it is and how much its robot
weighs (:class:`FleetWork`); a payload that says nothing is valued by its deadline alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from chunkline.server.core.admission import Request
from chunkline.server.robot.fleet.strategy import FleetCandidate, FleetStrategy
from chunkline.server.robot.fleet.urgency import Urgency

__all__ = ["FleetWork", "FleetBatchChooser"]


@runtime_checkable
class FleetWork(Protocol):
    """What the strategy reads of a queued request's payload."""

    @property
    def enqueued_at(self) -> float: ...

    @property
    def urgency(self) -> Urgency | None: ...

    @property
    def robot_weight(self) -> float: ...


class FleetBatchChooser:
    """Admission's ``batch_chooser`` for one model, backed by a :class:`FleetStrategy`.

    Args:
        strategy: the strategy (one per model: it keeps the tenants' shares of that model).
        tenant_weight: a tenant's weight (from the registry).
    """

    def __init__(self, strategy: FleetStrategy, tenant_weight: Callable[[str], float]) -> None:
        self.strategy = strategy
        self._tenant_weight = tenant_weight

    def __call__(self, queued: list[Request], now: float, most: int, latency: Callable[[int], float]) -> list[Request]:
        by_id = {r.id: r for r in queued}
        candidates = [_candidate(r, now) for r in queued]
        choice = self.strategy.choose(now, candidates, latency, most, self._tenant_weight)
        return [by_id[k] for k in choice.keys]


def _candidate(r: Request, now: float) -> FleetCandidate:
    work = r.payload
    if not isinstance(work, FleetWork):
        return FleetCandidate(r.id, r.tenant, now, r.deadline, robot=r.session)
    return FleetCandidate(r.id, r.tenant, work.enqueued_at, r.deadline, work.robot_weight, work.urgency, robot=r.session)
