"""Batch-selection strategies on a robot fleet, in a discrete-event simulation (no wall clock).

Robots tick at their control rate; a tick executes the row of the robot's latest chunk at the
robot's progress (rows it has executed), or is starved when the chunk has none left. A chunk
answers the observation taken at some progress: the rows before the progress reached when it
lands were run from the previous chunk. A robot with at most ``threshold_s`` of plan left and
nothing pending sends one request, with its urgency. One worker runs one batch at a time, on the
workload's curve; a chunk lands a network delay after its batch ends. FleetVLA's metrics.

``python -m chunkline.bench.fleet_strategies`` prints round robin, EDF and the fleet strategy
(:mod:`chunkline.server.robot.fleet`), without and with reservation (it may leave the worker idle
until a request its robot's cycle predicts arrives: ``reserve``), on Armory's L40S workload, with
and without its weight-5 robot, and on a hundred robots: "weight 5" is the weight-5 robots' progress (at equal weights, the
robot that has it otherwise), "shifted" the useful actions run time-shifted (:class:`FleetMetrics`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from chunkline.server.robot.fleet.calendar import Reserver
from chunkline.server.robot.fleet.strategy import FleetCandidate, FleetConfig, FleetStrategy, LatencyCurve
from chunkline.server.robot.fleet.urgency import Urgency

__all__ = ["RobotSpec", "Workload", "Scheduler", "RoundRobin", "EarliestDeadline", "FleetScheduler",
           "FleetMetrics", "simulate", "armory_l40s", "hundred_robots", "main"]


@dataclasses.dataclass(frozen=True, slots=True)
class RobotSpec:
    """One robot: ``hz`` control rate, ``rows`` per chunk, service ``weight``, one-way ``net_s``,
    ``budget_s`` (EDF's latency budget), ``deadline_s`` (the hard deadline of its requests)."""

    name: str
    hz: float
    rows: int
    weight: float = 1.0
    net_s: float = 0.005
    budget_s: float = 0.5
    deadline_s: float = 1.0
    threshold_s: float = 0.1
    start_s: float = 0.0
    tenant: str = "fleet"


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    robots: tuple[RobotSpec, ...]
    curve: tuple[float, ...]  # seconds per batch of 1, 2, ...
    max_batch: int
    duration_s: float

    def latency(self, size: int) -> float:
        return self.curve[min(size, len(self.curve)) - 1]


def armory_l40s(weighted: bool = True) -> Workload:
    """Armory's L40S workload: ten robots at 20 Hz, one with 6-row chunks (weight 5, or 1 when
    not ``weighted``) and nine with 10; batches of at most 3; 5 ms network; 10 s."""
    fast = RobotSpec("fast-0", 20.0, 6, 5.0 if weighted else 1.0, budget_s=0.3)
    slow = tuple(RobotSpec(f"slow-{i}", 20.0, 10, 1.0) for i in range(9))
    return Workload((fast, *slow), (0.073, 0.1098, 0.1424, 0.1775, 0.2111), 3, 10.0)


def hundred_robots() -> Workload:
    """A hundred robots at 20 Hz, one in ten with 6-row chunks at weight 5, the rest 10 rows at
    weight 1, starting over 0.1 s; 40 ms + 10 ms per robot a batch, at most 16; 10 s."""
    robots = tuple(RobotSpec(f"r{i:03d}", 20.0, 6 if i % 10 == 0 else 10, 5.0 if i % 10 == 0 else 1.0,
                             start_s=(i % 20) * 0.005) for i in range(100))
    return Workload(robots, tuple(0.04 + 0.01 * b for b in range(1, 17)), 16, 10.0)


class Scheduler(Protocol):
    def pick(self, now: float, queued: Sequence[FleetCandidate], latency: LatencyCurve, max_batch: int) -> tuple[Hashable, ...]: ...


def _robot(c: FleetCandidate) -> str:
    return str(c.key).split("#", 1)[0]  # the simulation's request keys are "robot#n"


class RoundRobin:
    """Rotate over the robots with a request queued, by name, a full batch at a time."""

    def __init__(self) -> None:
        self._next: str | None = None

    def pick(self, now: float, queued: Sequence[FleetCandidate], latency: LatencyCurve, max_batch: int) -> tuple[Hashable, ...]:
        names = sorted(_robot(c) for c in queued)
        start = next((i for i, n in enumerate(names) if self._next is not None and n >= self._next), 0)
        chosen = (names[start:] + names[:start])[:max_batch]
        self._next = names[(names.index(chosen[-1]) + 1) % len(names)]
        by_name = {_robot(c): c.key for c in queued}
        return tuple(by_name[n] for n in chosen)


class EarliestDeadline:
    """A full batch in order of the earlier of the request's budget and its plan's end."""

    def __init__(self, budgets: dict[str, float]) -> None:
        self._budgets = budgets

    def pick(self, now: float, queued: Sequence[FleetCandidate], latency: LatencyCurve, max_batch: int) -> tuple[Hashable, ...]:
        def key(c: FleetCandidate) -> tuple[float, float, str]:
            dry = c.arrival + c.urgency.dry_in_s if c.urgency is not None else math.inf
            return (min(c.arrival + self._budgets[_robot(c)], dry), c.arrival, _robot(c))
        return tuple(c.key for c in sorted(queued, key=key)[:max_batch])


class FleetScheduler:
    """The fleet strategy (:class:`~chunkline.server.robot.fleet.strategy.FleetStrategy`); with
    ``reserve``, through its :class:`~chunkline.server.robot.fleet.calendar.Reserver`: nothing
    picked and :attr:`resume_at` set when it waits for an expected request."""

    def __init__(self, config: FleetConfig | None = None, reserve: bool = False) -> None:
        self.strategy = FleetStrategy(config)
        self.reserver = Reserver(self.strategy, reserve)
        self.resume_at = math.inf

    def pick(self, now: float, queued: Sequence[FleetCandidate], latency: LatencyCurve, max_batch: int) -> tuple[Hashable, ...]:
        choice = self.reserver.choose(now, list(queued), latency, max_batch)
        self.resume_at = self.reserver.resume_at(choice)
        if choice.waits_until is not None:
            return ()
        self.reserver.started((c for c in queued if c.key in set(choice.keys)), choice.end)
        return choice.keys


@dataclasses.dataclass(frozen=True, slots=True)
class FleetMetrics:
    """FleetVLA's metrics: ``useful`` actions executed, ``starved`` share of ticks, per-robot
    ``progress`` (executed over ticks), ``fairness`` (Jain's index over progress), ``age_p95_s``
    (tick time minus the answered observation's), ``batches`` by size, ``dropped`` requests,
    ``shifted``: of the useful actions, those run from a chunk whose robot moved after its
    observation and then held before it landed (index execution runs them later than planned,
    from a state the robot has left: chunkline's broker never does)."""

    useful: int
    starved: float
    progress: dict[str, float]
    fairness: float
    age_p95_s: float
    batches: dict[int, int]
    dropped: int
    shifted: int = 0


# Event kinds, in the order one instant handles them (a chunk landing on a tick is in time for it).
_DONE, _LAND, _ASK, _TICK, _WAKE = range(5)


@dataclasses.dataclass(slots=True)
class _Robot:
    spec: RobotSpec
    plan_end: int = 0  # progress at which the latest chunk runs out
    plan_obs: float = 0.0  # when its observation was taken
    pending: bool = False
    seq: int = 0
    executed: int = 0
    starved: int = 0
    asked: dict[Hashable, int] = dataclasses.field(default_factory=dict)  # request -> progress at its observation
    moved: dict[Hashable, bool] = dataclasses.field(default_factory=dict)  # request -> the robot moved on after it
    held: bool = False  # a tick starved since the last request
    shifted_plan: bool = False  # the latest chunk runs time-shifted (see FleetMetrics.shifted)
    shifted: int = 0

    def left(self) -> int:
        return max(0, self.plan_end - self.executed)


def simulate(workload: Workload, scheduler: Scheduler) -> FleetMetrics:
    """Run ``workload`` under ``scheduler`` and measure it (deterministic)."""
    robots = {r.name: _Robot(r) for r in workload.robots}
    # (time, kind, order, robot, tick, chunks): kinds in the order one instant handles them
    events: list[tuple[float, int, int, str, int, list[FleetCandidate]]] = []
    order = 0

    def push(t: float, kind: int, robot: str = "", tick: int = 0, chunks: list[FleetCandidate] | None = None) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, kind, order, robot, tick, chunks or []))

    queued: dict[Hashable, FleetCandidate] = {}
    owner: dict[Hashable, str] = {}
    busy = False
    ages: list[float] = []
    batches: collections.Counter[int] = collections.Counter()
    dropped = 0

    def ask(r: _Robot, now: float, ticks_done: int) -> None:
        s = r.spec
        period = 1.0 / s.hz
        next_tick = s.start_s + (ticks_done + 1) * period
        # Due before the first tick that would find the plan empty, a network leg before; the
        # chunk's rows that run are those beyond the plan the robot still holds.
        dry_in = max(0.0, next_tick + r.left() * period - s.net_s - now)
        r.seq += 1
        r.pending = True
        key = f"{s.name}#{r.seq}"
        r.asked[key] = r.executed
        r.moved[key] = r.left() > 0
        r.held = False
        owner[key] = s.name
        queued[key] = FleetCandidate(key, s.tenant, now, now + s.deadline_s, s.weight,
                                     Urgency(dry_in, max(1, s.rows - r.left()), period), robot=s.name)

    for r in robots.values():
        push(r.spec.start_s, _ASK, r.spec.name)
        push(r.spec.start_s + 1.0 / r.spec.hz, _TICK, r.spec.name, 1)
    while events and events[0][0] <= workload.duration_s:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, _, name, k, chunks = heapq.heappop(events)
            if kind == _WAKE:
                continue  # a scheduler that waited is asked again below
            if kind == _DONE:
                busy = False
                for cand in chunks:
                    push(now + robots[owner[cand.key]].spec.net_s, _LAND, owner[cand.key], chunks=[cand])
                continue
            r = robots[name]
            if kind == _LAND:
                r.plan_end = r.asked.pop(chunks[0].key) + r.spec.rows
                r.shifted_plan = r.moved.pop(chunks[0].key) and r.held
                r.plan_obs = chunks[0].arrival
                r.pending = False
                del owner[chunks[0].key]
            elif kind == _ASK:
                if not r.pending:
                    ask(r, now, k)
            else:
                if r.left():
                    ages.append(now - r.plan_obs)
                    r.executed += 1
                    r.shifted += r.shifted_plan
                else:
                    r.starved += 1
                    r.held = True
                if not r.pending and r.left() / r.spec.hz <= r.spec.threshold_s + 1e-9:
                    ask(r, now, k)
                push(r.spec.start_s + (k + 1) / r.spec.hz, _TICK, name, k + 1)
        for key in [key for key, c in queued.items() if c.deadline <= now]:
            dropped += 1
            r = robots[owner.pop(key)]
            r.pending = False
            r.asked.pop(key, None)
            r.moved.pop(key, None)
            del queued[key]
        if not busy and queued:
            keys = scheduler.pick(now, list(queued.values()), workload.latency, workload.max_batch)
            wake = getattr(scheduler, "resume_at", math.inf)
            if not keys and now < wake < math.inf:
                push(wake, _WAKE)
            if keys:
                batch = [queued.pop(key) for key in keys]
                busy = True
                batches[len(batch)] += 1
                push(now + workload.latency(len(batch)), _DONE, chunks=batch)
    progress = {n: r.executed / max(1, r.executed + r.starved) for n, r in robots.items()}
    p = list(progress.values())
    fairness = sum(p) ** 2 / (len(p) * sum(x * x for x in p)) if any(p) else 1.0
    ages.sort()
    total = sum(r.executed + r.starved for r in robots.values())
    return FleetMetrics(
        useful=sum(r.executed for r in robots.values()),
        starved=sum(r.starved for r in robots.values()) / max(1, total),
        progress=progress,
        fairness=fairness,
        age_p95_s=ages[max(0, math.ceil(0.95 * len(ages)) - 1)] if ages else math.nan,
        batches=dict(sorted(batches.items())),
        dropped=dropped,
        shifted=sum(r.shifted for r in robots.values()),
    )


