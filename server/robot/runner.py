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
from collections.abc import Callable, Hashable
from typing import Any, NoReturn

import numpy as np

from chunkline.client.exceptions import ErrorCode
from chunkline.policies.base import Policy
from chunkline.policies.prefix import ActionPrefix
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, CancelOutcome, Request, ServiceTimeModel
from chunkline.server.core.admission.controller import BatchChooser
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.core.timers import EarliestTimer
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import ArrivalRate, BatchPolicy, dispatch_time
from chunkline.server.robot.fleet.urgency import Urgency
from chunkline.server.robot.lanes import BatchOutcome, LanePool, infer_pass, probe_pass, run_batch
from chunkline.server.robot.sizing import BatchSizing
from chunkline.server.robot.timing import TimingOutcome, out_of_memory, timing_pass

__all__ = ["WorkItem", "InferenceResult", "ModelRunner"]

log = logging.getLogger("chunkline.server")
_POLICY_COST = PolicyCost()  # immutable: one batch slot, shared by every policy request


@dataclasses.dataclass(slots=True)
class InferenceResult:
    """One request's share of a batch: its actions and how the batch went (seconds)."""

    actions: np.ndarray  # [H, A] float32
    queue_s: float
    batch_wait_s: float
    infer_s: float
    batch_size: int
    late: bool


@dataclasses.dataclass(eq=False, slots=True)
class WorkItem:
    """An admitted request, from queue to reply.

    Args:
        obs: the validated observation.
        tenant: who sent it. session: where from.
        deadline: absolute, on the runner's clock.
        enqueued_at: admission time, on the runner's clock.
        future: resolved with an :class:`InferenceResult`, or failed with a :class:`Refusal`.
        request_id: its id in the admission core (whose :class:`Request` carries this item as its
            payload: an id here rather than the request keeps the two out of a reference cycle,
            so an answered request's observation, and the buffer it views, is freed at once).
        prefix: the robot's frozen prefix (real-time chunking), if it sent one.
        urgency: how urgent the robot says it is (read by a fleet batch chooser), if it said.
        robot_weight: its robot's service weight within its tenant.
    """

    obs: dict[str, Any]
    tenant: str
    session: str
    deadline: float
    enqueued_at: float
    future: asyncio.Future[InferenceResult]
    request_id: Hashable | None = None
    prefix: ActionPrefix | None = None
    urgency: Urgency | None = None
    robot_weight: float = 1.0


def _fail(item: WorkItem, code: ErrorCode, message: str, retry_after_ms: float | None = None) -> None:
    if not item.future.done():
        item.future.set_exception(Refusal(code, message, retry_after_ms))


def _deadline_of(item: WorkItem) -> float:
    return item.deadline


# Seconds a loop timer may fire ahead of its time (uvloop's timers count whole milliseconds).
_TIMER_RESOLUTION = 0.001
#: The longest mean batch time (of the batch's size, as measured) at which an ``inline_ok`` policy
#: runs on the event loop rather than on a lane: about what the hop to a lane thread and back
#: costs (two thread switches, a GIL hand-over). The mean, not the planning estimate: a noisy
#: machine's deviations must not send a cheap policy to its lane.
INLINE_MAX_S = 100e-6


@dataclasses.dataclass(eq=False, slots=True)
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


