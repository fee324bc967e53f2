"""Which queued requests run next together (sans-I/O): the seam a batch-selection strategy plugs into.

:meth:`AdmissionController.next_batch` asks its :class:`BatchSelector` for the next batch, then
takes those requests off the queue and marks them running; a selector only reads the queue,
through :class:`QueueView`, and chooses both the requests and the batch's size (up to a limit).
:class:`EdfSelector` is the default: strict priority between levels; within a level, among the
tenants whose fair-queueing tag is within ``fairness_slack`` of the least-served one, the earliest
deadline (ties: first come, first served); no tenant takes slots others reserve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from chunkline.server.core.admission.decisions import Request
from chunkline.server.core.admission.flows import Flow, QueueItem

__all__ = ["BatchSelector", "Compatible", "EdfSelector", "QueueView", "WaitingSelector", "FAIRNESS_SLACK", "take_in_order"]

#: ``compatible(first, other)``: whether ``other`` may join a batch that starts with ``first``.
Compatible = Callable[[Request, Request], bool]

#: How far (in work units at weight 1) a tenant may run ahead of the least-served one and still
#: compete by deadline: with balanced load the order is plain EDF, and one tenant's burst delays
#: the others by at most this much work.
FAIRNESS_SLACK = 4.0


class QueueView(Protocol):
    """What a selector may read of one model's queue."""

    @property
    def levels(self) -> Mapping[int, Mapping[str, Flow]]:
        """Queued requests: priority -> tenant -> flow (earliest deadline at the end of ``items``)."""

    def tag(self, tenant: str) -> float:
        """The tenant's fair-queueing start tag (work served per weight, in virtual time)."""

    def weight(self, tenant: str) -> float:
        """The tenant's share weight."""

    def room(self, tenant: str, picked: Mapping[str, int]) -> int:
        """Slots a request of ``tenant`` may still take, with ``picked`` slots per tenant already
        in the batch being formed (free concurrency less what other tenants reserve)."""

    def occupancy(self, batch_size: int) -> float:
        """How long a batch of ``batch_size`` is planned to hold its worker (the measured curve)."""

    def mean_occupancy(self, batch_size: int) -> float:
        """How long a batch of ``batch_size`` holds its worker on average (where it is expected to end)."""


class BatchSelector(Protocol):
    """Chooses the next batch.

    ``fairness_slack``: how far a tenant may run ahead of the least-served one before its work
    waits (work units at weight 1; ``inf``: it never waits). Admission's predictions assume it.
    """

    fairness_slack: float

    def select(self, queue: QueueView, now: float, limit: int, compatible: Compatible | None) -> list[Request]:
        """At most ``limit`` queued requests to run together now, in order; ``[]`` runs nothing.
        Each must fit the room :meth:`QueueView.room` gives, counting those chosen before it."""


@runtime_checkable
class WaitingSelector(Protocol):
    """A selector that may choose to wait for requests it expects: its ``select`` then returns
    ``[]`` with work queued, and ``resume_at`` says when to ask it again (``inf``: it did not wait)."""

    @property
    def resume_at(self) -> float: ...


def take_in_order(queue: QueueView, ordered: Iterable[Request], limit: int, compatible: Compatible | None) -> list[Request]:
    """The first ``limit`` of ``ordered`` that may share a batch with the first taken and fit the
    room :meth:`QueueView.room` gives, counting those taken before: a selector that ranks its
    candidates some other way takes them with this."""
    picked: list[Request] = []
    slots: dict[str, int] = {}
    for request in ordered:
        if len(picked) >= limit:
            break
        if picked and compatible is not None and not compatible(picked[0], request):
            continue
        if queue.room(request.tenant, slots) < request.cost.slots:
            continue
        picked.append(request)
        slots[request.tenant] = slots.get(request.tenant, 0) + request.cost.slots
    return picked