def schedulers(workload: Workload) -> dict[str, Callable[[], Scheduler]]:
    budgets = {r.name: r.budget_s for r in workload.robots}
    return {"round robin": RoundRobin, "EDF": lambda: EarliestDeadline(budgets), "fleet": FleetScheduler,
            "reserve": lambda: FleetScheduler(reserve=True)}


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(f"{'workload':<22}{'scheduler':<13}{'useful':>7}{'per GPU-s':>10}{'starved':>9}{'p95 age':>9}{'fairness':>10}"
          f"{'weight 5':>9}{'shifted':>9}  batches by size")
    for label, w in (("Armory L40S, w5", armory_l40s(True)), ("Armory L40S, equal", armory_l40s(False)),
                     ("100 robots, 10 at w5", hundred_robots())):
        heavy = [r.name for r in w.robots if r.weight > 1] or ["fast-0"]
        for name, make in schedulers(w).items():
            m = simulate(w, make())
            busy = sum(n * w.latency(size) for size, n in m.batches.items())
            tier = sum(m.progress[r] for r in heavy) / len(heavy)
            mean = sum(k * n for k, n in m.batches.items()) / sum(m.batches.values())
            sizes = str(m.batches) if len(m.batches) <= 4 else f"mean {mean:.1f}"
            print(f"{label:<22}{name:<13}{m.useful:>7}{m.useful / busy:>10.1f}{m.starved:>8.1%}{m.age_p95_s:>8.2f}s"
                  f"{m.fairness:>10.3f}{tier:>9.1%}{m.shifted:>9}  {sizes}")


if __name__ == "__main__":
    main()
