"""When each robot will ask next, from its own urgencies and the batches it rode in (sans-I/O).

A robot in a saturated fleet asks at a steady lead before its plan runs dry, and each chunk
extends its plan by a steady whole number of ticks: so its next request is due a lead before its
plan's next end. That end is the current one plus one chunk's extension when the chunk lands in
time, or, when the robot had to hold, the first of its ticks after the chunk lands plus the
extension. The chunk's reach (its plan's end from its request) is the least seen lately, in whole
ticks, learnt only between requests sent with rows left; the return leg is bounded by its holds.
A request comes on the robot's tick grid plus a send delay that jitters: predictions are snapped
to the grid's median phase, and one is waited for until the latest phase seen lately (a jitter
band); one that passed is moved a tick later once (a hold a tick longer than predicted) before it
counts as missed. A prediction is only a scheduling hint: nothing is promised on it, and a
robot that does not ask in its band is not waited for again until it asks.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Hashable, Iterable

from chunkline.server.robot.fleet.strategy import FleetCandidate, FleetChoice, FleetStrategy, LatencyCurve
from chunkline.server.robot.fleet.urgency import Urgency

__all__ = ["Expected", "RobotCalendar", "Reserver"]

#: Tolerance for times compared on the tick grid (float residue is not a tick).
_EPS = 1e-9
#: Samples kept per learned amount (a robot's cycle changes with its batches; old ones go).
_SAMPLES = 8
#: The widest jitter band waited for past a robot's grid phase, in control periods (a late
#: request beyond it is an outlier, and idling longer could have run a batch).
_MAX_BAND_PERIODS = 0.2


@dataclasses.dataclass(frozen=True, slots=True)
class Expected:
    """A robot's next request as predicted: its key is ``("expected", robot)``."""

    robot: Hashable
    candidate: FleetCandidate


@dataclasses.dataclass(slots=True)
class _Cycle:
    tenant: str
    weight: float
    urgency: Urgency
    arrived: float  # its latest request's arrival
    key: Hashable  # that request's key
    done_at: float = math.inf  # when that request's batch ends (inf: not started)
    missed: bool = False  # the prediction from that batch has passed without a request
    late: int = 0  # ticks added to the prediction after it passed without a request
    fresher: float = 0.0  # how much newer the observation its chunk answers is (a replacement's)
    reaches: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=_SAMPLES))  # plan's end from a request
    returns: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=_SAMPLES))
    # arrivals' offsets from the first one's tick grid, folded into [-period/2, period/2)
    phases: deque[float] = dataclasses.field(default_factory=lambda: deque(maxlen=_SAMPLES))
    origin: float = math.nan

    @property
    def dry_at(self) -> float:
        return self.arrived + self.urgency.dry_in_s

    def extension(self) -> float:
        """How far a chunk landing in time moves the plan's end past its current one: the chunk's
        reach from its request (the least seen lately, whole ticks: a hold only lengthens it)
        less the current lead."""
        u = self.urgency
        if not self.reaches:
            return u.rows * u.period_s
        reach = max(1, round(min(self.reaches) / u.period_s)) * u.period_s
        return max(u.period_s, reach - u.dry_in_s)

    def observe_phase(self, arrival: float) -> None:
        p = self.urgency.period_s
        if math.isnan(self.origin):
            self.origin = arrival
        self.phases.append((arrival - self.origin + p / 2) % p - p / 2)

    def on_grid(self, t: float) -> float:
        """``t`` moved to the nearest of the robot's ticks at its median phase."""
        if not self.phases:
            return t
        p = self.urgency.period_s
        base = self.origin + statistics.median(self.phases)
        return base + round((t - base) / p) * p

    def band(self) -> float:
        """How late past its median phase this robot's requests came lately (bounded)."""
        if not self.phases:
            return 0.0
        late = max(self.phases) - statistics.median(self.phases)
        return min(late, _MAX_BAND_PERIODS * self.urgency.period_s)

    def next_arrival(self) -> float:
        """When this robot's next request is due (inf: its batch has not started)."""
        if self.done_at == math.inf:
            return math.inf
        u = self.urgency
        back = self.done_at + (min(self.returns) if self.returns else 0.0)
        # It resumes at its first tick once the chunk is back, and never before its plan runs dry.
        ticks = math.ceil((back - self.arrived) / u.period_s - _EPS)
        resume = max(self.dry_at, self.arrived + ticks * u.period_s)
        # Back in time, the chunk's rows run on from a fresher observation's as far as it is newer
        # (held, the robot resumes from the chunk's first row whatever its observation).
        fresher = self.fresher if resume <= self.dry_at + _EPS else 0.0
        return self.on_grid(resume + self.extension() - u.dry_in_s + fresher) + self.late * u.period_s


