"""Per-model scheduling shell: admission core, batcher and execution lanes.

Pure decisions live in the sans-I/O cores (:mod:`chunkline.server.core.admission` admits, queues
and forms batches; :mod:`.batching` says when a free lane starts the next batch); the lane threads
and what they run are in :mod:`.lanes`. This module only wires them to the event loop: it stamps
times, arms the batch, deadline and hang timers, hands batches to lanes and resolves each request's
future. Policy inference never runs on the event loop. It is one responsibility -- the life of a
request from admission to its answer -- hence one module of about 500 lines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from chunkline.client.exceptions import ErrorCode
from chunkline.policies.base import Policy
from chunkline.policies.prefix import ActionPrefix
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, CancelOutcome, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.core.timers import EarliestTimer
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import ArrivalRate, BatchPolicy, dispatch_time
from chunkline.server.robot.lanes import BatchOutcome, LanePool, probe_pass, run_batch

__all__ = ["WorkItem", "InferenceResult", "ModelRunner"]

log = logging.getLogger("chunkline.server")
_POLICY_COST = PolicyCost()  # immutable: one batch slot, shared by every policy request


@dataclasses.dataclass
class InferenceResult:
    """One request's share of a batch: its actions and how the batch went (seconds)."""

    actions: np.ndarray  # [H, A] float32
    queue_s: float
    batch_wait_s: float
    infer_s: float
    batch_size: int
    late: bool


@dataclasses.dataclass(eq=False)
class WorkItem:
    """An admitted request, from queue to reply.

    Args:
        obs: the validated observation.
        tenant: who sent it. session: where from.
        deadline: absolute, on the runner's clock.
        enqueued_at: admission time, on the runner's clock.
        future: resolved with an :class:`InferenceResult`, or failed with a :class:`Refusal`.
        request: the admission core's view of it.
        prefix: the robot's frozen prefix (real-time chunking), if it sent one.
    """

    obs: dict[str, Any]
    tenant: str
    session: str
    deadline: float
    enqueued_at: float
    future: asyncio.Future[InferenceResult]
    request: Request | None = None
    prefix: ActionPrefix | None = None


def _fail(item: WorkItem, code: ErrorCode, message: str, retry_after_ms: float | None = None) -> None:
    if not item.future.done():
        item.future.set_exception(Refusal(code, message, retry_after_ms))


def _deadline_of(item: WorkItem) -> float:
    return item.deadline


# Seconds a loop timer may fire ahead of its time (uvloop's timers count whole milliseconds).
_TIMER_RESOLUTION = 0.001


@dataclasses.dataclass(eq=False)
class _Running:
    """A batch on a lane, as the model's watchdog sees it.

    Args:
        batch: its requests.
        watched: those whose deadline is still watched, latest deadline first (empty when the
            model does not enforce deadlines).
        started: when it was dispatched (runner's clock).
        hang_at: when it is declared hung if it is still running.
    """

    batch: list[Request]
    watched: list[WorkItem]
    started: float
    hang_at: float

    def next_due(self) -> float:
        while self.watched and self.watched[-1].future.done():
            self.watched.pop()  # answered already (cancelled): nothing to watch
        return min(self.watched[-1].deadline, self.hang_at) if self.watched else self.hang_at


