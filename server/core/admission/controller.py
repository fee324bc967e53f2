"""Admission and scheduling for one model (sans-I/O): refuse early, queue by deadline, share fairly.

One :class:`AdmissionController` per served model, shared by every request class (a class brings
its cost and builds its own reply). Every call takes ``now``; deadlines are absolute on that clock.
A shell calls :meth:`~AdmissionController.offer` (or :meth:`~AdmissionController.check` before
decoding), :meth:`~AdmissionController.next_batch` when a worker is free, ``complete_batch`` or
``complete`` when it returns, and answers :meth:`~.queue_book.QueueBook.take_dropped` after each.

An admission is a promise: a request is refused (``deadline_unmeetable``) when its predicted
completion misses its deadline or when admitting it would make an admitted request miss its own.
Predictions assume the selector's order: higher priority first, then earliest deadline within a
tenant's fair share (:mod:`.selection`). Refusals that waiting cures get their retry times from the
model's :class:`~.retry_line.RetryLine`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Hashable
from typing import Any

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission.config import AdmissionConfig
from chunkline.server.core.admission.decisions import Admitted, DuplicateRequest, Request
from chunkline.server.core.admission.flows import EPS, EntryState, Flow, TenantWorkRate
from chunkline.server.core.admission.queue_book import ARRIVAL_WINDOW_S, QueueBook
from chunkline.server.core.admission.retry_line import RetryLine
from chunkline.server.core.admission.selection import BatchSelector, Compatible, EdfSelector
from chunkline.server.core.admission.service_time import ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import QuotaLimit, Refusal

__all__ = ["AdmissionConfig", "AdmissionController", "Verdict", "RETRY_GRACE_S"]

_QUEUED = EntryState.QUEUED
#: Refusals whose retry times are handed out one session after another (see :meth:`AdmissionController.appoint`).
_LINED = frozenset({ErrorCode.OVERLOADED, ErrorCode.DEADLINE_UNMEETABLE})
#: How long after its retry time a refused session that has not come back keeps its place in the
#: retry line: a few control periods of a robot that waits as told, so a late resend still finds it.
RETRY_GRACE_S = 0.05


@dataclasses.dataclass(slots=True)
class Verdict:
    """What admitting a request would do (admission's rules, judged without side effects).

    Args:
        tenant: its tenant.
        victim: the flow to evict one request from (a full queue), if any.
        start: its predicted start.
        completion: its predicted completion.
        slot: how much later every queued request it overtakes finishes (``None``: its level has
            no queued promise).
    """

    tenant: TenantInfo
    victim: Flow | None
    start: float
    completion: float
    slot: float | None


class AdmissionController(QueueBook):
    """Admission, queueing and batch selection for one model (its queue state, kept flat on
    purpose, is :class:`~.queue_book.QueueBook`'s).

    Args:
        model: the model's name (checked against tenants' allowed models).
        quotas: the shared per-tenant quotas; its registry supplies weights and priorities.
        config: see :class:`AdmissionConfig`.
        service: the service-time model (one is created if not given).
        selector: which queued requests form the next batch (default :class:`~.selection.EdfSelector`);
            its ``fairness_slack`` is what admission's predictions assume.
    """

    def __init__(
        self,
        model: str,
        quotas: QuotaManager,
        config: AdmissionConfig | None = None,
        service: ServiceTimeModel | None = None,
        selector: BatchSelector | None = None,
    ) -> None:
        super().__init__(model, quotas, config if config is not None else AdmissionConfig(),
                         service if service is not None else ServiceTimeModel())
        #: chooses the next batch (see :mod:`.selection`)
        self.selector: BatchSelector = selector if selector is not None else EdfSelector()
        #: the retry times handed out to refused sessions (see :meth:`appoint`)
        self.retry_line = RetryLine()

    # ------------------------------------------------------------------ admission

    def offer(self, request: Request, now: float) -> Admitted | Refusal:
        """Admit ``request`` into the queue, or refuse it at once.

        Checks, in order: tenant allowed (``forbidden``), deadline still ahead
        (``deadline_unmeetable``), tenant quotas (``quota_exceeded`` + which limit), queue room
        (``overloaded``, unless a fair-share eviction makes room), predicted completion before
        the deadline (``deadline_unmeetable``). Only an admitted request consumes quota.

        Args:
            request: the request (its ``id`` must be unique among requests queued or running).
            now: current time.

        Raises:
            DuplicateRequest: the id is already queued or running.
            ValueError: the deadline is not a finite number.
        """
        if request.id in self._entries:
            raise DuplicateRequest(f"request id {request.id!r} is already in flight")
        if not math.isfinite(request.deadline):
            raise ValueError("a request needs a finite deadline (see resolve_deadline)")
        if self.queued:  # (an empty queue has nothing to expire)
            self.expire(now)
        verdict = self._judge(request, now)
        if isinstance(verdict, Refusal):
            return verdict
        victim, slot, completion = verdict.victim, verdict.slot, verdict.completion
        if victim is not None:
            self._drop_queued(
                victim,
                0,  # the victim's latest deadline: the request it can best afford to lose
                now,
                ErrorCode.OVERLOADED,
                "evicted from a full queue for a tenant under its fair share",
                self._retry_after_ms(now),
            )
        promises = self._promises.get(request.priority) if slot is not None else None
        if promises is not None and slot is not None:  # (an eviction may have emptied the level)
            # Everything it overtakes (later deadlines at its level) now finishes a slot later.
            promises.overtake(request.deadline, slot)
        self._enqueue(request, now, completion)
        self._count_admitted(request, verdict.tenant, now)
        return Admitted(request, verdict.start, completion)

    def replace(self, request_id: Hashable, session: str, deadline: float, payload: Any, now: float,
                new_id: Hashable | None = None) -> Admitted | Refusal:
        """Swap queued request ``request_id`` of ``session`` for its replacement (a fresher
        observation of the same robot), in its place: the replacement keeps its arrival order,
        its tenant, class, cost and priority, and takes ``payload`` and ``deadline`` (or the old
        one's when later: ordered by deadline, a replacement never goes ahead of the place it
        takes). The old request leaves the queue without being dropped (the shell answers it);
        nothing is counted as a new arrival. The tenant's quotas judge the replacement while the
        old one still counts, like any request; its quota then passes to the replacement.

        Args:
            request_id: the queued request's id.
            session: the session asking (another session's request is never touched).
            deadline: the replacement's absolute deadline.
            payload: the replacement's payload.
            now: current time.
            new_id: the replacement's id (default: ``request_id``, the place's id).

        Returns:
            :class:`Admitted` (its ``request`` the replacement); or ``replace_missed`` when the
            request is not queued here for ``session`` (running, ended, expired by ``now``,
            unknown), or the quota's refusal: the old request then stands.

        Raises:
            DuplicateRequest: ``new_id`` is another request's, queued or running.
            ValueError: the deadline is not a finite number.
        """
        if not math.isfinite(deadline):
            raise ValueError("a request needs a finite deadline (see resolve_deadline)")
        self.expire(now)
        e = self._entries.get(request_id)
        if e is None or e.state is not _QUEUED or e.request.session != session:
            return Refusal(ErrorCode.REPLACE_MISSED, "the request it replaces is no longer queued")
        rid = request_id if new_id is None else new_id
        if rid != request_id and rid in self._entries:
            raise DuplicateRequest(f"request id {rid!r} is already in flight")
        old = e.request
        tenant = self._tenant(old.tenant)
        if tenant is None:
            return Refusal(ErrorCode.FORBIDDEN, f"unknown tenant {old.tenant!r}")
        q = self.quotas.check(tenant, old.cost, now)
        if q is not None:
            return q
        flow, i = self._find(old, e.seq)
        promised = self._promises[old.priority].promised(old.deadline, e.seq) if self._deadlines else -math.inf
        tag = self._tag.get(old.tenant)
        self._unlink_queued(flow, i)
        self._forget(old)
        request = Request(id=rid, session=old.session, tenant=old.tenant, cls=old.cls, cost=old.cost,
                          deadline=max(deadline, old.deadline), priority=old.priority, payload=payload)
        self._enqueue(request, now, promised, seq=e.seq)
        if tag is not None:
            self._tag[old.tenant] = tag  # its tenant's fair-queueing place is kept too
        self.quotas.acquire(tenant, old.cost, now)
        self.quotas.release(old.tenant, old.cost, now, used_tokens=0)
        return Admitted(request, now, promised)

    def check(self, request: Request, now: float) -> Refusal | None:
        """The refusal :meth:`offer` would give ``request`` at ``now``, or ``None`` if it would
        admit it; changes nothing.

        Everything admission weighs is in the request's header (tenant, class, cost, deadline,
        priority), never its content, so a shell can ask before it has decoded the content and
        answer a refusal without paying for the decode. The rules are the very ones
        :meth:`offer` applies, except that work overdue in the queue is still counted: call
        :meth:`expire` first (as :meth:`offer` does) for the exact answer :meth:`offer` gives.

        Args:
            request: the request (its ``id`` is not looked at).
            now: current time.

        Raises:
            ValueError: the deadline is not a finite number.
        """
        if not math.isfinite(request.deadline):
            raise ValueError("a request needs a finite deadline (see resolve_deadline)")
        verdict = self._judge(request, now)
        return verdict if isinstance(verdict, Refusal) else None

    def _judge(self, request: Request, now: float) -> Refusal | Verdict:
        """Admission's rules, without side effects: a refusal, or the tenant, the flow to evict
        one request from (a full queue), the predicted start and completion, and the slot every
        queued request it overtakes moves (``None`` when its level has no queued promise)."""
        tenant = self._tenant(request.tenant)
        if tenant is None:
            return Refusal(ErrorCode.FORBIDDEN, f"unknown tenant {request.tenant!r}")
        deadlines = self._deadlines
        if deadlines and request.deadline <= now:
            return Refusal(ErrorCode.DEADLINE_UNMEETABLE, "deadline already passed on receipt")
        q = self.quotas.check(tenant, request.cost, now)
        if q is not None:
            if q.retry_after_ms is None and q.limit is QuotaLimit.MAX_IN_FLIGHT:
                return Refusal(q.code, q.message, self._retry_after_ms(now), q.limit)
            return q
        victim: Flow | None = None
        if self.queued >= self._config.max_queue:
            victim = self._victim(request, tenant)
            if victim is None:
                return Refusal(
                    ErrorCode.OVERLOADED,
                    f"queue for {self.model!r} is full ({self._config.max_queue} waiting)",
                    self._retry_after_ms(now),
                )
        # Sessions refused earlier, trusted to come back when told and told to before this one,
        # count as queued ahead of it (they will be, in EDF order, with budgets like its own): a
        # session that resends at once, or reconnects, does not take the room they were promised.
        # An empty line has no place ahead of anyone: skip working out its grace.
        line = float(self.retry_line.ahead_of(request.session, now, self._line_slot_grace()[1])) if len(self.retry_line) else 0.0
        start, completion = self._predict(request, tenant, now, line)
        if deadlines and completion > request.deadline:
            # The work ahead drains on its own schedule: the same budget fits once it starts
            # later by the amount it is short now -- unless one batch alone takes longer than the
            # budget, when no wait helps and no retry time is given.
            alone = self.service.occupancy(1)
            short_ms = (completion - request.deadline) * 1000.0
            return Refusal(
                ErrorCode.DEADLINE_UNMEETABLE,
                f"predicted to finish in {(completion - now) * 1000:.1f} ms, budget is {(request.deadline - now) * 1000:.1f} ms",
                max(1.0, short_ms) if now + alone <= request.deadline else None,
            )
        # (a level with nothing queued has no promise: no call to the promises' length)
        promises = self._promises.get(request.priority) if deadlines and request.priority in self._level_count else None
        slot: float | None = None
        if promises is not None:
            # Its place is ahead of every queued request with a later deadline at its level:
            # each of those finishes one slot later. Admitted work keeps its promise: if one of
            # them has no slot to spare, this request waits until they have started.
            slot = self._slot()
            broken = promises.breaking(request.deadline, slot)
            if broken:
                last_start = max(broken) - self.service.occupancy(self._bsize)
                return Refusal(
                    ErrorCode.DEADLINE_UNMEETABLE,
                    f"admitting it now would make {len(broken)} admitted request(s) with later deadlines miss theirs",
                    max(1.0, (last_start - now) * 1000.0),
                )
        return Verdict(tenant, victim, start, completion, slot)

    def appoint(self, refusal: Refusal, session: str, now: float) -> Refusal:
        """The refusal to send ``session`` for a request :meth:`offer` or :meth:`check` refused
        at ``now``: an ``overloaded`` or ``deadline_unmeetable`` refusal with a retry time gets
        the session's own time in the retry line instead (see :mod:`.retry_line`): the earliest
        time admission gives, or a slot after the last reserved place, whichever is later (a
        session refused again keeps its place). Other refusals are returned as they are. Call it
        once per refusal answered.

        Args:
            refusal: what :meth:`offer` or :meth:`check` returned.
            session: who sent the request.
            now: the time of that decision.
        """
        if refusal.retry_after_ms is None or refusal.code not in _LINED or refusal.limit is not None:
            return refusal
        slot, grace = self._line_slot_grace()
        at = self.retry_line.appoint(session, now + refusal.retry_after_ms / 1000.0, now, slot, grace)
        retry_after_ms = max(1.0, (at - now) * 1000.0)
        if retry_after_ms == refusal.retry_after_ms:
            return refusal
        return Refusal(refusal.code, refusal.message, retry_after_ms, refusal.limit)

    def _line_slot_grace(self) -> tuple[float, float]:
        """The retry line's spacing (how often, on average, the model takes one more request)
        and how long a place is kept for a session that has not come back."""
        b, workers = self._bsize, self._workers
        slot = self.service.mean_occupancy(b) / (b * workers)
        return slot, max(slot, RETRY_GRACE_S)

    def _slot(self) -> float:
        """How much later a queued request finishes when one more is queued ahead of it: a
        batch's planned occupancy shared by the requests the workers run at once."""
        b, workers = self._bsize, self._workers
        return self.service.occupancy(b) / (b * workers)

    def _victim(self, request: Request, tenant: TenantInfo) -> Flow | None:
        lowest = min(self._levels)
        if lowest < request.priority:
            flows = self._levels[lowest].values()
            return max(flows, key=lambda f: (len(f.items) / self._weight(f.tenant), f.tenant))
        level = self._levels.get(request.priority)
        if not level:
            return None
        own = level.get(request.tenant)
        own_load = ((len(own.items) if own else 0) + 1) / tenant.weight
        best: Flow | None = None
        best_load = own_load
        for f in level.values():
            if f.tenant == request.tenant:
                continue
            load = len(f.items) / self._weight(f.tenant)
            # Strictly more loaded than the newcomer would be: evictions converge, never ping-pong.
            if load > best_load or (best is not None and load == best_load and f.tenant > best.tenant):
                best, best_load = f, load
        return best

    def _predict(self, request: Request, tenant: TenantInfo, now: float, line: float = 0.0) -> tuple[float, float]:
        """When ``request`` would start and finish: after the work queued and expected ahead of it
        (``line``: sessions in the retry line before its own, counted as queued ahead of it)."""
        p, t = request.priority, request.tenant
        counts = self._level_count
        ahead = line
        if len(counts) > 1 or (counts and p not in counts):  # (a higher level may be queued)
            ahead += float(sum(n for lvl, n in counts.items() if lvl > p))
        level = self._levels.get(p)
        own = level.get(t) if level else None
        own_work = 0.0
        if own is not None:
            # items with deadline <= d (FIFO among equals): keys -deadline >= -d, at the end
            n_own = len(own.items)
            own_ahead = n_own - bisect.bisect_left(own.items, (-request.deadline,))
            own_work = own_ahead * own.work / n_own
            ahead += own_ahead
        rates = self._rates
        future: list[tuple[float, float]] = []
        # Others' work counts only where there are others (queued, or arriving at any level).
        if (level is not None and len(level) > (own is not None)) or len(rates) > ((p, t) in rates):
            ahead += self._others_ahead(request, self._start_tag(t) + own_work / tenant.weight, now, future)
        b = self._bsize
        # (_start_time's first case tested here, without the call: a request that rides in the
        # first batch while a worker is idle starts now)
        start = now if ahead < b and len(self._batches) < self._workers else self._start_time(ahead, now)
        total = ahead
        if future:
            # Fixed point: the longer this request waits, the more of the others' arrivals go first.
            for _ in range(6):
                wait = start - now
                total = ahead + sum(min(r * wait, c) for r, c in future)
                later = self._start_time(total, now)
                if later <= start + EPS:
                    break
                start = later
        size = self.queued + 1 if total < b and self.queued + 1 < b else b  # (min(), compared)
        return start, start + self.service.occupancy(size)

    def _others_ahead(self, request: Request, virtual_start: float, now: float, future: list[tuple[float, float]]) -> float:
        """Other tenants' queued work that runs before ``request`` (whose tag would start at
        ``virtual_start``); their arrivals that will overtake it while it waits are appended to
        ``future`` as (items per second, most items), higher levels' as (rate, inf)."""
        p, d, t = request.priority, request.deadline, request.tenant
        tau = ARRIVAL_WINDOW_S
        slack = self.selector.fairness_slack
        ahead = 0.0
        higher_rate = 0.0
        level = self._levels.get(p, {})
        others: dict[str, tuple[Flow | None, TenantWorkRate | None]] = {u: (f, None) for u, f in level.items() if u != t}
        for (lvl, u), flow_rate in self._rates.items():
            if lvl > p:
                higher_rate += flow_rate.now(now, tau)[0]
            elif lvl == p and u != t:
                others[u] = (others.get(u, (None, None))[0], flow_rate)
        for u, (f, rate) in others.items():
            items_rate, work_rate = rate.now(now, tau) if rate is not None else (0.0, 0.0)
            queued = len(f.items) if f is not None else 0
            # Another tenant's work can go first only while its start tag is within the slack of
            # this request's: an upper bound on how much of it, queued or still to come, runs before.
            window = virtual_start + slack - self._start_tag(u)
            if math.isinf(window):
                if f is not None:  # plain EDF: only earlier deadlines go first
                    ahead += len(f.items) - bisect.bisect_left(f.items, (-d,))
                continue
            if window < 0:
                continue
            if f is not None and queued:
                avg = f.work / queued
            else:
                avg = work_rate / items_rate if items_rate > 0 else 1.0
            cap = float(int(window * self._weight(u) / max(avg, 1e-12)) + 1)
            now_ahead = min(float(queued), cap)
            ahead += now_ahead
            if items_rate > 0 and cap > now_ahead:
                future.append((items_rate, cap - now_ahead))
        if higher_rate > 0:
            future.append((higher_rate, math.inf))
        return ahead

    def _start_time(self, ahead: float, now: float) -> float:
        b, workers = self._bsize, self._workers
        if ahead < b and len(self._batches) < workers:
            return now  # it rides in the first batch, and a worker is idle
        k = int(ahead // b)  # this request rides in the k-th batch from now
        s_full = self.service.occupancy(b)
        # When each worker is next free: now for idle ones, else its running batch's predicted end.
        ends = sorted([x.predicted_end if x.predicted_end > now else now for x in self._batches.values()])
        avail = ([now] * (workers - len(ends)) + ends)[:workers] if len(ends) < workers else ends[:workers]
        return avail[k % workers] + (k // workers) * s_full

    def _retry_after_ms(self, now: float) -> float:
        # When a queue slot is likely to open: the next running batch's end, or one batch's time.
        ends = [b.predicted_end for b in self._batches.values()]
        wait = (min(ends) - now) if ends else self.service.occupancy(self._bsize)
        return max(1.0, wait * 1000.0)

    def _count_admitted(self, request: Request, tenant: TenantInfo, now: float) -> None:
        """What admitting ``request`` uses up and tells: its quota, its session's place in the retry
        line, its tenant's arrival rate."""
        self.quotas.acquire(tenant, request.cost, now)
        if len(self.retry_line):
            self.retry_line.admitted(request.session, now, self._line_slot_grace()[0])
        key = (request.priority, request.tenant)
        rate = self._rates.get(key)
        if rate is None:
            # A flow's first arrival opens its window and is no evidence of a rate (n arrivals span
            # n - 1 intervals): counted, ten robots of ten tenants starting at once would each
            # foresee ten more per second from every other and refuse one another.
            self._new_rate(key, now)
        else:
            rate.add(now, ARRIVAL_WINDOW_S, request.cost.work)

    # ------------------------------------------------------------------ dispatch

    def wake_at(self) -> float:
        """When to offer a free worker again after :meth:`next_batch` took nothing because the
        selector chose to wait for requests it expects (``inf``: it did not wait)."""
        # What isinstance(selector, WaitingSelector) checks (its one member), without a runtime
        # protocol check's walk over every attribute of the class (it runs whenever a kick leaves
        # work queued with a worker free).
        resume_at: float = getattr(self.selector, "resume_at", math.inf)
        return resume_at

    def next_batch(self, now: float, max_size: int | None = None, compatible: Compatible | None = None) -> list[Request]:
        """Take the next requests to run together (the selector's choice), and mark them running.

        Drops expired work first (see :meth:`take_dropped`). Every request returned has its
        deadline ahead of ``now``.

        Args:
            now: current time.
            max_size: most requests (default ``max_batch_size``); also bounded by free concurrency.
            compatible: ``compatible(first, other)`` says whether ``other`` may join a batch that
                starts with ``first``; a queue whose head is incompatible waits for a later batch.
        """
        self.expire(now)
        limit = self._config.max_batch_size if max_size is None else max_size
        if limit < 1 or not self.queued or self._running >= self._conc:
            return []
        picked = self.selector.select(self, now, limit, compatible)
        if picked:
            self._take(picked, now)
        return picked