@dataclasses.dataclass(eq=False)
class _TimingRun:
    """A background timing pass on a lane: which lane, which batch size, its hang timer."""

    lane: int
    size: int
    busy: int  # admission's token for the worker it occupies
    hang: asyncio.TimerHandle | None = None


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
        sizing: which batch sizes may run and which to time in quiet spells (see
            :mod:`.sizing`; :meth:`start_background_timing` starts the timing); ``None``: every
            size up to ``max_batch_size`` from the first batch, nothing timed in the background.
        clock: monotonic seconds (``time.perf_counter``).
        batch_chooser: picks each batch in place of admission's fair-share EDF pick (the fleet
            strategy: :class:`~chunkline.server.robot.fleet.FleetBatchChooser`); ``None``: that pick.
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
        clock: Callable[[], float] = time.perf_counter,
        batch_chooser: BatchChooser | None = None,
    ) -> None:
        if batching.max_batch_size != admission.max_batch_size:
            raise ValueError("batching and admission must agree on max_batch_size")
        if sizing is not None and sizing.max_batch_size != batching.max_batch_size:
            raise ValueError("sizing and batching must agree on max_batch_size")
        self.name = name
        self.policy = policy
        self.batching = batching
        self.core = AdmissionController(name, quotas, admission, service or ServiceTimeModel())
        self.core.batch_chooser = batch_chooser
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
        self._kicking = False
        self._stopped = False
        # The books of a lone request already answered (see _run_alone): its lane, run, outcome
        # and end time, settled on the loop's next round or before this runner next decides anything.
        self._deferred: tuple[int, _Running, BatchOutcome, float] | None = None
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
        # Batch sizes (see _kick and the "batch sizes" section).
        self._sizing = sizing
        self._dispatch_batching = batching  # `batching` with the batch size sizing allows now
        self._last_arrival = -math.inf
        self._timing_timer: asyncio.TimerHandle | None = None
        self._timing_run: _TimingRun | None = None
        self._timing_since: float | None = None  # when background timing started (serving began)
        #: when the last size within the cap was timed (``None`` until then)
        self.sizes_timed_at: float | None = None

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
        dropped meanwhile, as :meth:`submit` would drop it; nothing is admitted. A refusal's
        retry time is the session's place in the retry line, as :meth:`submit`'s is (see
        :meth:`AdmissionController.appoint`): answer every refusal this returns.

        Args:
            tenant: who sends it.
            session: where from.
            deadline: its absolute deadline, on the runner's clock.
        """
        if self._stopped:
            return Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        if self._deferred is not None:
            self._settle_deferred()
        now = self._clock()
        self.core.expire(now)
        self._answer_dropped()
        decision = self.core.check(self._request(tenant, session, deadline, now, None), now)
        self._refusing = decision is not None
        if decision is None:
            return None
        self._maybe_probe(decision, now)
        return self.core.appoint(decision, session, now)

    def submit(self, obs: dict[str, Any], *, tenant: TenantInfo, session: str, deadline: float,
               prefix: ActionPrefix | None = None, urgency: Urgency | None = None, robot_weight: float = 1.0) -> WorkItem:
        """Offer a validated observation to admission and, if admitted, to the batcher.

        Raises:
            Refusal: ``overloaded``, ``deadline_unmeetable``, ``deadline_exceeded``,
                ``quota_exceeded`` or ``shutting_down``, with the reason.
        """
        if self._stopped:
            raise Refusal(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        if self._deferred is not None:
            self._settle_deferred()
        now = self._clock()
        item = WorkItem(obs=obs, tenant=tenant.name, session=session, deadline=deadline, enqueued_at=now,
                        future=asyncio.get_running_loop().create_future(), prefix=prefix, urgency=urgency,
                        robot_weight=robot_weight)
        request = self._request(tenant, session, deadline, now, item)
        item.request_id = request.id
        if self._alone_inline():
            # Nothing queued, a lane free, a policy that runs on the loop: admitted straight into
            # a batch of its own and run now (no queue to go through; the same rules and counts).
            started = self.core.offer_alone(request, now)
            if started is True:
                self._refusing = False
                # Answered (or failed) before this returns: never pending for its session, only
                # its arrival counts (as _admitted then _answered would leave it, without the churn).
                if session in self._pending_per_session and session not in self._last_seen:
                    self._waiting += 1  # seen again while earlier requests wait: it waits
                self._arrived(session, now)
                self._run_alone(self._lanes.idle.pop(), request, now)
                return item
            if started is not False:
                self._refused(started, session, now)
        decision = self.core.offer(request, now)
        self._answer_dropped()
        if isinstance(decision, Refusal):
            self._refused(decision, session, now)
        self._refusing = False
        self._admitted(item, session, now)
        self._window_start = min(self._window_start, now)
        self._window_deadline = min(self._window_deadline, deadline)
        self._kick()
        self._arm_expiry()
        return item

    def _alone_inline(self) -> bool:
        """Whether a request arriving now would run at once on the loop in a batch of its own:
        an ``inline_ok`` policy measured cheap, nothing queued, a lane free, no pass of the
        runner's own (re-measurement, background timing) under way."""
        return (not self.core.queued and not self._kicking and bool(self._lanes.idle)
                and self._probe is None and self._timing_run is None and self._runs_inline(1))

    def _runs_inline(self, size: int) -> bool:
        """Whether a batch of ``size`` runs on the loop: the policy declares itself trivially cheap
        (``inline_ok``) and such batches are measured so (mean at most :data:`INLINE_MAX_S`)."""
        return self.policy.inline_ok and self.core.service.mean(size) <= INLINE_MAX_S

    def _refused(self, decision: Refusal, session: str, now: float) -> NoReturn:
        self._refusing = True
        self._maybe_probe(decision, now)
        raise self.core.appoint(decision, session, now)

    def _admitted(self, item: WorkItem, session: str, now: float) -> None:
        """An admitted request's bookkeeping: live, pending for its session, its arrival counted;
        :meth:`_answered` once its future is done."""
        self._live.add(item)
        pending = self._pending_per_session.get(session, 0)
        self._pending_per_session[session] = pending + 1
        if pending == 0 or session not in self._last_seen:
            self._waiting += 1  # this session now waits for a reply (and was seen just now)
        item.future.add_done_callback(functools.partial(self._answered, item))
        self._arrived(session, now)

    def _arrived(self, session: str, now: float) -> None:
        """A request of ``session`` admitted at ``now``: the arrival rate and the sessions seen."""
        self._arrivals.observe(now)
        self._last_arrival = now
        self._last_seen[session] = now
        if now - self._pruned_at > 1.0:
            self._prune_sessions(now)

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
        if self._sizing is not None and self._sizing.timing is not None:
            return  # refusing because a timing pass runs, not for stale estimates
        loop = asyncio.get_running_loop()
        probe: asyncio.Future[float] = loop.create_future()
        self._probe = probe
        self._last_sample = now
        lane = self._lanes.idle[0]  # stays idle for the scheduler: a batch sent there queues behind the probe
        submitted = self._clock()

        def done(seconds: float, exc: BaseException | None) -> None:
            self._probe = None
            self._last_sample = self._clock()
            if exc is not None:
                log.warning("policy %s: service re-measurement failed: %s", self.name, exc)
                probe.set_exception(exc)
                return
            self.core.service.observe(1, seconds)
            # the hand-off too: estimates left high by a busy loop come down the same way
            self.core.service.observe_handoff(self._last_sample - submitted - seconds)
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
        if item.request_id is not None and not item.future.done():
            outcome = self.core.cancel(item.request_id, self._clock())
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
        if self.core.queued:  # an empty queue expires nothing (next_expiry: None), and is the usual case
            self._expiry.arm(self.core.next_expiry())

    def _on_expiry(self) -> None:
        self.core.expire(self._clock())
        self._answer_dropped()
        self._arm_expiry()

    # ------------------------------------------------------------------ dispatch

    def sent_early(self, session: str) -> None:
        """``session`` sent a request before the retry time it was given (refused at the door):
        its place in the retry line no longer counts ahead of sessions that wait as told."""
        self.core.retry_line.forfeit(session)

    def release_session(self, session: str) -> None:
        """The session ended: free its policy state and its place in the retry line."""
        self._states.pop(session, None)
        self.core.retry_line.leave(session)

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
        if self._kicking:  # an inline batch finished inside this very loop: it goes on by itself
            return
        if self._deferred is not None:
            self._settle_deferred()  # which kicks if anything is queued
            return
        self._kicking = True
        try:
            self._dispatch()
        finally:
            self._kicking = False

    def _dispatch(self) -> None:
        while self._lanes.idle:
            queued = self.core.queued  # read once per round
            if not queued or self._stopped:
                break
            now = self._clock()
            batching = self._batching_now()
            # A batch that would run on the loop starts at once: waiting for a fuller one would
            # save microseconds of a batch that costs less than INLINE_MAX_S in all, at the price
            # of the robots' wait (up to max_batch_wait) while the lane sits idle.
            start_at = now if self._runs_inline(min(queued, batching.max_batch_size)) else dispatch_time(
                now,
                queued=queued,
                oldest_arrival=self._window_start,
                earliest_deadline=self._window_deadline,
                policy=batching,
                predict=self.core.service.predict,
                arrival_rate=self._expected_arrival_rate(now),
                per_batch=self.core.service.handoff_snapshot()[0],
            )
            if start_at > now:
                if self._batch_timer is None:
                    self._batch_timer = asyncio.get_running_loop().call_later(start_at - now, self._on_batch_timer)
                return
            batch = self.core.next_batch(now, batching.max_batch_size, self._compatible)
            self._answer_dropped()
            if not batch:
                return
            lane = self._lanes.idle.pop()
            if self._runs_inline(len(batch)):
                # Batches that turn out slower (several robots' images stacked) raise the mean,
                # and go to the lane.
                self._run_inline(lane, batch, now)
                continue
            args = self._batch_args([r.payload for r in batch])
            # Watchdog: each request is failed at its own deadline if the batch is still running;
            # a batch far beyond any expectation is declared hung and its lane replaced.
            enforce = self.core.config.enforces_deadlines
            hang_after = max(self._hang_timeout, 10 * self.core.service.predict(len(batch)))
            run = self._running[lane] = _Running(batch, sorted((r.payload for r in batch), key=_deadline_of, reverse=True)
                                                 if enforce else [], now, now + hang_after)
            self._lanes.submit(lane, run_batch, args, functools.partial(self._finished, lane, run))
            self._watchdog.arm(run.next_due())
        if self._batch_timer is not None and (not self.core.queued or not self._lanes.idle):
            self._batch_timer.cancel()
            self._batch_timer = None

    def _batch_args(self, items: list[WorkItem]) -> tuple[Policy, list[dict[str, Any]], list[Any] | None, list[ActionPrefix | None] | None]:
        """What :func:`run_batch` takes for these requests: the policy, their observations, their
        sessions' states (stateful policies) and prefixes (policies that take one)."""
        states = [self._state_of(i.session) for i in items] if self.policy.stateful else None
        prefixes = [i.prefix for i in items] if self.policy.accepts_prefix else None
        return self.policy, [i.obs for i in items], states, prefixes

    def _state_of(self, session: str) -> Any:
        """A stateful policy's state for ``session`` (a fresh one for a session it has not seen)."""
        return self._states[session] if session in self._states else self.policy.new_session_state()

    def _run_inline(self, lane: int, batch: list[Request], now: float) -> None:
        """Run a batch on the loop, now, on ``lane`` (taken from the idle ones). It ends before the
        loop runs anything else: no deadline or hang to watch."""
        run = self._running[lane] = _Running(batch, [], now, math.inf)
        try:
            outcome: BatchOutcome | None = run_batch(*self._batch_args([r.payload for r in batch]))
        except Exception as exc:
            self._finished(lane, run, None, exc)
        else:
            self._finished(lane, run, outcome, None)

    def _run_alone(self, lane: int, request: Request, now: float) -> None:
        """Run a request that arrived to an idle runner on the loop, now, on ``lane`` (taken from
        the idle ones), in a batch of its own: :meth:`_run_inline`'s pass for a batch of one,
        answered at once, with its books (:meth:`_settle`) left to :meth:`_settle_deferred`.

        The books wait for the loop's next round, or less: every runner method that reads them
        (:meth:`submit`, :meth:`precheck`, :meth:`_kick`, :meth:`stop`) settles them first, so no
        decision sees them open. The robot's reply is written before they are done rather than
        after, and a batch of one needs none of the batch's lists (their arguments, their
        outcome, the split of its results): on the reply's critical path, 12 us fewer for the
        books and 6.6 us fewer for the lists (in-process A/B, ``docs/benchmarks.md``).
        """
        item: WorkItem = request.payload
        run = self._running[lane] = _Running([request], [], now, math.inf)
        policy = self.policy
        session = item.session
        states = [self._state_of(session)] if policy.stateful else None
        started = time.perf_counter()
        try:
            actions, states = infer_pass(policy, [item.obs], states, [item.prefix] if policy.accepts_prefix else None)
        except Exception as exc:  # as run_batch: a batch of one that fails is not run again
            self._finished(lane, run, None, exc)
            return
        infer_s = time.perf_counter() - started
        end = self._clock()
        own = actions[0]
        if states is not None:
            self._states[session] = states[0]
        # Nothing before it and no batch to fill: no time queued or waiting for company.
        item.future.set_result(InferenceResult(actions=own, queue_s=0.0, batch_wait_s=0.0, infer_s=infer_s,
                                               batch_size=1, late=end > item.deadline))
        self._deferred = (lane, run, ([own], infer_s, states, None), end)
        asyncio.get_running_loop().call_soon(self._settle_deferred)

    def _on_batch_timer(self) -> None:
        self._batch_timer = None
        self._kick()

    def _on_watchdog(self) -> None:
        if self._stopped:  # stop() answered everything; a hung batch is no longer replaced
            return
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
        self._size_failed(len(run.batch), "hung")
        self._kick()

    def _finished(self, lane: int, run: _Running, outcome: BatchOutcome | None, exc: BaseException | None) -> None:
        """On the loop, once per batch: the lane's outcome split back to the batch's requests,
        then the batch's books."""
        if self._running.get(lane) is not run:  # a call declared hung has returned at last
            self._lanes.hung -= 1
            log.warning("policy %s: the hung call on lane %d returned", self.name, lane)
            return
        now = self._clock()
        if exc is None and outcome is not None:
            self._answer(run, outcome, now, self._lanes.free_at[lane])
        self._settle(lane, run, outcome, exc, now)

    def _answer(self, run: _Running, outcome: BatchOutcome, now: float, free_since: float) -> None:
        """A batch's results to its requests' futures (``now``: when it ended; ``free_since``:
        when its lane was freed before it)."""
        actions, infer_s, states, _ = outcome
        batch, started = run.batch, run.started
        size = len(batch)
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
                    batch_size=size,
                    late=now > item.deadline,
                )
            )

    def _settle(self, lane: int, run: _Running, outcome: BatchOutcome | None, exc: BaseException | None, now: float) -> None:
        """A batch's books once it ended at ``now``: its lane freed, admission and the service
        model told, a failed batch's requests failed; then the next batch started."""
        del self._running[lane]
        batch = run.batch
        size = len(batch)
        self._lanes.release(lane, now)
        try:
            if exc is not None or outcome is None:
                if isinstance(exc, concurrent.futures.CancelledError):  # never ran: the lanes shut down
                    self.core.complete_batch(batch, now, None)
                    for r in batch:
                        _fail(r.payload, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
                    return
                # The policy's failure fails this batch only; the lane lives on.
                log.warning("policy %s failed on a batch of %d: %s", self.name, size, type(exc).__name__, exc_info=exc)
                self.core.complete_batch(batch, now, None)
                for r in batch:
                    _fail(r.payload, ErrorCode.POLICY_FAILED, f"policy raised {type(exc).__name__}")
                return
            actions, infer_s, _, batch_error = outcome
            if batch_error is not None and out_of_memory(batch_error):  # its robots were then run one at a time
                self._size_failed(size, "ran out of memory")
            # Requests fail one by one only where the batch's own pass failed and each ran alone.
            failed = [a for a in actions if isinstance(a, BaseException)] if batch_error is not None else None
            if failed:
                log.warning("policy %s failed on %d of a batch of %d: %s", self.name, len(failed), size,
                            type(failed[0]).__name__, exc_info=failed[0])
            # A batch that needed isolating ran more than one pass: its time is no service sample.
            isolated = bool(failed) or batch_error is not None
            self.core.complete_batch(batch, now, None if isolated else infer_s)
            if not isolated:
                self._last_sample = now
                if self._sizing is not None and size not in self._sizing.timed:
                    self._sizing.measured(size)  # first use: the next rung may be tried
            if self._on_batch is not None:
                self._on_batch(size, infer_s)
        finally:
            if self.core.queued or self._batch_timer is not None:  # else there is nothing to dispatch or cancel
                self._kick()
            self._arm_expiry()
            if self._timing_timer is None:
                self._arm_timing()

    def _settle_deferred(self) -> None:
        """The books of the lone request answered last, if still open (see :meth:`_run_alone`)."""
        deferred = self._deferred
        if deferred is not None:
            self._deferred = None
            lane, run, outcome, end = deferred
            self._settle(lane, run, outcome, None, end)

    # ------------------------------------------------------------------ batch sizes

    @property
    def sizing(self) -> BatchSizing | None:
        """Which batch sizes may run, which are timed (``None``: every size, from the first batch)."""
        return self._sizing

    @property
    def max_batch_size(self) -> int:
        """The most robots per batch now: the configured size, or lower once a size has run out of
        memory, hung or failed the memory guard."""
        return self.core.config.max_batch_size

    def _batching_now(self) -> BatchPolicy:
        """The batching rule with the batch size allowed now (one rung more under a backlog)."""
        if self._sizing is None:
            return self.batching
        limit = self._sizing.limit(self.core.queued)
        if limit != self._dispatch_batching.max_batch_size:
            if limit > self._dispatch_batching.max_batch_size and limit not in self._sizing.timed:
                log.info("policy %s: %d requests queued; first batch of %d", self.name, self.core.queued, limit)
            self._dispatch_batching = dataclasses.replace(self.batching, max_batch_size=limit)
        return self._dispatch_batching

    def _size_failed(self, size: int, reason: str) -> None:
        """A batch of ``size`` ran out of memory or hung: cap the batch size below it."""
        if self._sizing is None:
            return
        self._sizing.failed(size, reason)
        self._apply_cap()

    def _apply_cap(self) -> None:
        sizing = self._sizing
        if sizing is None or sizing.cap >= self.max_batch_size:
            return
        log.warning("policy %s: %s; serving at most %d robots per batch", self.name, sizing.cap_reason, sizing.cap)
        self.core.set_max_batch_size(sizing.cap)
        self.batching = dataclasses.replace(self.batching, max_batch_size=sizing.cap)
        self._note_sizes_done()

    def start_background_timing(self) -> None:
        """Serving has begun: time the batch sizes not timed yet in quiet spells (call on the loop)."""
        if self._sizing is None or self._timing_since is not None:
            return
        self._timing_since = self._clock()
        if self._sizing.done:  # everything was timed at start-up: nothing to say
            self.sizes_timed_at = self._timing_since
            return
        self._arm_timing()

    def _note_sizes_done(self) -> None:
        if self._sizing is not None and self._sizing.done and self.sizes_timed_at is None and self._timing_since is not None:
            self.sizes_timed_at = self._clock()
            if self._sizing.background:
                log.info("policy %s: every batch size up to %d timed, %.1f s after ready", self.name, self._sizing.cap,
                         self.sizes_timed_at - self._timing_since)

    def _arm_timing(self) -> None:
        """Time the next size if the runner is idle and quiet, else arm a timer for when it may be.

        Requests arriving while the timer runs do not re-arm it (no work on the request path):
        when it fires, the quiet spell is judged again from the latest arrival."""
        sizing = self._sizing
        if sizing is None or self._stopped or self._timing_since is None:
            return
        nxt = sizing.next_timing(self._last_arrival, self.core.service.predict)
        if nxt is None:
            return
        size, at = nxt
        now = self._clock()
        if at > now:
            self._timing_timer = asyncio.get_running_loop().call_later(at - now, self._on_timing_timer)
        elif not (self.core.queued or self.core.running or self._probe is not None
                  or len(self._lanes.idle) < self._lanes.count):
            self._start_timing(size)
        # else busy: the batch that finishes arms it again

    def _on_timing_timer(self) -> None:
        self._timing_timer = None
        self._arm_timing()

    def _start_timing(self, size: int) -> None:
        """Time ``size`` on a lane with example observations. Admission plans around the pass as
        around a running batch (a request arriving meanwhile is refused if it cannot wait for it,
        the quiet rule makes that rare); a pass past the hang timeout caps the batch size as a
        hung batch does."""
        assert self._sizing is not None
        self._sizing.started(size)
        lane = self._lanes.idle.pop()
        predicted = self.core.service.predict(size)
        run = self._timing_run = _TimingRun(lane, size, self.core.occupy_worker(self._clock(), predicted))
        run.hang = asyncio.get_running_loop().call_later(max(self._hang_timeout, 10 * predicted), self._timing_hung, run)
        log.info("policy %s: quiet; timing batch %d in the background ...", self.name, size)
        self._lanes.submit(lane, timing_pass, (self.policy, size), functools.partial(self._timed, run))

    def _timing_hung(self, run: _TimingRun) -> None:
        if self._timing_run is not run or self._stopped:
            return
        self._timing_run = None
        self.core.release_worker(run.busy)
        log.error("policy %s: timing batch %d has run past the hang timeout; replacing lane %d", self.name, run.size, run.lane)
        self._lanes.replace(run.lane)
        self._size_failed(run.size, "hung")
        self._kick()
        self._arm_timing()

    def _timed(self, run: _TimingRun, outcome: TimingOutcome | None, exc: BaseException | None) -> None:
        if run.hang is not None:
            run.hang.cancel()
        if self._timing_run is not run:  # declared hung, returned at last (its worker released then)
            self._lanes.hung -= 1
            log.warning("policy %s: the hung timing call on lane %d returned", self.name, run.lane)
            return
        self._timing_run = None
        self.core.release_worker(run.busy)
        assert self._sizing is not None
        size = run.size
        self._lanes.release(run.lane, self._clock())  # a request that came meanwhile queued behind the pass
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
            self._sizing.record_timing(size, outcome.memory)
            assert self._timing_since is not None
            memory = "" if outcome.memory is None else f", peak {outcome.memory.peak / 2**20:.0f} MiB"
            log.info("policy %s: batch %d takes %.2f ms (timed in the background%s; %d sizes left, %.1f s after ready)",
                     self.name, size, outcome.seconds * 1e3, memory, len(self._sizing.pending), self._clock() - self._timing_since)
            self._apply_cap()
            self._note_sizes_done()
        finally:
            self._kick()
            self._arm_timing()

    # ------------------------------------------------------------------ life cycle

    async def stop(self) -> None:
        """Fail queued work with ``shutting_down`` and release the lane threads."""
        self._stopped = True
        self._settle_deferred()  # its books, before the timers they may arm are cancelled
        if self._batch_timer is not None:
            self._batch_timer.cancel()
        if self._timing_timer is not None:
            self._timing_timer.cancel()
        self._expiry.cancel()
        self._watchdog.cancel()
        for item in list(self._live):
            self.cancel(item, ErrorCode.SHUTTING_DOWN)
        self._answer_dropped()
        self._lanes.shutdown()
