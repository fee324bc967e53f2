"""Admission and scheduling for one model (sans-I/O): refuse early, queue by deadline, share fairly.

One :class:`AdmissionController` per served model, shared by every request class: a class plugs
in its cost (:class:`~chunkline.server.core.quotas.PolicyCost`: one batch slot;
:class:`~chunkline.server.core.quotas.TextCost`: prompt + max_tokens) and builds its own reply; the
rules below are the same for both. Nothing here sleeps, reads a clock or starts a thread: every
call takes ``now`` (seconds on the server's monotonic clock) and deadlines are absolute times on
that same clock.

How the asyncio shell drives it:

1. On each decoded, validated request: ``resolve_deadline(...)`` turns the budget (or the
   tenant's / policy's default) into an absolute deadline, then ``controller.offer(request, now)``.
   A :class:`~chunkline.server.errors.Refusal` is answered at once (``code``, ``reason``,
   ``retry_after_ms``), through ``controller.appoint(refusal, session, now)`` for the session's
   place in the retry line. Since
   nothing here looks at a request's content, ``controller.check(request, now)`` gives the same
   verdict without admitting: a shell may ask it before decoding an observation, and answer a
   refusal without paying for the decode.
2. Whenever a worker for the model is free and ``controller.queued > 0`` (wake it after an
   admission): ``batch = controller.next_batch(now, max_size, compatible)``; run it off the loop.
   When it returns: ``controller.complete_batch(batch, now, service_time)`` (policy) or
   ``controller.complete(request, now, service_time=..., used_tokens=...)`` per sequence (text).
3. After every call, ``controller.take_dropped()`` lists queued requests that were removed
   without running (deadline passed: ``deadline_exceeded``; evicted for a tenant under its fair
   share: ``overloaded``); answer each. To answer expired work promptly while the worker is busy,
   schedule ``controller.expire(now)`` at ``controller.next_expiry()``.
4. ``cancel(request_id, now)`` on a client cancel, ``cancel_session(session, now)`` on a
   disconnect; a ``RUNNING`` outcome means the backend should be told, where it can stop.

Scheduling: strict priority between levels (higher first). Within a level, tenants share by
weighted fair queueing (start-time tags in units of ``cost.work / weight``); among the tenants
whose tag is within ``fairness_slack`` of the least-served one, the earliest deadline goes first,
so with balanced load the order is plain EDF and a tenant's burst only delays others by the
slack. Within one tenant and level the order is always EDF (ties first come, first served).

Admission predicts completion: the requests that will run before the new one (higher levels,
then its own earlier deadlines, then other tenants' work up to the fair-share bound, including
the part of their expected arrivals, from a moving arrival-rate estimate, that will overtake it
while it waits, and the sessions in the retry line before its own), in batches of
``max_batch_size`` on ``workers`` workers, each batch holding its worker for the
:class:`ServiceTimeModel`'s occupancy (the batch's estimate plus the hand-off to the worker and
back, learned from each completion). A request predicted to miss its deadline is refused
(``deadline_unmeetable``) rather than admitted and dropped later. A full
queue refuses (``overloaded`` + ``retry_after_ms``), except that a tenant under its weighted share
of the queue takes the place of the latest-deadline request of the tenant most over its share.

An admission is a promise: each queued request keeps its predicted completion, moved a slot later
each time a request with an earlier deadline is admitted ahead of it (at its priority), and a
request whose admission would push one of them past its deadline is refused
(``deadline_unmeetable``, retry once they have started). The retry times of refusals that waiting
cures come from the model's :class:`~.retry_line.RetryLine` (:meth:`AdmissionController.appoint`):
sessions that come back when told are lined up one after another, their places reserved (counted
ahead of later sessions), rather than all told the same time.

One responsibility, one module: every method reads and updates the same queue state (flows,
fairness tags, running batches, arrival rates), so splitting it further would only spread that
state over several files.

Costs: ``offer`` is O(F log n + B + m / B) where F is the number of (priority, tenant) queues,
n the queue length, m the queued requests it would overtake (none when deadlines arrive in order,
the usual case) and B the promises' block size (:mod:`.promises`; sorted lists with
:mod:`bisect`, inserting moves at most ``max_queue`` pointers); ``next_batch`` is
O(batch size x (F + log n + B)). ``python -m chunkline.bench.admission_bench`` (one tenant,
batches of 8): at depth 512 a newcomer that overtakes the whole queue takes 28 us at the median,
8 us more than one that overtakes nothing (128 us when each promise was moved one by one), and
33 us at 4096 (2.2 ms before).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Mapping

from chunkline.client.exceptions import ErrorCode
from chunkline.server.core.admission.config import AdmissionConfig, AdmissionPolicy
from chunkline.server.core.admission.decisions import (
    Admitted,
    CancelOutcome,
    Dropped,
    DuplicateRequest,
    Request,
    UnknownRequest,
)
from chunkline.server.core.admission.flows import EPS, Entry, EntryState, Flow, RunningBatch, TenantWorkRate
from chunkline.server.core.admission.promises import Promises
from chunkline.server.core.admission.retry_line import RetryLine
from chunkline.server.core.admission.service_time import ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.errors import QuotaLimit, Refusal

__all__ = ["AdmissionConfig", "AdmissionController", "AdmissionPolicy", "BatchChooser"]

#: ``chooser(queued, now, most, latency)``: which of the ``queued`` requests (at most ``most``) run
#: next, in order; ``latency(size)`` is a batch's planned occupancy. See ``batch_chooser``.
BatchChooser = Callable[[list[Request], float, int, Callable[[int], float]], list[Request]]

#: Refusals whose retry times are handed out one session after another (see :meth:`AdmissionController.appoint`).
_LINED = frozenset({ErrorCode.OVERLOADED, ErrorCode.DEADLINE_UNMEETABLE})


class AdmissionController:
    """Admission, queueing and batch selection for one model.

    Args:
        model: the model's name (checked against tenants' allowed models).
        quotas: the shared per-tenant quotas; its registry supplies weights and priorities.
        config: see :class:`AdmissionConfig`.
        service: the service-time model (one is created if not given).
    """

    def __init__(
        self,
        model: str,
        quotas: QuotaManager,
        config: AdmissionConfig | None = None,
        service: ServiceTimeModel | None = None,
    ) -> None:
        self.model = model
        self.quotas = quotas
        self.config = config if config is not None else AdmissionConfig()  # sets the _config-derived values below
        self.service = service if service is not None else ServiceTimeModel()
        self._levels: dict[int, dict[str, Flow]] = {}
        self._level_count: dict[int, int] = {}
        self._entries: dict[Hashable, Entry] = {}
        self._by_session: dict[str, set[Hashable]] = {}
        self._tenant_queued: dict[str, int] = {}
        self._tenant_running: dict[str, int] = {}
        self._tag: dict[str, float] = {}
        self._vclock = 0.0
        #: Requests waiting. A plain attribute, not a property: the runner reads it several times per
        #: request (a property is a Python call each time). Only this class writes it.
        self.queued = 0
        self._running = 0
        self._seq = 0
        self._batch_seq = 0
        self._batches: dict[int, RunningBatch] = {}
        self._dropped: list[Dropped] = []
        # What admission reads of the tenants registry, derived once per registry (it is
        # immutable; a reload swaps in a new one) and per concurrency: see _registry_derived.
        self._registry_src: object = None
        self._reserved: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        self._rates: dict[tuple[int, str], TenantWorkRate] = {}
        #: per priority level, the queued requests' promised completions (deadline-aware only); a
        #: newcomer moves only its own level's: a lower level runs after it anyway, by design
        self._promises: dict[int, Promises] = {}
        # A lower bound on the earliest queued deadline (removals only raise the true minimum):
        # expire() has nothing to do while now + late threshold is below it.
        self._expiry_hint = math.inf
        #: the retry times handed out to refused sessions (see :meth:`appoint`)
        self.retry_line = RetryLine()
        #: a strategy that chooses each batch in place of the fair-share EDF pick (``None``: that pick)
        self.batch_chooser: BatchChooser | None = None

    # ------------------------------------------------------------------ state

    @property
    def config(self) -> AdmissionConfig:
        """The settings in force (see :class:`AdmissionConfig`)."""
        return self._config

    @config.setter
    def config(self, config: AdmissionConfig) -> None:
        # What every request reads from the settings, derived once here rather than through the
        # config's properties on each call.
        self._config = config
        self._deadlines = config.enforces_deadlines
        self._conc = config.concurrency
        self._bsize = max(1, min(config.max_batch_size, self._conc))
        self._workers = max(1, min(config.workers, self._conc // self._bsize))
        self._registry_src = None

    @property
    def running(self) -> int:
        """Request slots running."""
        return self._running

    def queued_for(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting."""
        return self._tenant_queued.get(tenant, 0)

    def running_for(self, tenant: str) -> int:
        """Slots of ``tenant`` running."""
        return self._tenant_running.get(tenant, 0)

    def is_cancelled(self, request_id: Hashable) -> bool:
        """Whether a running request was cancelled (its result should be discarded)."""
        e = self._entries.get(request_id)
        return e is not None and e.cancelled

    def take_dropped(self) -> list[Dropped]:
        """Queued requests removed without running since the last call; answer each."""
        out, self._dropped = self._dropped, []
        return out

    def next_expiry(self) -> float | None:
        """When the next queued request will be dropped if not run by then (``None``: queue empty,
        or the FIFO baseline, which drops nothing)."""
        if not self._deadlines or not self.queued:
            return None
        thr = self._late_threshold()
        best: float | None = None
        for flows in self._levels.values():
            for f in flows.values():
                t = f.head_deadline() - thr
                if best is None or t < best:
                    best = t
        return best

    # ------------------------------------------------------------------ helpers

    def _tenant(self, name: str) -> TenantInfo | None:
        return self.quotas.registry.get(name)

    def _weight(self, name: str) -> float:
        self._registry_derived()
        return self._weights.get(name, 1.0)  # an unknown tenant (removed by a reload) weighs 1

    def _late_threshold(self) -> float:
        return self.service.mean(1) if self._config.drop_late else 0.0

    def _reservations(self) -> dict[str, int]:
        self._registry_derived()
        return self._reserved

    def _registry_derived(self) -> None:
        """Tenants' weights and reserved slots, recomputed when the registry or the concurrency
        changed (both are read once per dispatched request)."""
        reg = self.quotas.registry
        if reg is self._registry_src:
            return
        c = self._conc
        self._weights = {name: t.weight for name, t in reg.tenants.items()}
        self._reserved = {
            name: int(math.floor(t.reserved_share * c + 1e-9))
            for name, t in reg.tenants.items()
            if t.reserved_share > 0 and math.floor(t.reserved_share * c + 1e-9) > 0
        }
        self._registry_src = reg

    def _start_tag(self, tenant: str) -> float:
        # A tenant that was idle restarts at the system's virtual time: no credit for idleness.
        if self._tenant_queued.get(tenant, 0) > 0:
            return self._tag.get(tenant, self._vclock)
        return max(self._tag.get(tenant, self._vclock), self._vclock)

    def _new_entry(self, request: Request) -> Entry:
        """The request's entry (queued), known by its id and its session."""
        self._seq += 1
        entry = Entry(request, self._seq)
        self._entries[request.id] = entry
        # (get, then create: setdefault would build a container on every call, used or not)
        ids = self._by_session.get(request.session)
        if ids is None:
            ids = self._by_session[request.session] = set()
        ids.add(request.id)
        return entry

    def _count_admitted(self, request: Request, tenant: TenantInfo, now: float) -> None:
        """What admitting ``request`` uses up and tells: its quota, its session's place in the retry
        line, its tenant's arrival rate."""
        self.quotas.acquire(tenant, request.cost, now)
        if len(self.retry_line):
            self.retry_line.admitted(request.session, now, self._line_slot_grace()[0])
        if self._config.arrival_window_s > 0:
            key = (request.priority, request.tenant)
            rate = self._rates.get(key)
            if rate is None:
                # A flow's first arrival opens its window and is no evidence of a rate (n arrivals
                # span n - 1 intervals): counted, ten robots of ten tenants starting at once would
                # each foresee ten more per second from every other and refuse one another.
                self._rates[key] = TenantWorkRate(now)
            else:
                rate.add(now, self._config.arrival_window_s, request.cost.work)

    def _enqueue(self, request: Request, now: float, promised: float = -math.inf) -> None:
        entry = self._new_entry(request)
        t, p = request.tenant, request.priority
        queued = self._tenant_queued.get(t, 0)
        if queued == 0:
            self._tag[t] = self._start_tag(t)
        flows = self._levels.get(p)
        if flows is None:
            flows = self._levels[p] = {}
        flow = flows.get(t)
        if flow is None:
            flow = flows[t] = Flow(p, t)
        # The queue is ordered by deadline; in the FIFO baseline by arrival time instead.
        order = request.deadline if self._deadlines else now
        bisect.insort(flow.items, (-order, -entry.seq, request))
        if self._deadlines:
            promises = self._promises.get(p)
            if promises is None:
                promises = self._promises[p] = Promises()
            promises.add(request.deadline, entry.seq, promised)
        if request.deadline < self._expiry_hint:
            self._expiry_hint = request.deadline
        flow.work += request.cost.work
        self._level_count[p] = self._level_count.get(p, 0) + 1
        self._tenant_queued[t] = queued + 1
        self.queued += 1

    def _unlink_queued(self, flow: Flow, index: int) -> Request:
        _, neg_seq, request = flow.items.pop(index)
        if self._deadlines:
            promises = self._promises[flow.priority]
            promises.remove(request.deadline, -neg_seq)
            if not promises:
                del self._promises[flow.priority]
        flow.work -= request.cost.work
        if not flow.items:
            flow.work = 0.0  # no float residue in an empty flow
            flows = self._levels[flow.priority]
            del flows[flow.tenant]
            if not flows:
                del self._levels[flow.priority]
        self._level_count[flow.priority] -= 1
        if self._level_count[flow.priority] == 0:
            del self._level_count[flow.priority]
        self._tenant_queued[flow.tenant] -= 1
        if self._tenant_queued[flow.tenant] == 0:
            del self._tenant_queued[flow.tenant]
        self.queued -= 1
        return request

    def _forget(self, request: Request) -> None:
        self._entries.pop(request.id, None)
        ids = self._by_session.get(request.session)
        if ids is not None:
            ids.discard(request.id)
            if not ids:
                del self._by_session[request.session]

    def _drop_queued(self, flow: Flow, index: int, now: float, code: ErrorCode, reason: str, retry_after_ms: float | None = None) -> None:
        request = self._unlink_queued(flow, index)
        self._forget(request)
        self.quotas.release(request.tenant, request.cost, now, used_tokens=0)
        self._dropped.append(Dropped(request, code, reason, retry_after_ms))

    def _find(self, request: Request, seq: int) -> tuple[Flow, int]:
        flow = self._levels[request.priority][request.tenant]
        i = bisect.bisect_left(flow.items, (-request.deadline, -seq))
        if i >= len(flow.items) or flow.items[i][1] != -seq:  # pragma: no cover - internal invariant
            raise RuntimeError("admission queue index out of sync")
        return flow, i

    def set_max_batch_size(self, size: int) -> None:
        """Serve at most ``size`` requests per batch from now on (a larger batch ran out of device
        memory or hung); tenants' reserved slots follow the smaller concurrency."""
        self.config = dataclasses.replace(self._config, max_batch_size=size)

    def occupy_worker(self, now: float, seconds: float) -> int:
        """A worker is busy until about ``now + seconds`` with work of no request (a timing pass):
        admission plans around it as around a running batch. Returns the token for
        :meth:`release_worker`."""
        self._batch_seq += 1
        self._batches[self._batch_seq] = RunningBatch(now, 0, now + seconds)
        return self._batch_seq

    def release_worker(self, token: int) -> None:
        """The work :meth:`occupy_worker` announced has ended."""
        self._batches.pop(token, None)

    def _retry_after_ms(self, now: float) -> float:
        # When a queue slot is likely to open: the next running batch's end, or one batch's time.
        ends = [b.predicted_end for b in self._batches.values()]
        wait = (min(ends) - now) if ends else self.service.occupancy(self._bsize)
        return max(1.0, wait * 1000.0)

    # ------------------------------------------------------------------ expiry

    def expire(self, now: float) -> None:
        """Drop every queued request whose deadline has passed (or, with ``drop_late``, cannot be
        met even by a batch of one). The drops are reported by :meth:`take_dropped`. The FIFO
        baseline drops nothing."""
        if not self.queued or not self._deadlines:
            self._expiry_hint = math.inf
            return
        thr = self._late_threshold()
        if now + thr < self._expiry_hint:
            return  # nothing can be due yet: skip the sweep over every queue
        hint = math.inf
        for flows in list(self._levels.values()):
            for flow in list(flows.values()):
                while flow.items and (flow.head_deadline() <= now or flow.head_deadline() < now + thr - EPS):
                    late = flow.head_deadline() > now
                    reason = (
                        f"cannot finish before its deadline (one batch takes about {thr * 1000:.1f} ms)"
                        if late
                        else "deadline passed while queued"
                    )
                    self._drop_queued(flow, len(flow.items) - 1, now, ErrorCode.DEADLINE_EXCEEDED, reason)
                if flow.items:
                    hint = min(hint, flow.head_deadline())
        self._expiry_hint = hint

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
        self.expire(now)
        verdict = self._judge(request, now)
        if isinstance(verdict, Refusal):
            return verdict
        tenant, victim, start, completion, slot = verdict
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
        self._count_admitted(request, tenant, now)
        return Admitted(request, start, completion)

    def offer_alone(self, request: Request, now: float) -> Refusal | bool:
        """:meth:`offer` then :meth:`next_batch`, in one step, for a request that finds nothing
        queued: it runs at once in a batch of its own, or is refused.

        The common case of a lightly loaded model (one robot's request on an idle worker) then
        costs no queue: no flow, promise or tag is made for a request that would leave the queue
        in the same breath. Every rule and every count is :meth:`offer`'s and :meth:`next_batch`'s
        (the property tests hold the two paths to the same decisions and the same state).

        Returns:
            ``True``: admitted and running, as :meth:`next_batch` would have returned it (finish
            it with :meth:`complete_batch`). A :class:`Refusal`: what :meth:`offer` would answer,
            with no more changed than its refusal changes. ``False``: it would not start at once (something is queued, no slot
            is free, reserved slots are held for other tenants) or is not a valid offer; nothing
            changed: call :meth:`offer`, which queues it or says what is wrong.
        """
        if self.queued or request.id in self._entries or not math.isfinite(request.deadline):
            return False
        t, slots = request.tenant, request.cost.slots
        reserved = self._reservations()
        # next_batch's rule, with every queue empty and nothing picked yet (usually nobody reserves)
        held = self._held_for_others(t, reserved, {}) if reserved else 0
        if self._conc - self._running - held < slots:
            return False
        self._expiry_hint = math.inf  # what expire() does to an empty queue
        verdict = self._judge(request, now)
        if isinstance(verdict, Refusal):
            return verdict
        self._count_admitted(request, verdict[0], now)
        # _enqueue() and next_batch() with nobody else queued: the tenant's tag restarts at the
        # virtual time and moves on by this request's work; nobody is backlogged afterwards, so
        # the virtual time advances past every tag and the tags are forgotten.
        tag = self._start_tag(t) + request.cost.work / self._weight(t)
        tags = self._tag
        self._vclock = max(self._vclock, tag, *tags.values()) if tags else max(self._vclock, tag)
        tags.clear()
        if self._rates:
            self._prune_rates(now)
        entry = self._new_entry(request)
        self._batch_seq += 1
        self._batches[self._batch_seq] = RunningBatch(now, 1, now + self.service.occupancy(1))
        entry.state = EntryState.RUNNING
        entry.batch = self._batch_seq
        self._tenant_running[t] = self._tenant_running.get(t, 0) + slots
        self._running += slots
        return True

    def _held_for_others(self, tenant: str, reserved: dict[str, int], picked: dict[str, int]) -> int:
        """Slots other tenants reserve and do not use (running, or ``picked`` into the batch being
        formed), which ``tenant``'s work may not take; a tenant with nothing queued lends its
        reservation when ``lend_reserved`` is set."""
        lend = self._config.lend_reserved
        held = 0
        for name, slots in reserved.items():
            if name == tenant or (lend and self._tenant_queued.get(name, 0) == 0):
                continue
            held += max(0, slots - self._tenant_running.get(name, 0) - picked.get(name, 0))
        return held

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

    def _judge(self, request: Request, now: float) -> Refusal | tuple[TenantInfo, Flow | None, float, float, float | None]:
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
        line = self.retry_line.ahead_of(request.session, now, self._line_slot_grace()[1]) if len(self.retry_line) else 0
        start, completion = self._predict(request, tenant, now, float(line))
        if deadlines and completion + self._config.margin_s > request.deadline:
            # The work ahead drains on its own schedule: the same budget fits once it starts
            # later by the amount it is short now -- unless one batch alone takes longer than the
            # budget, when no wait helps and no retry time is given.
            alone = self.service.occupancy(1) + self._config.margin_s
            short_ms = (completion + self._config.margin_s - request.deadline) * 1000.0
            return Refusal(
                ErrorCode.DEADLINE_UNMEETABLE,
                f"predicted to finish in {(completion - now) * 1000:.1f} ms, budget is {(request.deadline - now) * 1000:.1f} ms",
                max(1.0, short_ms) if now + alone <= request.deadline else None,
            )
        promises = self._promises.get(request.priority) if deadlines else None
        slot: float | None = None
        if promises is not None:
            # Its place is ahead of every queued request with a later deadline at its level:
            # each of those finishes one slot later. Admitted work keeps its promise: if one of
            # them has no slot to spare, this request waits until they have started.
            slot = self._slot()
            broken = promises.breaking(request.deadline, slot, self._config.margin_s)
            if broken:
                last_start = max(broken) - self.service.occupancy(self._bsize)
                return Refusal(
                    ErrorCode.DEADLINE_UNMEETABLE,
                    f"admitting it now would make {len(broken)} admitted request(s) with later deadlines miss theirs",
                    max(1.0, (last_start - now) * 1000.0),
                )
        return tenant, victim, start, completion, slot

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
        return slot, max(slot, self._config.retry_grace_s)

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
        rates = self._rates
        p, t = request.priority, request.tenant
        levels = self._levels
        if (not rates or (len(rates) == 1 and (p, t) in rates)) and (
            not levels or (len(levels) == 1 and len(levels.get(p, ())) == 1 and t in levels[p])
        ):
            # Nothing queued but its own tenant's at its level and no one else's arrivals to
            # expect (one robot fleet, the usual case): only the line and its own earlier
            # deadlines go first. The general rule reaches the same answer, through every other
            # tenant's fair-share window and arrival rate.
            ahead = line
            own = levels[p][t] if levels else None
            if own is not None:
                ahead += len(own.items) - bisect.bisect_left(own.items, (-request.deadline,))
            start = self._start_time(ahead, now)
            b = self._bsize
            return start, start + self.service.occupancy(min(b, self.queued + 1) if ahead < b else b)
        return self._predict_queued(request, tenant, now, line)

    def _predict_queued(self, request: Request, tenant: TenantInfo, now: float, line: float = 0.0) -> tuple[float, float]:
        """:meth:`_predict`'s general rule: the work queued and expected ahead of ``request``
        (``line``: sessions in the retry line before its own, counted as queued ahead of it)."""
        p, d, t = request.priority, request.deadline, request.tenant
        tau = self._config.arrival_window_s
        ahead = line + float(sum(n for lvl, n in self._level_count.items() if lvl > p))
        # Work that has not arrived yet but will run first: (items per second, most items), and
        # the total rate of higher-priority arrivals (all of which run first).
        future: list[tuple[float, float]] = []
        higher_rate = 0.0
        level = self._levels.get(p, {})
        own = level.get(t)
        own_ahead = 0
        own_work = 0.0
        if own is not None:
            # items with deadline <= d (FIFO among equals): keys -deadline >= -d, at the end
            own_ahead = len(own.items) - bisect.bisect_left(own.items, (-d,))
            own_work = own_ahead * own.work / len(own.items)
        ahead += own_ahead
        virtual_start = self._start_tag(t) + own_work / tenant.weight
        slack = self._config.fairness_slack
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
        start = self._start_time(ahead, now)
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
        size = min(self._bsize, self.queued + 1) if total < self._bsize else self._bsize
        return start, start + self.service.occupancy(size)

    def _start_time(self, ahead: float, now: float) -> float:
        b, workers = self._bsize, self._workers
        if ahead < b and len(self._batches) < workers:
            return now  # it rides in the first batch, and a worker is idle
        k = int(ahead // b)  # this request rides in the k-th batch from now
        s_full = self.service.occupancy(b)
        # When each worker is next free: now for idle ones, else its running batch's predicted end.
        ends = sorted(max(now, x.predicted_end) for x in self._batches.values())
        avail = ([now] * (workers - len(ends)) + ends)[:workers] if len(ends) < workers else ends[:workers]
        return avail[k % workers] + (k // workers) * s_full

    # ------------------------------------------------------------------ dispatch

    def next_batch(
        self,
        now: float,
        max_size: int | None = None,
        compatible: Callable[[Request, Request], bool] | None = None,
    ) -> list[Request]:
        """Take the next requests to run together, and mark them running.

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
        if limit < 1 or not self.queued:
            return []
        if self.batch_chooser is not None:
            return self._next_batch_chosen(self.batch_chooser, now, limit, compatible)
        conc = self._conc
        reserved = self._reservations()
        picked: list[Request] = []
        picked_slots: dict[str, int] = {}
        used = self._running
        excluded: set[tuple[int, str]] = set()
        blocked: set[str] = set()
        slack = self._config.fairness_slack
        n = 0  # len(picked), kept rather than asked for at every turn
        while n < limit and used < conc:
            flow = self._pick(picked[0] if n else None, compatible, excluded, blocked, slack)
            if flow is None:
                break
            req = flow.items[-1][2]  # its head (Flow.head, inlined: once per request)
            slots = req.cost.slots
            t = flow.tenant
            held = self._held_for_others(t, reserved, picked_slots) if reserved else 0  # (usually nobody reserves)
            if conc - used - held < slots:
                blocked.add(t)
                continue
            self._unlink_queued(flow, -1)  # the head: the last item (list.pop(-1))
            self._tag[t] = self._tag.get(t, self._vclock) + req.cost.work / self._weight(t)
            picked.append(req)
            n += 1
            picked_slots[t] = picked_slots.get(t, 0) + slots
            used += slots
        if not n:
            return []
        return self._start_batch(picked, now)

    def _start_batch(self, picked: list[Request], now: float) -> list[Request]:
        """Mark ``picked`` (taken out of the queue) running as one batch."""
        n = len(picked)
        self._advance_vclock()
        if len(self._rates) > len(self._tenant_queued):
            self._prune_rates(now)
        self._batch_seq += 1
        batch = RunningBatch(now, n, now + self.service.occupancy(n))
        self._batches[self._batch_seq] = batch
        seq, entries, running = self._batch_seq, self._entries, self._tenant_running
        for req in picked:
            e = entries[req.id]
            e.state = EntryState.RUNNING
            e.batch = seq
            slots = req.cost.slots
            running[req.tenant] = running.get(req.tenant, 0) + slots
            self._running += slots
        return picked

    def _next_batch_chosen(self, chooser: BatchChooser, now: float, limit: int,
                           compatible: Callable[[Request, Request], bool] | None) -> list[Request]:
        """:meth:`next_batch` with ``batch_chooser`` set: it picks among the highest priority
        level's queued requests (strict priority holds); reserved shares are its to keep."""
        limit = min(limit, self._conc - self._running)
        if limit < 1:
            return []
        level = self._levels[max(self._levels)]
        queued = [item[2] for flow in level.values() for item in flow.items]
        picked: list[Request] = []
        for req in chooser(queued, now, limit, self.service.occupancy)[:limit]:
            e = self._entries.get(req.id)
            if e is None or e.state is not EntryState.QUEUED or (picked and compatible is not None and not compatible(picked[0], req)):
                continue
            flow, i = self._find(req, e.seq)
            self._unlink_queued(flow, i)
            self._tag[req.tenant] = self._tag.get(req.tenant, self._vclock) + req.cost.work / self._weight(req.tenant)
            picked.append(req)
        return self._start_batch(picked, now) if picked else []

    def _pick(
        self,
        first: Request | None,
        compatible: Callable[[Request, Request], bool] | None,
        excluded: set[tuple[int, str]],
        blocked: set[str],
        slack: float,
    ) -> Flow | None:
        levels = self._levels
        if len(levels) == 1:
            # One level, one tenant queued (one robot fleet, the usual case): its flow is the only
            # candidate, and the least served among candidates, whatever the tags and the slack.
            p = next(iter(levels))
            flows = levels[p]
            if len(flows) == 1:
                t = next(iter(flows))
                f = flows[t]
                if t in blocked or (excluded and (p, t) in excluded):
                    return None
                if first is not None and compatible is not None and not compatible(first, f.items[-1][2]):
                    excluded.add((p, t))
                    return None
                return f
        return self._pick_general(first, compatible, excluded, blocked, slack)

    def _pick_general(
        self,
        first: Request | None,
        compatible: Callable[[Request, Request], bool] | None,
        excluded: set[tuple[int, str]],
        blocked: set[str],
        slack: float,
    ) -> Flow | None:
        """:meth:`_pick`'s general rule: the highest level with a candidate, and among its
        candidates the earliest head deadline within ``slack`` of the least-served tag."""
        for p in sorted(self._levels, reverse=True):
            cands: list[Flow] = []
            for t, f in self._levels[p].items():
                if t in blocked or (p, t) in excluded:
                    continue
                if first is not None and compatible is not None and not compatible(first, f.head()):
                    excluded.add((p, t))
                    continue
                cands.append(f)
            if not cands:
                continue
            vmin = min(self._tag.get(f.tenant, self._vclock) for f in cands)
            best: Flow | None = None
            best_key: tuple[float, float, int] | None = None
            for f in cands:
                tag = self._tag.get(f.tenant, self._vclock)
                if tag > vmin + slack:
                    continue  # ahead of its fair share: waits while others catch up
                key = (f.head_deadline(), tag, -f.items[-1][1])
                if best_key is None or key < best_key:
                    best, best_key = f, key
            return best
        return None

    def _advance_vclock(self) -> None:
        backlogged = [self._tag.get(t, self._vclock) for t in self._tenant_queued]
        if backlogged:
            self._vclock = max(self._vclock, min(backlogged))
        elif self._tag:
            # Nobody waits: everyone restarts level, and tags of idle tenants can be forgotten.
            self._vclock = max(self._vclock, max(self._tag.values()))
            self._tag.clear()

    def _prune_rates(self, now: float) -> None:
        # Rates of flows idle for many time constants are zero in all but name: forget them.
        tau = self._config.arrival_window_s
        if tau > 0:
            for key in [k for k, r in self._rates.items() if now - r.stamp > 20 * tau]:
                del self._rates[key]

    # ------------------------------------------------------------------ completion and cancel

    def complete(
        self,
        request: Request,
        now: float,
        service_time: float | None = None,
        batch_size: int | None = None,
        used_tokens: int | None = None,
    ) -> None:
        """A running request finished (any outcome): free its slot and its quota.

        Args:
            request: the request, as returned by :meth:`next_batch`.
            now: current time.
            service_time: if given, fed to the service-time model (one sample per call: for a
                policy batch use :meth:`complete_batch` instead, which feeds one per batch).
            batch_size: the size ``service_time`` was measured at (default: its batch's size).
            used_tokens: text tokens actually used (reconciles the reservation); ``None`` counts
                the whole reservation.

        Raises:
            UnknownRequest: it is not running here.
        """
        e = self._entries.get(request.id)
        if e is None or e.state is not EntryState.RUNNING:
            raise UnknownRequest(request.id)
        self._forget(request)
        slots = request.cost.slots
        self._running -= slots
        left = self._tenant_running[request.tenant] - slots
        if left:
            self._tenant_running[request.tenant] = left
        else:
            del self._tenant_running[request.tenant]
        batch = self._batches.get(e.batch)
        size = batch.size if batch is not None else 1
        if batch is not None:
            batch.remaining -= 1
            if batch.remaining <= 0:
                del self._batches[e.batch]
        if service_time is not None:
            self.service.observe(batch_size if batch_size is not None else size, service_time)
        self.quotas.release(request.tenant, request.cost, now, used_tokens)

    def complete_batch(
        self,
        requests: Iterable[Request],
        now: float,
        service_time: float | None = None,
        used_tokens: Mapping[Hashable, int] | None = None,
    ) -> None:
        """A batch finished: :meth:`complete` each request and feed ``service_time`` once.

        Args:
            requests: the batch, as returned by :meth:`next_batch`.
            now: current time.
            service_time: how long the batch ran.
            used_tokens: per request id, tokens actually used (text).

        Raises:
            UnknownRequest: one of them is not running here (the others are still completed).
        """
        reqs = list(requests)
        started = self._started(reqs)
        missing: list[Hashable] = []
        for r in reqs:
            try:
                self.complete(r, now, used_tokens=None if used_tokens is None else used_tokens.get(r.id))
            except UnknownRequest:
                missing.append(r.id)
        if service_time is not None and reqs:
            self.service.observe(len(reqs), service_time)
            if started is not None:
                # The batch held its worker from next_batch to now: what is not its own run is
                # the hand-off there and back, which every planned batch will pay too.
                self.service.observe_handoff(now - started - service_time)
        if missing:
            raise UnknownRequest(missing[0])

    def _started(self, requests: list[Request]) -> float | None:
        """When the batch ``requests`` belong to was taken by :meth:`next_batch` (``None`` if unknown)."""
        if not requests:
            return None
        e = self._entries.get(requests[0].id)
        batch = self._batches.get(e.batch) if e is not None else None
        return batch.start if batch is not None else None

    def cancel(self, request_id: Hashable, now: float) -> CancelOutcome:
        """Cancel a request: removed if queued, flagged if running.

        Args:
            request_id: the server-unique id.
            now: current time.
        """
        e = self._entries.get(request_id)
        if e is None:
            return CancelOutcome.UNKNOWN
        if e.state is EntryState.RUNNING:
            e.cancelled = True
            return CancelOutcome.RUNNING
        flow, i = self._find(e.request, e.seq)
        self._unlink_queued(flow, i)
        self._forget(e.request)
        self.quotas.release(e.request.tenant, e.request.cost, now, used_tokens=0)
        return CancelOutcome.QUEUED

    def cancel_session(self, session: str, now: float) -> tuple[list[Request], list[Request]]:
        """Cancel everything of a session (it disconnected).

        Args:
            session: the session id.
            now: current time.

        Returns:
            ``(removed, running)``: requests taken out of the queue, and running requests now
            flagged cancelled (tell the backend; ``complete`` still follows for them).
        """
        removed: list[Request] = []
        running: list[Request] = []
        for rid in list(self._by_session.get(session, ())):
            e = self._entries[rid]
            outcome = self.cancel(rid, now)
            (removed if outcome is CancelOutcome.QUEUED else running).append(e.request)
        return removed, running
