"""The fleet strategy as admission's batch selector: queued requests in, the next batch out.

Admission keeps what it owns (refusal at the door, expiry, promises, accounting); the strategy
only picks among the highest priority level's queued requests (strict priority holds), within the
room each tenant has. A request's payload says how urgent it is and how much its robot weighs
(:class:`FleetWork`); a payload that says nothing is valued by its deadline alone. The selector
keeps each robot's cycle (:class:`~.calendar.Reserver`) and, when the strategy would rather
wait for requests it expects, takes nothing and names when to be asked again (:attr:`resume_at`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from chunkline.server.core.admission import Request
from chunkline.server.core.admission.selection import FAIRNESS_SLACK, Compatible, QueueView, take_in_order
from chunkline.server.robot.fleet.calendar import Reserver
from chunkline.server.robot.fleet.strategy import FleetCandidate, FleetStrategy
from chunkline.server.robot.fleet.urgency import Urgency

__all__ = ["FleetWork", "FleetSelector"]


@runtime_checkable
class FleetWork(Protocol):
    """What the strategy reads of a queued request's payload."""

    @property
    def enqueued_at(self) -> float: ...

    @property
    def urgency(self) -> Urgency | None: ...

    @property
    def robot_weight(self) -> float: ...

    @property
    def queued_since(self) -> float | None: ...


class FleetSelector:
    """A :class:`~chunkline.server.core.admission.BatchSelector` backed by a :class:`FleetStrategy`.

    Args:
        strategy: the strategy (one per model: it keeps the tenants' shares of that model).
        tenant_weight: a tenant's weight (from the registry).
        reserve: weigh waiting for the requests the robots' cycles predict (else choose among
            the queued requests only).
        wait_grace_s: how long past its predicted arrival an expected request is still waited for.

    ``fairness_slack`` is what admission's predictions assume of the order; the strategy keeps its
    own tenant share, so the default slack stands for it.
    """

    __slots__ = ("strategy", "reserver", "resume_at", "_tenant_weight")

    fairness_slack: float = FAIRNESS_SLACK

    def __init__(self, strategy: FleetStrategy, tenant_weight: Callable[[str], float], reserve: bool = True,
                 wait_grace_s: float = 0.002) -> None:
        self.strategy = strategy
        self.reserver = Reserver(strategy, reserve, wait_grace_s)
        #: when the last choice waited: when to choose again (inf: it did not wait)
        self.resume_at = math.inf
        self._tenant_weight = tenant_weight

    def select(self, queue: QueueView, now: float, limit: int, compatible: Compatible | None) -> list[Request]:
        self.resume_at = math.inf
        levels = queue.levels
        if not levels:
            return []
        level = levels[max(levels)]
        queued = [item[2] for flow in level.values() for item in flow.items]
        if not queued:
            return []
        by_id = {r.id: r for r in queued}
        candidates = [_candidate(r, now) for r in queued]
        choice = self.reserver.choose(now, candidates, queue.occupancy, limit, self._tenant_weight, queue.mean_occupancy)
        if choice.waits_until is not None:
            self.resume_at = self.reserver.resume_at(choice)
            return []
        picked = take_in_order(queue, (by_id[key] for key in choice.keys), limit, compatible)
        ids = {r.id for r in picked}
        self.reserver.started((c for c in candidates if c.key in ids), now + queue.occupancy(len(picked)))
        return picked


def _candidate(r: Request, now: float) -> FleetCandidate:
    work = r.payload
    if not isinstance(work, FleetWork):
        return FleetCandidate(r.id, r.tenant, now, r.deadline, robot=r.session)
    # A replacement (``replaces``) keeps the place of the request it replaced (its payload says since when).
    return FleetCandidate(r.id, r.tenant, work.enqueued_at, r.deadline, work.robot_weight, work.urgency, robot=r.session,
                          since=work.queued_since)


