"""One model's admission queue as data (sans-I/O): flows, entries, fair-queueing tags, running
batches, and the changes every rule makes to them (queue, take, expire, complete, cancel).

:class:`~.controller.AdmissionController` adds the rules on top: who is admitted, what is predicted,
which batch runs next (through its :class:`~.selection.BatchSelector`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Hashable, Iterable, Mapping

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.admission.config import AdmissionConfig
from chunkline.server.core.admission.decisions import CancelOutcome, Dropped, Request, UnknownRequest
from chunkline.server.core.admission.flows import EPS, Entry, EntryState, Flow, RunningBatch, TenantWorkRate
from chunkline.server.core.admission.promises import Promises
from chunkline.server.core.admission.service_time import ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantInfo

__all__ = ["ARRIVAL_WINDOW_S", "QueueBook"]

#: Time constant (seconds) of the per-tenant arrival-rate estimate with which admission foresees
#: other tenants' work arriving while a request waits: long enough to smooth a robot's control
#: period, short enough to follow a fleet that grows or shrinks.
ARRIVAL_WINDOW_S = 1.0
# The entry states as module constants: an enum member read through its class costs a lookup in
# the enum's metaclass, on the request path several times per request.
_QUEUED, _RUNNING = EntryState.QUEUED, EntryState.RUNNING


class QueueBook:
    """The queue state of one model and its consistent changes.

    It has some 25 instance attributes, on purpose: every admission and dispatch decision reads
    several of them together on the request path, so they are kept flat rather than grouped
    behind further objects.

    Args:
        model: the model's name.
        quotas: the shared per-tenant quotas; its registry supplies weights and reservations.
        config: see :class:`~.config.AdmissionConfig`.
        service: the service-time model.
    """

    def __init__(self, model: str, quotas: QuotaManager, config: AdmissionConfig, service: ServiceTimeModel) -> None:
        self.model = model
        self.quotas = quotas
        self.config = config  # sets the _config-derived values below
        self.service = service
        self._levels: dict[int, dict[str, Flow]] = {}
        self._level_count: dict[int, int] = {}
        self._entries: dict[Hashable, Entry] = {}
        self._by_session: dict[str, set[Hashable]] = {}
        self._tenant_queued: dict[str, int] = {}
        self._tenant_running: dict[str, int] = {}
        self._tag: dict[str, float] = {}
        self._vclock = 0.0
        #: Requests waiting (a plain attribute: read several times per request). Only this class writes it.
        self.queued = 0
        self._running = 0
        self._seq = 0
        self._batch_seq = 0
        self._batches: dict[int, RunningBatch] = {}
        #: Queued requests removed without running, not yet taken by :meth:`take_dropped` (a plain
        #: attribute: a shell reads it to skip an empty take). Only this class writes it.
        self.dropped: list[Dropped] = []
        # What admission reads of the tenants registry, derived once per registry (immutable; a
        # reload swaps in a new one) and per concurrency: see _registry_derived.
        self._registry_src: object = None
        self._reserved: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        self._rates: dict[tuple[int, str], TenantWorkRate] = {}
        # No rate is idle long enough to forget before this (stamps only move later): see _prune_rates.
        self._rates_prune_at = -math.inf
        #: per priority level, the queued requests' promised completions (deadline-aware only); a
        #: newcomer moves only its own level's: a lower level runs after it anyway, by design. A
        #: level's is kept when it empties (levels are the tenants' few priorities): an empty one
        #: promises nothing.
        self._promises: dict[int, Promises] = {}
        # A lower bound on the earliest queued deadline (removals only raise the true minimum).
        self._expiry_hint = math.inf

    @property
    def config(self) -> AdmissionConfig:
        """The settings in force (see :class:`AdmissionConfig`)."""
        return self._config

    @config.setter
    def config(self, config: AdmissionConfig) -> None:
        # What every request reads from the settings, derived once here rather than through the
        # config's properties on each call.
        self._config = config
        self._deadlines = config.deadlines
        self._drop_late = config.drop_late
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
        out, self.dropped = self.dropped, []
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

    def _tenant(self, name: str) -> TenantInfo | None:
        return self.quotas.registry.get(name)

    def _weight(self, name: str) -> float:
        self._registry_derived()
        return self._weights.get(name, 1.0)  # an unknown tenant (removed by a reload) weighs 1

    def _late_threshold(self) -> float:
        return self.service.mean(1) if self._drop_late else 0.0

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
        tag, vclock = self._tag.get(tenant, self._vclock), self._vclock
        if self._tenant_queued.get(tenant, 0) > 0 or tag >= vclock:
            return tag
        return vclock

    def _enqueue(self, request: Request, now: float, promised: float = -math.inf, seq: int | None = None) -> None:
        """Queue ``request``: its entry, known by its id and its session; ``seq``: the arrival
        order it takes (a replacement's is the one it replaces), else the next."""
        if seq is None:
            self._seq += 1
            seq = self._seq
        entry = Entry(request, seq)
        self._entries[request.id] = entry
        # (get, then create: setdefault would build a container on every call, used or not)
        ids = self._by_session.get(request.session)
        if ids is None:
            ids = self._by_session[request.session] = set()
        ids.add(request.id)
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
        bisect.insort(flow.items, (-request.deadline, -seq, request))
        if self._deadlines:
            promises = self._promises.get(p)
            if promises is None:
                promises = self._promises[p] = Promises()
            promises.add(request.deadline, seq, promised)
        if request.deadline < self._expiry_hint or not self.queued:  # (an empty queue's hint is stale)
            self._expiry_hint = request.deadline
        flow.work += request.cost.work
        self._level_count[p] = self._level_count.get(p, 0) + 1
        self._tenant_queued[t] = queued + 1
        self.queued += 1

    def _unlink_queued(self, flow: Flow, index: int) -> Request:
        p, t = flow.priority, flow.tenant
        _, neg_seq, request = flow.items.pop(index)
        if self._deadlines:
            self._promises[p].remove(request.deadline, -neg_seq)
        flow.work -= request.cost.work
        if not flow.items:
            flow.work = 0.0  # no float residue in an empty flow
            flows = self._levels[p]
            del flows[t]
            if not flows:
                del self._levels[p]
        counts, tenant_queued = self._level_count, self._tenant_queued
        left = counts[p] - 1
        if left:
            counts[p] = left
        else:
            del counts[p]
        left = tenant_queued[t] - 1
        if left:
            tenant_queued[t] = left
        else:
            del tenant_queued[t]
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
        self.dropped.append(Dropped(request, code, reason, retry_after_ms))

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

    def _prune_rates(self, now: float) -> None:
        # Rates of flows idle for many time constants are zero in all but name: forget them.
        if now <= self._rates_prune_at:
            return
        idle = 20 * ARRIVAL_WINDOW_S
        oldest = math.inf
        for key in [k for k, r in self._rates.items() if now - r.stamp > idle]:
            del self._rates[key]
        for r in self._rates.values():
            if r.stamp < oldest:
                oldest = r.stamp
        self._rates_prune_at = oldest + idle

    def _new_rate(self, key: tuple[int, str], now: float) -> None:
        """Open a flow's arrival rate at ``now`` (see :meth:`_prune_rates`)."""
        self._rates[key] = TenantWorkRate(now)
        if now + 20 * ARRIVAL_WINDOW_S < self._rates_prune_at:
            self._rates_prune_at = now + 20 * ARRIVAL_WINDOW_S

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
        if e is None or e.state is not _RUNNING:
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
        # When the batch was taken by next_batch (None if unknown).
        e = self._entries.get(reqs[0].id) if reqs else None
        batch = self._batches.get(e.batch) if e is not None else None
        started = batch.start if batch is not None else None
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

    def cancel(self, request_id: Hashable, now: float) -> CancelOutcome:
        """Cancel a request: removed if queued, flagged if running.

        Args:
            request_id: the server-unique id.
            now: current time.
        """
        e = self._entries.get(request_id)
        if e is None:
            return CancelOutcome.UNKNOWN
        if e.state is _RUNNING:
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

    # ------------------------------------------------------------------ what a selector reads

    @property
    def levels(self) -> Mapping[int, Mapping[str, Flow]]:
        """Queued requests: priority -> tenant -> flow (see :class:`~.selection.QueueView`)."""
        return self._levels

    def tag(self, tenant: str) -> float:
        """The tenant's fair-queueing start tag."""
        return self._tag.get(tenant, self._vclock)

    def weight(self, tenant: str) -> float:
        """The tenant's share weight (an unknown tenant, removed by a reload, weighs 1)."""
        return self._weight(tenant)

    def room(self, tenant: str, picked: Mapping[str, int]) -> int:
        """Slots a request of ``tenant`` may take now, with ``picked`` slots per tenant already in
        the batch being formed: free concurrency less the reserved slots others are not using."""
        free = self._conc - self._running - (sum(picked.values()) if picked else 0)
        reserved = self._reserved if self.quotas.registry is self._registry_src else self._reservations()
        return free - self._held_for_others(tenant, reserved, picked) if reserved else free

    def occupancy(self, batch_size: int) -> float:
        """How long a batch of ``batch_size`` is planned to hold its worker."""
        return self.service.occupancy(batch_size)

    def mean_occupancy(self, batch_size: int) -> float:
        """How long a batch of ``batch_size`` holds its worker on average."""
        return self.service.mean_occupancy(batch_size)

    def _held_for_others(self, tenant: str, reserved: dict[str, int], picked: Mapping[str, int]) -> int:
        """Slots other tenants reserve and do not use (running, or ``picked`` into the batch being
        formed), which ``tenant``'s work may not take. A reservation is never lent: it is there so
        that its tenant never waits for a batch to end."""
        held = 0
        for name, slots in reserved.items():
            if name != tenant:
                held += max(0, slots - self._tenant_running.get(name, 0) - picked.get(name, 0))
        return held

    def _take(self, picked: list[Request], now: float) -> None:
        """Take ``picked`` off the queue and mark them running, as one batch started at ``now``."""
        entries = self._entries
        n = len(picked)
        slots = 0
        for req in picked:
            e = entries.get(req.id)
            if e is None or e.state is not _QUEUED:
                raise ValueError(f"request {req.id!r} is not queued")
            slots += req.cost.slots
        if slots > self._conc - self._running:
            raise ValueError("the batch takes more slots than are free")
        if n > 1 and len({r.id for r in picked}) < n:
            raise ValueError("a request is picked twice")
        if self.quotas.registry is not self._registry_src:
            self._registry_derived()
        levels, weights, tags, running = self._levels, self._weights, self._tag, self._tenant_running
        self._batch_seq += 1
        seq = self._batch_seq
        for req in picked:
            flow = levels[req.priority][req.tenant]
            e = entries[req.id]
            self._unlink_queued(flow, -1 if flow.items[-1][2] is req else self._find(req, e.seq)[1])
            e.state = _RUNNING
            e.batch = seq
            t = req.tenant
            tags[t] = tags.get(t, self._vclock) + req.cost.work / weights.get(t, 1.0)  # (an unknown tenant weighs 1)
            running[t] = running.get(t, 0) + req.cost.slots
        # The virtual clock advances to the least tag of the tenants still queued.
        vclock = self._vclock
        if self._tenant_queued:
            least = min([tags.get(t, vclock) for t in self._tenant_queued])
        elif tags:
            # Nobody waits: everyone restarts level, and tags of idle tenants can be forgotten.
            least = max(tags.values())
            tags.clear()
        else:
            least = vclock
        if least > vclock:
            self._vclock = least
        if now > self._rates_prune_at and len(self._rates) > len(self._tenant_queued):
            self._prune_rates(now)
        self._batches[seq] = RunningBatch(now, n, now + self.service.occupancy(n))
        self._running += slots