class RobotCalendar:
    """Each robot's next request, learned from its requests (:meth:`arrived`) and the ends of the
    batches they rode in (:meth:`started`).

    Args:
        max_robots: robots remembered; the ones heard from longest ago are forgotten beyond it.
    """

    def __init__(self, max_robots: int = 4096) -> None:
        if max_robots < 1:
            raise ValueError("max_robots must be >= 1")
        self.max_robots = max_robots
        self._cycles: dict[Hashable, _Cycle] = {}

    def __len__(self) -> int:
        return len(self._cycles)

    def arrived(self, c: FleetCandidate) -> None:
        """``c`` is queued: learn from it how its robot's plan moved since its previous request."""
        u = c.urgency
        robot = c.key if c.robot is None else c.robot
        cycle = self._cycles.get(robot)
        if u is None:
            return
        if cycle is not None and cycle.key == c.key:
            if c.since is not None and cycle.done_at == math.inf:
                # A fresher observation took its place (``replaces``): its chunk reaches further.
                # The robot's lead, its tick grid and the cycle learnt stay the request's.
                cycle.fresher = max(0.0, c.arrival - cycle.arrived)
            return
        if cycle is not None and cycle.done_at < math.inf and c.arrival > cycle.arrived:
            # The plan grew from its old end, or from the batch's end if later (it cannot resume
            # before its chunk exists).
            grown = c.arrival + u.dry_in_s - max(cycle.dry_at, cycle.done_at)
            # Learnt only between requests sent with rows left (one sent dry re-asks after a
            # chunk that came too late to use: not the steady cycle).
            steady = min(u.dry_in_s, cycle.urgency.dry_in_s) >= u.period_s / 2
            if steady and grown > u.period_s / 2:
                cycle.reaches.append(c.arrival + u.dry_in_s - cycle.arrived - cycle.fresher)
                resumed = c.arrival + u.dry_in_s - cycle.extension() - cycle.fresher
                if resumed > cycle.dry_at + u.period_s / 2:  # it held: the chunk was back by its resume tick
                    cycle.returns.append(max(0.0, resumed - cycle.done_at))
        if cycle is None:
            if len(self._cycles) >= self.max_robots:
                self._forget()
            cycle = _Cycle(c.tenant, c.weight, u, c.arrival, c.key)
            self._cycles[robot] = cycle
        else:
            if cycle.urgency.period_s != u.period_s:
                cycle.phases.clear()
                cycle.origin = math.nan
            cycle.tenant, cycle.weight, cycle.urgency, cycle.arrived, cycle.key = c.tenant, c.weight, u, c.arrival, c.key
            cycle.done_at, cycle.missed, cycle.late, cycle.fresher = math.inf, False, 0, 0.0
        cycle.observe_phase(c.arrival)

    def started(self, batch: Iterable[FleetCandidate], end: float) -> None:
        """The requests in ``batch`` run in a batch that ends at ``end``."""
        for c in batch:
            cycle = self._cycles.get(c.key if c.robot is None else c.robot)
            if cycle is not None and cycle.key == c.key:
                cycle.done_at = end

    def expected(self, now: float, until: float, queued: Iterable[Hashable] = ()) -> list[Expected]:
        """The requests predicted to arrive after ``now`` and by ``until``, of robots with none
        queued (``queued``: their robots), each at the late end of its robot's jitter band. A
        prediction whose band passed without a request is dropped until the robot's next one."""
        busy = set(queued)
        out: list[Expected] = []
        for robot, cycle in self._cycles.items():
            if robot in busy or cycle.missed:
                continue
            at = cycle.next_arrival() + cycle.band()
            if at == math.inf:
                continue
            if at <= now + _EPS and not cycle.late:
                # A tick's hold more or less than predicted (a chunk back at the edge of a tick):
                # the next tick is its one other likely time.
                cycle.late = 1
                at += cycle.urgency.period_s
            if at <= now + _EPS:
                cycle.missed = True
                continue
            if at <= until + _EPS:
                u = cycle.urgency
                out.append(Expected(robot, FleetCandidate(("expected", robot), cycle.tenant, max(at, now), math.inf,
                                                          cycle.weight, u, robot=robot)))
        return out

    def heaviest(self, since: float) -> float:
        """The most weight of a robot whose latest request arrived at ``since`` or later (0: none)."""
        return max((c.weight for c in self._cycles.values() if c.arrived >= since), default=0.0)

    def _forget(self) -> None:
        ordered = sorted(self._cycles, key=lambda r: self._cycles[r].arrived)
        for robot in ordered[: max(1, len(ordered) // 2)]:
            del self._cycles[robot]


class Reserver:
    """A :class:`FleetStrategy` that also weighs the requests each robot's cycle predicts: it
    learns the cycles from the queued requests it is shown and the batches it is told started.

    Args:
        strategy: the strategy.
        reserve: offer it the expected requests (else it chooses among the queued only).
        wait_grace_s: how long past its predicted arrival an expected request is still waited for.
    """

    def __init__(self, strategy: FleetStrategy, reserve: bool = True, wait_grace_s: float = 0.002) -> None:
        self.strategy = strategy
        self.calendar = RobotCalendar()
        self.reserve = reserve
        self.wait_grace_s = wait_grace_s

    def choose(self, now: float, queued: list[FleetCandidate], latency: LatencyCurve, max_size: int,
               tenant_weight: Callable[[str], float] | None = None, mean_latency: LatencyCurve | None = None) -> FleetChoice:
        """The strategy's choice (see :meth:`FleetStrategy.choose`); tell :meth:`started` which of
        its requests started. With ``waits_until``, ask again at :meth:`resume_at` of it."""
        calendar = self.calendar
        for c in queued:
            calendar.arrived(c)
        expected: list[FleetCandidate] = []
        if self.reserve:
            # Far enough to see whom the longest batch started now would block.
            until = now + max(self.strategy.config.max_wait_share * latency(1), latency(max_size))
            robots = [c.key if c.robot is None else c.robot for c in queued]
            expected = [e.candidate for e in calendar.expected(now - self.wait_grace_s, until, robots)]
        heaviest = calendar.heaviest(now - self.strategy.config.weight_memory_s)
        return self.strategy.choose(now, queued, latency, max_size, tenant_weight, expected, heaviest, mean_latency)

    def resume_at(self, choice: FleetChoice) -> float:
        """When to choose again after ``choice`` (``inf``: it did not wait)."""
        return math.inf if choice.waits_until is None else choice.waits_until + self.wait_grace_s

    def started(self, batch: Iterable[FleetCandidate], end: float) -> None:
        """These requests started in a batch that ends at ``end``."""
        self.calendar.started(batch, end)
