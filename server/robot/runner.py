"""Per-model scheduling shell: submit, dispatch and finish, on the core's request-class skeleton.

Decisions live in the sans-I/O cores: admission (:mod:`chunkline.server.core.admission`) admits,
queues and forms batches; :mod:`.batching` says when a free lane starts one; :mod:`.sizing` which
sizes may run. The model's :class:`~chunkline.server.core.pool.ModelPool` does what every class
does (admission, drops and expiry, jobs by id, cancel, stop, the kick); the runner is its
handlers: how big a batch may start now, and how it runs on a lane (:mod:`.lanes`, watched).
Every batch takes one path, ``offer -> next_batch -> lane``: inference never runs on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import operator
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from chunkline.client.wire.errors import ErrorCode
from chunkline.policies.base import Policy
from chunkline.policies.prefix import ActionPrefix
from chunkline.server.core.admission import (
    AdmissionConfig,
    AdmissionController,
    BatchSelector,
    Request,
    ServiceTimeModel,
)
from chunkline.server.core.pool import SHUTTING_DOWN, ModelPool
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.core.timers import EarliestTimer
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import ArrivalTracker, BatchPolicy, dispatch_time, stackable
from chunkline.server.robot.fleet.urgency import Urgency
from chunkline.server.robot.lanes import BatchOutcome, LanePool, LaneRun, LaneWatchdog, run_batch
from chunkline.server.robot.remeasure import IdleRemeasure
from chunkline.server.robot.session_states import SessionStates
from chunkline.server.robot.sizing import BatchSizeTuner, BatchSizing
from chunkline.server.robot.timing import TimingOutcome, out_of_memory, timing_pass

__all__ = ["WorkItem", "InferenceResult", "ModelRunner"]

log = logging.getLogger("chunkline.server")
_POLICY_COST = PolicyCost()  # immutable: one batch slot, shared by every policy request
_IDS = itertools.count(1)  # request ids, unique in the process (0: a precheck's, never admitted)
# Seconds a loop timer may fire ahead of its time (uvloop's timers count whole milliseconds).
_TIMER_RESOLUTION = 0.001


@dataclasses.dataclass(slots=True)
class InferenceResult:
    """One request's share of a batch: its actions and how the batch went (seconds)."""

    actions: np.ndarray  # [H, A] float32
    queue_s: float
    batch_wait_s: float
    infer_s: float
    batch_size: int
    late: bool
    backlog: int = 0  # requests still queued for the model when its batch ended (others waited behind it)


@dataclasses.dataclass(eq=False, slots=True)
class WorkItem:
    """An admitted request, from queue to reply.

    Args:
        obs: the validated observation.
        tenant: who sent it. session: where from.
        deadline: absolute, on the runner's clock.
        enqueued_at: admission time, on the runner's clock.
        future: resolved with an :class:`InferenceResult`, or failed with a :class:`Refusal`.
        id: its id in the admission core and its pool (an id, not the :class:`Request` that
            carries this item: no reference cycle, so an answered observation is freed at once).
        started: when its batch started (``None`` while queued).
        prefix: the robot's frozen prefix (real-time chunking), if it sent one.
        urgency: how urgent the robot says it is (read by a fleet batch chooser), if it said.
        robot_weight: its robot's service weight within its tenant.
        queued_since: a replacement's (``Infer.replaces``): when the place it took was first queued.
        on_answered: called on the loop as soon as the runner resolves ``future``, in that same
            loop turn (a session writes its reply there, a turn earlier than a done-callback).
    """

    obs: dict[str, Any]
    tenant: str
    session: str
    deadline: float
    enqueued_at: float
    future: asyncio.Future[InferenceResult]
    id: int = 0
    started: float | None = None
    prefix: ActionPrefix | None = None
    urgency: Urgency | None = None
    robot_weight: float = 1.0
    queued_since: float | None = None
    on_answered: Callable[[], None] | None = None


_deadline_of: Callable[[WorkItem], float] = operator.attrgetter("deadline")


def _answered(item: WorkItem) -> bool:
    return item.future.done()