class ModelRunner:
    """Serves one policy: admission, batching and ``lanes`` execution threads.

    Args:
        name: the model name clients ask for.
        policy: the loaded, warmed policy.
        quotas: the server-wide quota manager (shared by every model).
        admission: queue bound, batch size, lanes (``workers``) and fairness settings.
        batching: when a free lane starts a batch.
        service: the service-time model (seeded from warm-up measurements).
        on_batch: called on the loop after each batch with ``(batch_size, infer_seconds)``.
        hang_timeout: a batch running this long (and longer than 10x its predicted time) is
            declared hung: its lane thread is abandoned and replaced, and the runner reports
            itself unhealthy until the abandoned call returns.
        clock: monotonic seconds (``time.perf_counter``).
    """

    def __init__(
        self,
        name: str,
        policy: Policy,
        *,
        quotas: QuotaManager,
        admission: AdmissionConfig,
        batching: BatchPolicy,
        service: ServiceTimeModel | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        hang_timeout: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if batching.max_batch_size != admission.max_batch_size:
            raise ValueError("batching and admission must agree on max_batch_size")
        self.name = name
        self.policy = policy
        self.batching = batching
        self.core = AdmissionController(name, quotas, admission, service or ServiceTimeModel())
        self._clock = clock
        self._on_batch = on_batch
        self._ids = itertools.count(1)
        self._lanes = LanePool(name, admission.workers)
        self._hang_timeout = hang_timeout
        self._arrivals = ArrivalRate()
        self._window_start = math.inf  # oldest arrival still queued (conservative)
        self._window_deadline = math.inf  # earliest deadline offered since the queue was empty
        self._batch_timer: asyncio.TimerHandle | None = None
        self._expiry = EarliestTimer(clock, self._on_expiry)
        # One watchdog timer for the model, at the earliest of its running batches' deadlines and
        # hang times; a batch that ends leaves it armed (a spare firing finds nothing due), so a
        # batch costs no timer of its own.
        self._running: dict[int, _Running] = {}  # by lane
        self._watchdog = EarliestTimer(clock, self._on_watchdog)
        self._stopped = False
        self._live: set[WorkItem] = set()  # admitted and not yet answered
        # Sessions seen recently and how many of their requests are pending: a robot waiting for
        # its own reply will not send again, so only the others can fill a batch.
        self._last_seen: dict[str, float] = {}
        self._pending_per_session: dict[str, int] = {}
        self._waiting = 0  # sessions in _last_seen with a request pending, kept up to date
        self._pruned_at = 0.0
        self._refusing = False
        self._states: dict[str, Any] = {}  # per-session policy state (stateful policies)
        # Re-measurement while idle and refusing (see _maybe_probe).
        self.probe_interval_s = 1.0
        self._probe: asyncio.Future[float] | None = None
        self._last_sample = -math.inf  # no batch has run yet: the first idle refusal may probe

    # ------------------------------------------------------------------ state

    @property
    def healthy(self) -> bool:
        """False while a lane call declared hung has not returned."""
        return self._lanes.hung == 0

    @property
    def queued(self) -> int:
        return self.core.queued

    @property
    def running(self) -> int:
        return self.core.running

    # ------------------------------------------------------------------ requests

    def _request(self, tenant: TenantInfo, session: str, deadline: float, now: float, payload: Any) -> Request:
        return Request(id=next(self._ids), session=session, tenant=tenant.name, cls="policy", cost=_POLICY_COST,
                       deadline=deadline, priority=tenant.priority_for("policy"), payload=payload)

    @property
    def refusing(self) -> bool:
        """Whether the latest admission decision was a refusal: a hint that the next request may
        be refused too, so that it is worth asking :meth:`precheck` before decoding it."""
        return self._refusing

    def precheck(self, *, tenant: TenantInfo, session: str, deadline: float) -> Refusal | None:
        """The refusal :meth:`submit` would raise now for a request with this header, whatever
        its observation holds; ``None`` when it would be admitted (or fail only on content).

        Admission never looks at an observation, so a session can ask before decoding one and
        answer a refusal without the decode. Only work already overdue in the queue is
        dropped meanwhile, as :meth:`submit` would drop it; nothing is admitted.

        Args:
            tenant: who sends it.
            session: where from.
            deadline: its absolute deadline, on the runner's clock.
        """
        if self._stopped:
            return Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        now = self._clock()
        self.core.expire(now)
        self._answer_dropped()
        decision = self.core.check(self._request(tenant, session, deadline, now, None), now)
        self._refusing = decision is not None
        if decision is None:
            return None
        self._maybe_probe(decision, now)
        return decision

    def submit(self, obs: dict[str, Any], *, tenant: TenantInfo, session: str, deadline: float,
               prefix: ActionPrefix | None = None) -> WorkItem:
        """Offer a validated observation to admission and, if admitted, to the batcher.

        Raises:
            Refusal: ``overloaded``, ``deadline_unmeetable``, ``deadline_exceeded``,
                ``quota_exceeded`` or ``shutting_down``, with the reason.
        """
        if self._stopped:
            raise Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        now = self._clock()
        item = WorkItem(obs=obs, tenant=tenant.name, session=session, deadline=deadline, enqueued_at=now,
                        future=asyncio.get_running_loop().create_future(), prefix=prefix)
        request = item.request = self._request(tenant, session, deadline, now, item)
        decision = self.core.offer(request, now)
        self._answer_dropped()
        if isinstance(decision, Refusal):
            self._refusing = True
            self._maybe_probe(decision, now)
            raise decision
        self._refusing = False
        self._live.add(item)
        pending = self._pending_per_session.get(session, 0)
        self._pending_per_session[session] = pending + 1
        if pending == 0 or session not in self._last_seen:
            self._waiting += 1  # this session now waits for a reply (and was seen just now)
        item.future.add_done_callback(functools.partial(self._answered, item))
        self._arrivals.observe(now)
        self._last_seen[session] = now
        if now - self._pruned_at > 1.0:
            self._prune_sessions(now)
        self._window_start = min(self._window_start, now)
        self._window_deadline = min(self._window_deadline, deadline)
        self._kick()
        self._arm_expiry()
        return item

    @property
    def probe(self) -> asyncio.Future[float] | None:
        """The re-measurement in flight (its result: the seconds a batch of one took), if any."""
        return self._probe

    def _maybe_probe(self, decision: Refusal, now: float) -> None:
        """Refusing for the deadline while nothing runs: re-measure with one synthetic batch of one.

        Admission learns service times only from batches that run. After a slow spell (a
        neighbour's burst, a stall) the estimates stay high, admission refuses everything as
        unmeetable, nothing runs, and nothing would ever show that the spell is over. So while
        the model is idle and refusing, at most once per ``probe_interval_s``, a batch of one
        example observation runs on a lane and its time is fed to the service model. A request
        admitted meanwhile waits behind it at most that one short pass.
        """
        if decision.code is not ErrorCode.DEADLINE_UNMEETABLE or self._probe is not None or self._stopped:
            return
        if self.core.queued or self.core.running or not self._lanes.idle or now - self._last_sample < self.probe_interval_s:
            return
        loop = asyncio.get_running_loop()
        probe: asyncio.Future[float] = loop.create_future()
        self._probe = probe
        self._last_sample = now
        lane = self._lanes.idle[0]  # stays idle for the scheduler: a batch sent there queues behind the probe

        def done(seconds: float, exc: BaseException | None) -> None:
            self._probe = None
            self._last_sample = self._clock()
            if exc is not None:
                log.warning("policy %s: service re-measurement failed: %s", self.name, exc)
                probe.set_exception(exc)
                return
            self.core.service.observe(1, seconds)
            log.info("policy %s: idle and refusing; re-measured a batch of one: %.1f ms", self.name, seconds * 1e3)
            probe.set_result(seconds)

        self._lanes.submit(lane, probe_pass, (self.policy,), done)

    def _answered(self, item: WorkItem, _: object = None) -> None:
        self._live.discard(item)
        left = self._pending_per_session.get(item.session, 1) - 1
        if left > 0:
            self._pending_per_session[item.session] = left
        else:
            self._pending_per_session.pop(item.session, None)
            if item.session in self._last_seen:
                self._waiting -= 1

    def _prune_sessions(self, now: float) -> None:
        """Forget sessions silent for 2 s (and recount those waiting, an O(sessions) walk that
        happens once a second rather than at every dispatch decision)."""
        self._pruned_at = now
        self._last_seen = {k: t for k, t in self._last_seen.items() if now - t < 2.0}
        self._waiting = sum(1 for k in self._last_seen if k in self._pending_per_session)

    def _expected_arrival_rate(self, now: float) -> float:
        """Arrivals per second that could still join a batch: the measured rate, scaled by the
        share of recently active sessions that are not already waiting for a reply."""
        active = len(self._last_seen)
        if active == 0:
            return 0.0
        return self._arrivals.rate(now) * (active - self._waiting) / active

    def cancel(self, item: WorkItem, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        """Withdraw a request (client cancel or disconnect). Queued work never runs; running work
        finishes and its result is discarded. The request is answered ``code`` at once."""
        if item.request is not None and not item.future.done():
            outcome = self.core.cancel(item.request.id, self._clock())
            if outcome is not CancelOutcome.UNKNOWN:
                _fail(item, code, "cancelled by the client" if code is ErrorCode.CANCELLED else "the server is shutting down")

    # ------------------------------------------------------------------ timers and drops

    def _answer_dropped(self) -> None:
        for dropped in self.core.take_dropped():
            _fail(dropped.request.payload, dropped.code, dropped.reason, dropped.retry_after_ms)
        if self.core.queued == 0:
            self._window_start = self._window_deadline = math.inf

    def _arm_expiry(self) -> None:
        """Answer `deadline_exceeded` the moment queued work runs out of budget, even while every
        lane is busy: the robot must learn at once that nothing is coming."""
        self._expiry.arm(self.core.next_expiry())

    def _on_expiry(self) -> None:
        self.core.expire(self._clock())
        self._answer_dropped()
        self._arm_expiry()

    # ------------------------------------------------------------------ dispatch

    def release_session(self, session: str) -> None:
        """The session ended: free its policy state."""
        self._states.pop(session, None)

    @property
    def session_states(self) -> int:
        return len(self._states)

    def _compatible(self, first: Request, other: Request) -> bool:
        if self.policy.stateful and first.session == other.session:
            return False  # one state per session: its requests run one after the other
        a, b = first.payload.obs, other.payload.obs
        # Every field either side has (optional ones included) must stack: same shape or absent in both.
        return all(getattr(a.get(k), "shape", None) == getattr(b.get(k), "shape", None) for k in a.keys() | b.keys())

    def _kick(self) -> None:
        """Start batches on free lanes while there is work and the batching rule says go."""
        while self._lanes.idle and self.core.queued and not self._stopped:
            now = self._clock()
            start_at = dispatch_time(
                now,
                queued=self.core.queued,
                oldest_arrival=self._window_start,
                earliest_deadline=self._window_deadline,
                policy=self.batching,
                predict=self.core.service.predict,
                arrival_rate=self._expected_arrival_rate(now),
            )
            if start_at > now:
                if self._batch_timer is None:
                    self._batch_timer = asyncio.get_running_loop().call_later(start_at - now, self._on_batch_timer)
                return
            batch = self.core.next_batch(now, self.batching.max_batch_size, self._compatible)
            self._answer_dropped()
            if not batch:
                return
            lane = self._lanes.idle.pop()
            items = [r.payload for r in batch]
            states = None
            if self.policy.stateful:
                states = [self._states[i.session] if i.session in self._states else self.policy.new_session_state()
                          for i in items]
            prefixes = [i.prefix for i in items] if self.policy.accepts_prefix else None
            # Watchdog: each request is failed at its own deadline if the batch is still running;
            # a batch far beyond any expectation is declared hung and its lane replaced.
            enforce = self.core.config.enforces_deadlines
            hang_after = max(self._hang_timeout, 10 * self.core.service.predict(len(batch)))
            run = self._running[lane] = _Running(batch, sorted(items, key=_deadline_of, reverse=True) if enforce else [],
                                                 now, now + hang_after)
            self._lanes.submit(lane, run_batch, (self.policy, [i.obs for i in items], states, prefixes),
                               functools.partial(self._finished, lane, run))
            self._watchdog.arm(run.next_due())
        if self._batch_timer is not None and (not self.core.queued or not self._lanes.idle):
            self._batch_timer.cancel()
            self._batch_timer = None

    def _on_batch_timer(self) -> None:
        self._batch_timer = None
        self._kick()

    def _on_watchdog(self) -> None:
        # Loop timers may fire up to their resolution early: a time that close counts as passed.
        due = self._clock() + _TIMER_RESOLUTION
        for lane, run in list(self._running.items()):
            while run.watched and run.watched[-1].deadline <= due:
                _fail(run.watched.pop(), ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the policy was running")
            if run.hang_at <= due:
                self._declare_hung(lane, run)
        self._watchdog.arm(min((run.next_due() for run in self._running.values()), default=None))

    def _declare_hung(self, lane: int, run: _Running) -> None:
        if self._stopped:
            return
        del self._running[lane]
        log.error("policy %s: a batch of %d has run past the hang timeout; replacing lane %d", self.name, len(run.batch), lane)
        self._lanes.replace(lane)
        self.core.complete_batch(run.batch, self._clock(), None)
        for r in run.batch:
            _fail(r.payload, ErrorCode.POLICY_FAILED, "the policy hung; its lane was restarted")
        self._kick()

    def _finished(self, lane: int, run: _Running, outcome: BatchOutcome | None, exc: BaseException | None) -> None:
        """On the loop, once per batch: the lane's outcome split back to the batch's requests."""
        if self._running.get(lane) is not run:  # a call declared hung has returned at last
            self._lanes.hung -= 1
            log.warning("policy %s: the hung call on lane %d returned", self.name, lane)
            return
        del self._running[lane]
        batch, started = run.batch, run.started
        now = self._clock()
        free_since = self._lanes.release(lane, now)
        try:
            if isinstance(exc, concurrent.futures.CancelledError):  # never ran: the lanes shut down
                self.core.complete_batch(batch, now, None)
                for r in batch:
                    _fail(r.payload, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
                return
            if exc is not None or outcome is None:  # the policy's failure fails this batch only; the lane lives on
                log.warning("policy %s failed on a batch of %d: %s", self.name, len(batch), type(exc).__name__, exc_info=exc)
                self.core.complete_batch(batch, now, None)
                for r in batch:
                    _fail(r.payload, ErrorCode.POLICY_FAILED, f"policy raised {type(exc).__name__}")
                return
            actions, infer_s, states = outcome
            failed = [a for a in actions if isinstance(a, BaseException)]
            if failed:
                log.warning("policy %s failed on %d of a batch of %d: %s", self.name, len(failed), len(batch),
                            type(failed[0]).__name__, exc_info=failed[0])
            # A batch that needed isolating ran more than one pass: its time is no service sample.
            self.core.complete_batch(batch, now, None if failed else infer_s)
            if not failed:
                self._last_sample = now
            if self._on_batch is not None:
                self._on_batch(len(batch), infer_s)
            for i, r in enumerate(batch):
                item: WorkItem = r.payload
                if item.future.done():  # cancelled while running: the result (and state) is discarded
                    continue
                own = actions[i]
                if isinstance(own, BaseException):
                    _fail(item, ErrorCode.POLICY_FAILED, f"policy raised {type(own).__name__}")
                    continue
                if states is not None:
                    self._states[item.session] = states[i]
                # Waiting for the lane to free up is queueing; waiting on a free lane for the
                # batch to fill is batching.
                lane_ready = max(item.enqueued_at, free_since)
                item.future.set_result(
                    InferenceResult(
                        actions=own,
                        queue_s=min(lane_ready, started) - item.enqueued_at,
                        batch_wait_s=max(0.0, started - lane_ready),
                        infer_s=infer_s,
                        batch_size=len(batch),
                        late=now > item.deadline,
                    )
                )
        finally:
            self._kick()
            self._arm_expiry()

    # ------------------------------------------------------------------ life cycle

    async def stop(self) -> None:
        """Fail queued work with ``shutting_down`` and release the lane threads."""
        self._stopped = True
        if self._batch_timer is not None:
            self._batch_timer.cancel()
        self._expiry.cancel()
        self._watchdog.cancel()
        for item in list(self._live):
            self.cancel(item, ErrorCode.SHUTTING_DOWN)
        self._answer_dropped()
        self._lanes.shutdown()