class EdfSelector:
    """Earliest deadline first within fair sharing (see the module docstring).

    Args:
        fairness_slack: ``0`` is strict weighted fair queueing; ``inf`` is plain EDF within a level.
    """

    __slots__ = ("fairness_slack",)

    def __init__(self, fairness_slack: float = FAIRNESS_SLACK) -> None:
        if fairness_slack < 0:
            raise ValueError("fairness_slack must be >= 0")
        self.fairness_slack = fairness_slack

    def select(self, queue: QueueView, now: float, limit: int, compatible: Compatible | None) -> list[Request]:
        picked: list[Request] = []
        slots: dict[str, int] = {}  # per tenant: slots picked so far
        taken: dict[Flow, int] = {}  # per flow: requests taken from its head so far
        # Tags as the batch moves them, read when first compared: with one candidate at a time (one
        # tenant queued, the usual case) no tag is ever read.
        tags: dict[str, float] = {}
        excluded: set[tuple[int, str]] = set()
        blocked: set[str] = set()
        levels = queue.levels
        n = 0  # len(picked)
        while n < limit:
            found = self._pick(queue, levels, picked, compatible, taken, tags, excluded, blocked)
            if found is None:
                break
            flow, request = found
            t, cost = flow.tenant, request.cost
            if queue.room(t, slots) < cost.slots:
                blocked.add(t)
                continue
            taken[flow] = k = taken.get(flow, 0) + 1
            if t in tags:
                tags[t] += cost.work / queue.weight(t)
            picked.append(request)
            n += 1
            slots[t] = slots.get(t, 0) + cost.slots
            if k == len(flow.items) and len(levels) == 1 and len(levels[flow.priority]) == 1:
                break  # the only flow queued is used up: no candidate is left
        return picked

    def _pick(self, queue: QueueView, levels: Mapping[int, Mapping[str, Flow]], picked: list[Request],
              compatible: Compatible | None, taken: dict[Flow, int], tags: dict[str, float], excluded: set[tuple[int, str]],
              blocked: set[str]) -> tuple[Flow, Request] | None:
        """The flow whose next request goes next: the highest level with a candidate, and among its
        candidates the earliest head deadline within the slack of the least-served tag."""
        first = picked[0] if picked else None
        for p in sorted(levels, reverse=True) if len(levels) > 1 else levels:
            cands: list[tuple[Flow, QueueItem]] = []
            for t, f in levels[p].items():
                if t in blocked or (excluded and (p, t) in excluded):
                    continue
                k = taken.get(f, 0) if taken else 0
                if k >= len(f.items):
                    continue
                head = f.items[-1 - k]
                if first is not None and compatible is not None and not compatible(first, head[2]):
                    excluded.add((p, t))
                    continue
                cands.append((f, head))
            if not cands:
                continue
            if len(cands) == 1:  # the only candidate is the least served, whatever the tags
                return cands[0][0], cands[0][1][2]
            tag = {f.tenant: tags[f.tenant] if f.tenant in tags else _read_tag(queue, f.tenant, picked, tags) for f, _ in cands}
            vmin = min(tag.values())
            best: tuple[Flow, Request] | None = None
            best_key = (math.inf, math.inf, 0)
            for f, (neg_deadline, neg_seq, request) in cands:
                if tag[f.tenant] > vmin + self.fairness_slack:
                    continue  # ahead of its fair share: waits while others catch up
                key = (-neg_deadline, tag[f.tenant], -neg_seq)
                if best is None or key < best_key:
                    best, best_key = (f, request), key
            return best
        return None


def _read_tag(queue: QueueView, tenant: str, picked: list[Request], tags: dict[str, float]) -> float:
    """``tenant``'s tag moved by its requests in ``picked`` (in pick order), kept in ``tags`` from
    now on."""
    tag = queue.tag(tenant)
    moved = [r.cost.work for r in picked if r.tenant == tenant]
    if moved:
        weight = queue.weight(tenant)
        for work in moved:
            tag += work / weight
    tags[tenant] = tag
    return tag