class ModelRunner:
    """Serves one policy: admission, batching and ``workers`` lanes (the
    :class:`~chunkline.server.core.pool.JobHandlers` of its :attr:`pool`).

    Args:
        name: the model name clients ask for.
        policy: the loaded, warmed policy.
        quotas: the server-wide quota manager (shared by every model).
        admission: queue bound, batch size, lanes (``workers``) and fairness settings.
        batching: when a free lane starts a batch.
        service: the service-time model (seeded from warm-up measurements).
        on_batch: called on the loop after each batch with ``(batch_size, infer_seconds)``.
        hang_timeout: a run this long (and longer than 10x its predicted time) is declared hung:
            its lane thread is abandoned and replaced, and the runner is unhealthy until it returns.
        sizing: which batch sizes may run and which to time in quiet spells (:mod:`.sizing`);
            ``None``: every size up to ``max_batch_size`` from the first batch.
        selector: which queued requests form the next batch, and how many (default: admission's
            :class:`~chunkline.server.core.admission.EdfSelector`).
        clock: monotonic seconds (``time.perf_counter``).
        lane_init: run first on each lane thread (per-thread settings: :mod:`.cpu_threads`).
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
        sizing: BatchSizing | None = None,
        selector: BatchSelector | None = None,
        clock: Callable[[], float] = time.perf_counter,
        lane_init: Callable[[], None] | None = None,
    ) -> None:
        if batching.max_batch_size != admission.max_batch_size:
            raise ValueError("batching and admission must agree on max_batch_size")
        self.name = name
        self.policy = policy
        self.core = AdmissionController(name, quotas, admission, service or ServiceTimeModel(), selector)
        self._clock = clock
        self._on_batch = on_batch
        self._lanes = LanePool(name, admission.workers, lane_init)
        self._watchdog: LaneWatchdog[WorkItem] = LaneWatchdog(_deadline_of, _answered, hang_timeout)
        self._watch_timer = EarliestTimer(clock, self._on_watchdog)
        self._tuner = BatchSizeTuner(name, batching, sizing)
        self._arrivals = ArrivalTracker(clock)
        self._states = SessionStates(policy)
        self._batch_timer: asyncio.TimerHandle | None = None
        self._batch_timer_at = math.inf  # when it fires (this runner's clock)
        self._timing_timer: asyncio.TimerHandle | None = None
        #: admission, the queue's chores, the admitted requests by id, cancel and stop, and the kick
        #: (this runner is its :class:`~chunkline.server.core.pool.JobHandlers`)
        self.pool: ModelPool[WorkItem] = ModelPool(self.core, clock, self)
        self._watch_deadlines = admission.deadlines  # (batch-size caps replace the config, never this)
        #: Whether the latest admission decision was a refusal: a hint that the next request may be
        #: refused too, so that it is worth asking :meth:`precheck` before decoding it (a plain
        #: attribute: read before every request). Only the runner writes it.
        self.refusing = False
        #: re-measurement of a batch of one while idle and refusing (:mod:`.remeasure`)
        self.remeasure = IdleRemeasure(name, policy, self.core.service, self._lanes, clock)

    # ------------------------------------------------------------------ state

    @property
    def healthy(self) -> bool:
        """False while a lane call declared hung has not returned."""
        return self._watchdog.hung == 0

    @property
    def queued(self) -> int:
        return self.core.queued

    @property
    def running(self) -> int:
        return self.core.running

    @property
    def batching(self) -> BatchPolicy:
        """The batching rule, its batch size lowered to the cap."""
        return self._tuner.batching

    @property
    def sizing(self) -> BatchSizing | None:
        """Which batch sizes may run, which are timed (``None``: every size, from the first batch)."""
        return self._tuner.sizing

    @property
    def max_batch_size(self) -> int:
        """The most robots per batch now: the configured size, or lower once a size has run out of
        memory, hung or failed the memory guard."""
        return self.core.config.max_batch_size

    @property
    def sizes_timed_at(self) -> float | None:
        """When the last size within the cap was timed (``None`` until then)."""
        return self._tuner.sizes_timed_at

    @property
    def session_states(self) -> int:
        return len(self._states)

    # ------------------------------------------------------------------ requests

    def _request(self, tenant: TenantInfo, session: str, deadline: float, payload: WorkItem | None, rid: int) -> Request:
        return Request(id=rid, session=session, tenant=tenant.name, cls="policy", cost=_POLICY_COST,
                       deadline=deadline, priority=tenant.priority_for("policy"), payload=payload)

    def precheck(self, *, tenant: TenantInfo, session: str, deadline: float) -> Refusal | None:
        """The refusal :meth:`submit` would raise now for a request with this header, whatever
        its observation holds; ``None`` when it would be admitted (or fail only on content).

        Admission never looks at an observation, so a session can ask before decoding one. Only
        work already overdue is dropped meanwhile; nothing is admitted. A refusal's retry time is
        the session's place in the retry line: answer every refusal this returns.
        """
        if self.pool.stopping:
            return Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN)
        now = self._clock()
        self.pool.expire(now)
        decision = self.core.check(self._request(tenant, session, deadline, None, 0), now)
        self.refusing = decision is not None
        if decision is None:
            return None
        self._maybe_probe(decision, now)
        return self.core.appoint(self._while_re_measuring(decision), session, now)

    def submit(self, obs: dict[str, Any], *, tenant: TenantInfo, session: str, deadline: float,
               prefix: ActionPrefix | None = None, urgency: Urgency | None = None, robot_weight: float = 1.0) -> WorkItem:
        """Offer a validated observation to admission and, if admitted, to the batcher.

        Raises:
            Refusal: ``overloaded``, ``deadline_unmeetable``, ``deadline_exceeded``,
                ``quota_exceeded`` or ``shutting_down``, with the reason.
        """
        pool = self.pool
        if pool.stopping:
            raise Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN)
        now = self._clock()
        item = WorkItem(obs=obs, tenant=tenant.name, session=session, deadline=deadline, enqueued_at=now,
                        future=asyncio.get_running_loop().create_future(), id=next(_IDS), prefix=prefix, urgency=urgency,
                        robot_weight=robot_weight)
        try:
            pool.offer(self._request(tenant, session, deadline, item, item.id), now)
        except Refusal as refusal:
            self._refused(refusal, session, now)
        self.refusing = False
        self._arrivals.admitted(session, deadline, now)  # before the kick: the batching rule reads it
        pool.kick()
        return item

    def _refused(self, decision: Refusal, session: str, now: float) -> NoReturn:
        self.refusing = True
        self._maybe_probe(decision, now)
        raise self.core.appoint(self._while_re_measuring(decision), session, now)

    def cancel(self, item: WorkItem, code: ErrorCode = ErrorCode.CANCELLED) -> None:
        """Withdraw a request (client cancel or disconnect). Queued work never runs; running work
        finishes and its result is discarded. The request is answered ``code`` at once."""
        if not item.future.done():
            self.pool.cancel(item, None if code is ErrorCode.CANCELLED else Refusal(code, SHUTTING_DOWN))

    def sent_early(self, session: str) -> None:
        """``session`` sent a request before the retry time it was given (refused at the door):
        its place in the retry line no longer counts ahead of sessions that wait as told."""
        self.core.retry_line.forfeit(session)

    def release_session(self, session: str) -> None:
        """The session ended: withdraw what it still has queued or running, free its policy state
        and its place in the retry line."""
        self.pool.release_session(session)
        self._arrivals.forget(session)
        self._states.release(session)
        self.core.retry_line.leave(session)

    def _while_re_measuring(self, decision: Refusal) -> Refusal:
        """Over budget alone while a re-measurement or a timing pass runs: the estimate may be stale (a slow warm-up)."""
        if decision.code is not ErrorCode.DEADLINE_UNMEETABLE or decision.retry_after_ms is not None:
            return decision
        if self.remeasure.future is None:
            return self._tuner.while_timing(decision, self._clock())  # or a timing pass runs
        return self.remeasure.refusal(decision)

    def _maybe_probe(self, decision: Refusal, now: float) -> None:
        """Refusing for the deadline while nothing runs (no timing pass either): re-measure (:mod:`.remeasure`)."""
        if (decision.code is ErrorCode.DEADLINE_UNMEETABLE and not self.pool.stopping and not self.core.queued
                and not self.core.running and not self._tuner.timing):
            self.remeasure.start_if_due(now)

    # ------------------------------------------------------------------ the pool's handlers

    def end_unstarted(self, item: WorkItem, refusal: Refusal) -> None:
        """A queued request ends without running (dropped, cancelled, stopped), or a running one is
        withdrawn (:meth:`abort`): it is answered ``refusal`` at once; a running batch runs on and
        its result (and state) for that request is discarded."""
        if not item.future.done():
            item.future.set_exception(refusal)
            self._answered(item)

    abort = end_unstarted

    def _fail(self, item: WorkItem, code: ErrorCode, message: str) -> None:
        self.end_unstarted(item, Refusal(code, message))

    def _answered(self, item: WorkItem) -> None:
        """The runner has just resolved ``item``'s future: its session has nothing pending from it
        (the arrival tracker), and its listener is told."""
        self._arrivals.answered(item.session)
        self._tell(item)

    @staticmethod
    def _tell(item: WorkItem) -> None:
        """Call ``item``'s listener once, and drop it: a listener that refers back to the item
        (a session's in-flight entry) would otherwise keep its observation alive in a cycle."""
        listener = item.on_answered
        if listener is not None:
            item.on_answered = None
            listener()

    def changed(self) -> None:
        """After a kick, a drop or a cancel: an empty queue opens a new arrival window, and a
        batch timer with nothing left to start is cancelled."""
        if not self.core.queued:
            self._arrivals.queue_emptied()
        elif self._lanes.idle:
            self.wake_at(self.core.wake_at())  # a selector that chose to wait names when to choose again
            return
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None

    def compatible(self, first: Request, other: Request) -> bool:
        """Whether ``other`` may join a batch that starts with ``first``: their observations stack,
        and a stateful policy's session runs its requests one after the other."""
        if self.policy.stateful and first.session == other.session:
            return False  # one state per session
        return stackable(first.payload.obs, other.payload.obs)

    def batch_size(self, now: float) -> int:
        """How many robots the next batch may hold now: none without a free lane, or while the
        batching rule waits for company (a timer then kicks when it says go)."""
        if not self._lanes.idle:
            return 0
        arrivals, service = self._arrivals, self.core.service
        queued = self.core.queued
        batching = self._tuner.batching_now(queued)
        if not arrivals.idle:  # every session waits for its reply: no company to wait for
            return batching.max_batch_size
        start_at = dispatch_time(
            now,
            queued=queued,
            oldest_arrival=arrivals.window_start,
            earliest_deadline=arrivals.window_deadline,
            policy=batching,
            predict=service.predict,
            arrival_rate=arrivals.expected_rate(now, enough=batching.rate_worth_waiting),
            per_batch=service.handoff_snapshot()[0],
        )
        if start_at > now:
            start_at = min(start_at, arrivals.stops_at(now))  # company expected from a session that stops comes no more
            if self._batch_timer is None:
                self._batch_timer_at = start_at
                self._batch_timer = asyncio.get_running_loop().call_later(start_at - now, self._on_batch_timer)
            return 0
        return batching.max_batch_size

    def wake_at(self, at: float) -> None:
        """Kick the pool at ``at`` (this runner's clock; ``inf``: never) unless the batch timer fires by then."""
        if at < (math.inf if self._batch_timer is None else self._batch_timer_at):
            if self._batch_timer is not None:
                self._batch_timer.cancel()
            self._batch_timer_at = at
            self._batch_timer = asyncio.get_running_loop().call_later(max(0.0, at - self._clock()), self._on_batch_timer)

    def _on_batch_timer(self) -> None:
        self._batch_timer = None
        self.pool.kick()

    def launch(self, batch: list[Request], now: float) -> None:
        """Run a batch the pool has taken on a free lane, watched."""
        lane = self._lanes.idle.pop()
        items: list[WorkItem] = [r.payload for r in batch]
        args = self._states.batch_args(items)
        if self._watch_deadlines and len(items) > 1:  # the watchdog pops the earliest deadline off the end
            items.sort(key=_deadline_of, reverse=True)
        watched = items if self._watch_deadlines else []
        run = LaneRun(lane, now, self._watchdog.hang_at(now, self.core.service.predict(len(batch))), batch, watched)
        self._watch_timer.arm(self._watchdog.start(run))
        self._lanes.submit(lane, run_batch, args, functools.partial(self._lane_done, run))

    # ------------------------------------------------------------------ finish

    def _lane_done(self, run: LaneRun[WorkItem], outcome: Any, exc: BaseException | None) -> None:
        """On the loop, once per run handed to a lane."""
        if not self._watchdog.end(run):
            log.warning("policy %s: the hung call on lane %d returned", self.name, run.lane)
            return
        now = self._clock()
        if run.timing is not None:
            self._timed(run, outcome, exc, now)
            return
        if exc is None and outcome is not None:
            answered = self._answer(run, outcome, now, self._lanes.free_at[run.lane])
            self._settle(run, outcome, exc, now)
            # Their sessions turn idle after the settling kick has chosen (as a done-callback's would).
            for item in answered:
                self._arrivals.answered(item.session)
            return
        self._settle(run, outcome, exc, now)

    def _on_watchdog(self) -> None:
        if self.pool.stopping:  # stop() answered everything; a hung lane is no longer replaced
            return
        overdue = self._watchdog.overdue(self._clock() + _TIMER_RESOLUTION)
        for item in overdue.expired:
            self._fail(item, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the policy was running")
        for run in overdue.hung:
            self._hung(run)
        self._watch_timer.arm(self._watchdog.next_due())

    def _hung(self, run: LaneRun[WorkItem]) -> None:
        what = f"timing batch {run.timing}" if run.timing is not None else f"a batch of {len(run.batch)}"
        log.error("policy %s: %s has run past the hang timeout; replacing lane %d", self.name, what, run.lane)
        self._lanes.replace(run.lane)
        if run.timing is not None:
            assert run.busy is not None
            self.core.release_worker(run.busy)
            self._size_failed(run.timing, "hung")
        else:
            self.pool.finish_batch(run.batch, self._clock())
            for r in run.batch:
                self._fail(r.payload, ErrorCode.POLICY_FAILED, "the policy hung; its lane was restarted")
            self._size_failed(len(run.batch), "hung")
        self.pool.kick()
        self._arm_timing()

    def _answer(self, run: LaneRun[WorkItem], outcome: BatchOutcome, now: float, free_since: float) -> list[WorkItem]:
        """A batch's results to its requests' futures (``now``: when it ended; ``free_since``:
        when its lane was freed before it); returns the requests given a result (their
        listeners told, the arrival tracker not yet)."""
        answered: list[WorkItem] = []
        actions, states, started = outcome.actions, outcome.states, run.started
        size, backlog = len(run.batch), self.core.queued
        for i, r in enumerate(run.batch):
            item: WorkItem = r.payload
            if item.future.done():  # cancelled while running: the result (and state) is discarded
                continue
            own = actions[i]
            if isinstance(own, BaseException):
                self._fail(item, ErrorCode.POLICY_FAILED, f"policy raised {type(own).__name__}")
                continue
            if states is not None:
                self._states.store(item.session, states[i])
            # Waiting for the lane to free up is queueing; waiting on a free lane for company is batching.
            # (compared rather than by min()/max() calls: once per request)
            lane_ready = free_since if free_since > item.enqueued_at else item.enqueued_at
            queued_until, batch_wait = (lane_ready, started - lane_ready) if lane_ready < started else (started, 0.0)
            item.future.set_result(InferenceResult(
                actions=own, queue_s=queued_until - item.enqueued_at, batch_wait_s=batch_wait, infer_s=outcome.infer_s,
                batch_size=size, late=now > item.deadline, backlog=backlog))
            answered.append(item)
            self._tell(item)
        return answered

    def _settle(self, run: LaneRun[WorkItem], outcome: BatchOutcome | None, exc: BaseException | None, now: float) -> None:
        """A batch's books once it ended at ``now``: its lane freed, admission and the service
        model told, a failed batch's requests failed; then the next batch started."""
        batch = run.batch
        size = len(batch)
        self._lanes.release(run.lane, now)
        try:
            if exc is not None or outcome is None:
                if isinstance(exc, concurrent.futures.CancelledError):  # never ran: the lanes shut down
                    self.pool.finish_batch(batch, now)
                    for r in batch:
                        self._fail(r.payload, ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN)
                    return
                # The policy's failure fails this batch only; the lane lives on.
                log.warning("policy %s failed on a batch of %d: %s", self.name, size, type(exc).__name__, exc_info=exc)
                self.pool.finish_batch(batch, now)
                for r in batch:
                    self._fail(r.payload, ErrorCode.POLICY_FAILED, f"policy raised {type(exc).__name__}")
                return
            batch_error = outcome.batch_error
            if batch_error is not None and out_of_memory(batch_error):  # its robots were then run one at a time
                self._size_failed(size, "ran out of memory")
            failed = [a for a in outcome.actions if isinstance(a, BaseException)] if batch_error is not None else None
            if failed:
                log.warning("policy %s failed on %d of a batch of %d: %s", self.name, len(failed), size,
                            type(failed[0]).__name__, exc_info=failed[0])
            # A batch that needed isolating ran more than one pass: its time is no service sample.
            isolated = batch_error is not None
            self.pool.finish_batch(batch, now, None if isolated else outcome.infer_s)
            if not isolated:
                self.remeasure.last_sample = now
                self._tuner.ran(size)
            if self._on_batch is not None:
                self._on_batch(size, outcome.infer_s)
        finally:
            if self.core.queued or self._batch_timer is not None:  # else there is nothing to dispatch or cancel
                self.pool.kick()
            if self._timing_timer is None and self._tuner.timing_left:
                self._arm_timing()

    # ------------------------------------------------------------------ batch sizes

    def _size_failed(self, size: int, reason: str) -> None:
        """A batch of ``size`` ran out of memory or hung: cap the batch size below it."""
        cap = self._tuner.failed(size, reason, self._clock())
        if cap is not None:
            self.core.set_max_batch_size(cap)

    def start_background_timing(self) -> None:
        """Serving has begun: time the batch sizes not timed yet in quiet spells (call on the loop)."""
        if self._tuner.serving(self._clock()):
            self._arm_timing()

    def _arm_timing(self) -> None:
        """Time the next size if the runner is idle and quiet, else arm a timer for when it may be.
        Arrivals do not re-arm it (no work on the request path): the firing judges the spell again."""
        if self.pool.stopping or self._timing_timer is not None:
            return
        nxt = self._tuner.next_timing(self._arrivals.last_arrival, self.core.service.predict)
        if nxt is None:
            return
        size, at = nxt
        now = self._clock()
        if at > now:
            self._timing_timer = asyncio.get_running_loop().call_later(at - now, self._on_timing_timer)
        elif not (self.core.queued or self.core.running or self.remeasure.future is not None
                  or len(self._lanes.idle) < self._lanes.count):
            self._start_timing(size, now)
        # else busy: the batch that finishes arms it again

    def _on_timing_timer(self) -> None:
        self._timing_timer = None
        self._arm_timing()

    def _start_timing(self, size: int, now: float) -> None:
        """Time ``size`` on a lane with example observations. Admission plans around the pass as
        around a running batch; the watchdog treats it as one."""
        predicted = self.core.service.predict(size)
        self._tuner.start(size, now, predicted)
        run: LaneRun[WorkItem] = LaneRun(self._lanes.idle.pop(), now, self._watchdog.hang_at(now, predicted), [], [],
                                         timing=size, busy=self.core.occupy_worker(now, predicted))
        self._watch_timer.arm(self._watchdog.start(run))
        self._lanes.submit(run.lane, timing_pass, (self.policy, size), functools.partial(self._lane_done, run))

    def _timed(self, run: LaneRun[WorkItem], outcome: TimingOutcome | None, exc: BaseException | None, now: float) -> None:
        assert run.timing is not None and run.busy is not None
        size = run.timing
        self.core.release_worker(run.busy)
        self._lanes.release(run.lane, now)  # a request that came meanwhile queued behind the pass
        try:
            if isinstance(exc, concurrent.futures.CancelledError):  # never ran: the lanes shut down
                return
            if exc is not None or outcome is None:
                oom = exc is not None and out_of_memory(exc)
                if not oom:
                    log.warning("policy %s: timing batch %d failed", self.name, size, exc_info=exc)
                self._size_failed(size, "ran out of memory" if oom else f"failed ({type(exc).__name__})")
                return
            self.core.service.prime({size: outcome.seconds})
            cap = self._tuner.timed(size, outcome.seconds, outcome.memory, now)
            if cap is not None:
                self.core.set_max_batch_size(cap)
        finally:
            self.pool.kick()
            self._arm_timing()

    # ------------------------------------------------------------------ life cycle

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Fail queued and running work with ``shutting_down``, start nothing more, and wait up to
        ``timeout_s`` for the lanes' current calls (a batch, a timing pass) to return and their
        threads to end: no lane may be inside native code when the interpreter exits. A lane
        still busy then is left to finish on its own, as a hung one is."""
        if self._timing_timer is not None:
            self._timing_timer.cancel()
        self._watch_timer.cancel()
        self.pool.stop(Refusal(ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN))  # (its change cancels the batch timer)
        if not await self._lanes.stop(timeout_s):
            log.warning("policy %s: a lane was still running %.1f s after the stop; left to finish", self.name, timeout_s)
