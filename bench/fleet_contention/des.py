"""Discrete-event mode: the same sans-I/O cores on an injected clock, for 1,000-10,000 robots.

The server's admission (:class:`~chunkline.server.core.admission.AdmissionController`, through
``offer``, ``next_batch``, ``take_dropped`` and ``complete_batch`` only; with ``strategy="fleet"``
behind the :class:`~chunkline.server.robot.fleet.FleetSelector` the server uses), its batching decision
(:func:`~chunkline.server.robot.batching.dispatch_time`) on one lane, and per robot the
:class:`~chunkline.broker.Broker` core; a batch takes the workload's latency for its size, a reply
reaches its robot after the robot's network delay (as in the wall-clock mode and FleetVLA).
Requests that robots send at the same instant reach the server ``send_cost_s`` apart (one
robot's tick, encode and send: the wall-clock mode's robots share one process, and real robots'
clocks are not in phase), so the lane does not see a fleet's requests land as one; each reply
also pays ``reply_overhead_s``, what the real stack adds to a round trip besides queueing,
inference and the network (encode, send, decode, the event loops' wake-ups). Both jitter as they
do live (:class:`Jitter`, seeded: a run is reproducible), so a schedule that holds only on exact
timing does not look better here than it does on the wall clock.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from chunkline.broker import ActionChunk, Broker, BrokerConfig
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.robot.batching import ArrivalRate, BatchPolicy, dispatch_time
from chunkline.server.robot.fleet import FleetConfig, FleetSelector, FleetStrategy, Urgency, urgency_from_wire

from .metrics import RobotRecord
from .policy import planned_rows
from .wallclock import ACTION_DIM
from .workload import Workload, chunk_rows

__all__ = ["run_des", "DES_STRATEGIES", "Jitter"]

# event kinds in the order they run at one instant (FleetVLA's order)
_DONE, _DELIVER, _ERROR, _ARRIVE, _TICK, _DISPATCH = range(6)


#: seconds between two requests sent at one instant reaching the server (see the module docstring)
SEND_COST_S = 0.0003
#: seconds a reply costs besides queueing, inference and the network: the wall-clock mode's round
#: trips less those, on a loaded 2-core machine (the medians 200 ms against 188 ms of server time
#: and 5 ms of network, of which 4 ms in the server around the inference)
REPLY_OVERHEAD_S = 0.008


@dataclasses.dataclass(frozen=True, slots=True)
class Jitter:
    """Random delays as the wall-clock mode shows them, each exponential with the given mean:
    a request's send past its robot's tick (event-loop lateness, encoding), a reply's overhead
    past its floor (the overhead's mean stays ``reply_overhead_s``), the worker's gap after
    a batch before it chooses the next (handing results off, the loop's wake-up) past
    ``gap_floor_s``, and each control tick's lateness past its due time (a timer's wake-up) past
    ``tick_floor_s``: a robot observes at the late tick, so its plan's grid sits off its tick
    grid by the difference of two ticks' lateness. ``seed`` makes a run reproducible.
    ``Jitter(0, 0, 0, 0, 0, 0)``: exact timing."""

    send_mean_s: float = 0.001
    reply_mean_s: float = 0.0025
    gap_mean_s: float = 0.0005
    gap_floor_s: float = 0.0009
    tick_mean_s: float = 0.0006
    tick_floor_s: float = 0.001
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.send_mean_s, self.reply_mean_s, self.gap_mean_s, self.gap_floor_s, self.tick_mean_s,
               self.tick_floor_s) < 0:
            raise ValueError("jitter means and floor must be >= 0")


def _draw(rng: random.Random, mean: float) -> float:
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Work:
    """A queued request's payload: what the fleet strategy reads (:class:`~chunkline.server.robot.fleet.FleetWork`)
    and what its chunk is planned from."""

    enqueued_at: float
    urgency: Urgency | None
    robot_weight: float
    obs_time: float
    state: np.ndarray
    frozen: np.ndarray | None
    request_id: int  # the broker's id it answers
    queued_since: float | None = None  # a refresh (``replaces``): when the place it took was first queued


class _Sim:
    """One discrete-event run of a workload. Its attributes are the whole simulated world (the
    robots' brokers and records, the link, the server's admission and batching, the event heap),
    kept in one object so that each event handler reads what it needs without passing it round."""

    def __init__(self, w: Workload, config_for: Callable[[Any], BrokerConfig], send_cost_s: float,
                 reply_overhead_s: float, strategy: str, rows_from: str, jitter: Jitter,
                 fleet_config: FleetConfig | None = None) -> None:
        if reply_overhead_s < jitter.reply_mean_s:
            raise ValueError("reply_overhead_s must cover the reply jitter's mean")
        self.w = w
        self.jitter = jitter
        # One stream per robot and kind of delay, the worker's gaps one more: a change in one
        # robot's traffic (a refresh sent or not) leaves every other delay as it was drawn, so
        # two runs A/B'd on a seed differ by what they do, not by a reshuffled draw.
        self.rng = random.Random(jitter.seed)
        self.streams = [[random.Random(f"{jitter.seed}/{i}/{kind}") for kind in ("tick", "send", "refresh", "reply")]
                        for i in range(len(w.robots))]
        self.rows = [chunk_rows(r, rows_from) for r in w.robots]
        self.send_cost_s = send_cost_s
        self.reply_overhead_s = reply_overhead_s
        self.link_free = 0.0
        self.events: list[tuple[float, int, int, int, Any]] = []
        self.order = itertools.count()
        self.robots = w.robots
        self.brokers = [Broker(config_for(r), initial_position=np.zeros(ACTION_DIM), limits=None, verify_fallback=False)
                        for r in w.robots]
        self.records = [RobotRecord(r.weight) for r in w.robots]
        self.states = [np.zeros(ACTION_DIM) for _ in w.robots]
        self.obs_times: list[dict[int, float]] = [{} for _ in w.robots]
        self.sent: list[dict[int, float]] = [{} for _ in w.robots]  # request id -> when it was sent
        curve = {b: w.latency_s(b) for b in range(1, w.max_batch + 1)}
        registry = TenantRegistry({"fleet": TenantInfo("fleet")})
        self.admission = AdmissionController("m", QuotaManager(registry),
                                             AdmissionConfig(max_batch_size=w.max_batch, workers=1, max_queue=max(256, 4 * len(w.robots))),
                                             ServiceTimeModel(initial=curve),
                                             _selector(strategy, fleet_config))
        self.batching = BatchPolicy(max_batch_size=w.max_batch)
        self.rate = ArrivalRate()
        self.queued: dict[Any, tuple[float, float]] = {}  # request id -> (arrival, deadline)
        #: (robot, broker request id) -> its request's id in admission (a refresh takes the place it replaces)
        self.places: dict[tuple[int, int], Any] = {}
        self.busy = False
        self.wakeup = float("inf")

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (t, kind, next(self.order), kind, payload))

    def run(self) -> list[RobotRecord]:
        duration = self.w.duration_s
        for i, r in enumerate(self.robots):
            self.push(r.start_s + self.tick_lateness(i), _TICK, (i, 0))
        while self.events and self.events[0][0] <= duration:
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, _, _, kind, payload = heapq.heappop(self.events)
                self.handle(now, kind, payload)
            self.maybe_dispatch(now)
        return self.records

    def handle(self, now: float, kind: int, payload: Any) -> None:
        if kind == _TICK:
            self.tick(now, *payload)
        elif kind == _ARRIVE:
            self.arrive(now, *payload)
        elif kind == _DONE:
            self.done(now, payload)
        elif kind == _DELIVER:
            i, chunk = payload
            self.brokers[i].on_chunk(chunk, now)
            self.records[i].replay.chunk(int(chunk.request_id), len(chunk.actions))
            self.records[i].on_reply(chunk.timing, now - self.sent[i].pop(int(chunk.request_id), now))
        elif kind == _ERROR:
            i, rid, code, retry = payload
            self.sent[i].pop(rid, None)
            self.records[i].on_error(code)
            self.brokers[i].on_error(now, request_id=rid, code=code, retry_after_s=retry)

    def tick(self, now: float, i: int, k: int) -> None:
        robot, broker, rec = self.robots[i], self.brokers[i], self.records[i]
        state = self.states[i]
        cmd = broker.tick(now, {"state": state}, state=state)
        if k > 0:  # the first control tick is one period after the start
            rec.ticks += 1
            rec.replay.tick(now)
            if cmd.chunk_id is not None:
                rec.executed += 1
                obs_time = self.obs_times[i].get(int(cmd.chunk_id))
                if obs_time is not None:
                    rec.ages.append(now - obs_time)
        self.states[i] = np.asarray(cmd.action, dtype=np.float64)
        req = cmd.request
        if req is not None:
            broker.on_sent(req.request_id, now)
            self.sent[i][req.request_id] = self.sent[i].get(req.replaces, now) if req.replaces is not None else now
            self.obs_times[i][req.request_id] = req.obs_time
            if req.replaces is None:
                rec.requests += 1
            else:
                rec.refreshes += 1
            rec.replay.request(req.request_id, req.obs_time)
            rng = self.streams[i][1 if req.replaces is None else 2]
            self.link_free = max(now + _draw(rng, self.jitter.send_mean_s), self.link_free) + self.send_cost_s
            frozen = None if req.prefix is None or not req.prefix_delay else np.array(req.prefix[: req.prefix_delay])
            self.push(self.link_free, _ARRIVE, (i, req.request_id, req.obs_time, state.copy(), req.deadline_ms, req.urgency,
                                                frozen, req.replaces))
        self.push(robot.start_s + (k + 1) * robot.period + self.tick_lateness(i), _TICK, (i, k + 1))

    def tick_lateness(self, i: int) -> float:
        return self.jitter.tick_floor_s + _draw(self.streams[i][0], self.jitter.tick_mean_s)

    def arrive(self, now: float, i: int, rid: int, obs_time: float, state: np.ndarray, deadline_ms: float, urgency: Any,
               frozen: np.ndarray | None, replaces: int | None) -> None:
        deadline = now + deadline_ms / 1000.0
        work = _Work(now, None if urgency is None else urgency_from_wire(urgency.wire()), self.robots[i].weight, obs_time, state,
                     frozen, rid)
        if replaces is not None:
            self.refresh(now, i, work, replaces, deadline)
            return
        self.rate.observe(now)
        req = Request((i, rid), f"robot{i}", "fleet", "policy", PolicyCost(), deadline, payload=work)
        verdict = self.admission.offer(req, now)
        if isinstance(verdict, Admitted):
            self.queued[req.id] = (now, deadline)
            self.places[(i, rid)] = req.id
        else:
            self.push(now, _ERROR, (i, rid, str(verdict.code_str), _seconds(verdict.retry_after_ms)))

    def refresh(self, now: float, i: int, work: _Work, replaces: int, deadline: float) -> None:
        """``work`` in the place of request ``replaces`` of robot ``i`` (as the server's
        :meth:`~chunkline.server.core.admission.AdmissionController.replace`), that one answered
        ``superseded``; ``replace_missed`` once it left the queue."""
        place = self.places.get((i, replaces))
        since = self.queued[place][0] if place in self.queued else now
        work = dataclasses.replace(work, queued_since=since)
        verdict = self.admission.replace(place, f"robot{i}", deadline, work, now) if place is not None else None
        self.take_dropped(now)
        if not isinstance(verdict, Admitted):
            code = "replace_missed" if verdict is None else str(verdict.code_str)
            self.push(now, _ERROR, (i, work.request_id, code, None if verdict is None else _seconds(verdict.retry_after_ms)))
            return
        del self.places[(i, replaces)]
        self.places[(i, work.request_id)] = place
        self.queued[place] = (since, verdict.request.deadline)
        self.push(now, _ERROR, (i, replaces, "superseded", None))

    def maybe_dispatch(self, now: float) -> None:
        if self.busy or not self.queued:
            return
        arrivals = [a for a, _ in self.queued.values()]
        deadlines = [d for _, d in self.queued.values()]
        at = dispatch_time(now, queued=len(self.queued), oldest_arrival=min(arrivals), earliest_deadline=min(deadlines),
                           policy=self.batching, predict=self.w.latency_s, arrival_rate=self.rate.rate(now))
        if at > now:
            if at < self.wakeup:
                self.wakeup = at
                self.push(at, _DISPATCH, None)
            return
        self.wakeup = float("inf")
        batch = self.admission.next_batch(now)
        wake = self.admission.wake_at()
        if not batch and self.queued and now < wake < float("inf"):  # the selector waits for requests it expects
            self.wakeup = wake
            self.push(wake, _DISPATCH, None)
        self.take_dropped(now)
        if not batch:
            return
        started = [self.queued.pop(r.id) for r in batch]
        service = self.w.latency_s(len(batch))
        self.busy = True
        timing = [{"queue_ms": 1000.0 * (now - a), "infer_ms": 1000.0 * service, "batch_size": float(len(batch))}
                  for a, _ in started]
        gap = self.jitter.gap_floor_s + _draw(self.rng, self.jitter.gap_mean_s)
        self.push(now + service + gap, _DONE, (batch, service, timing, gap))

    def take_dropped(self, now: float) -> None:
        for dropped in self.admission.take_dropped():
            self.queued.pop(dropped.request.id, None)
            i, rid = cast(tuple[int, int], dropped.request.id)[0], cast(_Work, dropped.request.payload).request_id
            self.places.pop((i, rid), None)
            self.push(now, _ERROR, (i, rid, str(getattr(dropped.code, "value", dropped.code)), _seconds(dropped.retry_after_ms)))

    def done(self, now: float, payload: tuple[list[Request], float, list[dict[str, float]], float]) -> None:
        batch, service, timings, gap = payload
        self.busy = False
        for timing in timings:  # as the server's replies say: the requests still queued as the batch ended
            timing["backlog"] = float(len(self.queued))
        self.admission.complete_batch(batch, now, service_time=service)
        for req, timing in zip(batch, timings, strict=True):
            work = cast(_Work, req.payload)
            i, rid = cast(tuple[int, int], req.id)[0], work.request_id
            self.places.pop((i, rid), None)
            robot = self.robots[i]
            obs_time = work.obs_time
            n = self.rows[i]
            rows = planned_rows(work.state, n, work.frozen)
            chunk = ActionChunk(rows, obs_time, robot.period, obs_time + n * robot.period, request_id=rid,
                                timing=timing)
            overhead = self.reply_overhead_s - self.jitter.reply_mean_s + _draw(self.streams[i][3], self.jitter.reply_mean_s)
            self.push(now - gap + overhead + robot.network_ms / 1000.0, _DELIVER, (i, chunk))


#: the server strategies the DES runs: ``fleet-now`` is the fleet strategy without reservation
#: (it never waits for expected requests), an A/B baseline
DES_STRATEGIES = ("admission", "fleet", "fleet-now")


def _selector(strategy: str, config: FleetConfig | None = None) -> FleetSelector | None:
    if strategy not in DES_STRATEGIES:
        raise ValueError(f"strategy must be one of {DES_STRATEGIES}, not {strategy!r}")
    return None if strategy == "admission" else FleetSelector(FleetStrategy(config), lambda _: 1.0, reserve=strategy == "fleet")


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def run_des(w: Workload, config_for: Callable[[Any], BrokerConfig], send_cost_s: float = SEND_COST_S,
            reply_overhead_s: float = REPLY_OVERHEAD_S, strategy: str = "admission",
            rows_from: str = "next-tick", jitter: Jitter | None = None,
            fleet_config: FleetConfig | None = None) -> list[RobotRecord]:
    """One simulated run of ``w``; ``config_for(robot)`` gives each robot's broker settings;
    ``strategy`` is the server's ``batch_strategy`` (:data:`DES_STRATEGIES`); ``rows_from``
    where a chunk's rows start (:data:`~.workload.ROWS_FROM`); ``jitter``: the live timing's
    (:class:`Jitter`'s defaults) unless given; ``fleet_config``: the fleet strategy's settings
    (its defaults, the server's, unless given)."""
    return _Sim(w, config_for, send_cost_s, reply_overhead_s, strategy, rows_from,
                Jitter() if jitter is None else jitter, fleet_config).run()
