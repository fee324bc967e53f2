"""Which queued robot requests run in the next batch, and how many (sans-I/O, clock injected).

A batch is worth the weighted time it buys per GPU-second: per request, the rows its robot will
run times its period plus the dry time it is spared, times the robot's weight, over the batch's
latency on the measured curve; every size is weighed. A row its robot will run older than
``age_bound_s`` (observation to tick) costs ``stale_cost`` rows: among the heaviest robots
weighed, the one whose chunk would otherwise run stale goes first. With the requests robots
are expected to send soon (:mod:`.calendar`) it also weighs waiting for them, idle time included.

Invariants: a request is chosen only for a batch that ends by its hard deadline; one that has
waited ``starvation_bound_s`` goes first (oldest first) and no wait is chosen while one has; a
tenant more than ``tenant_slack_s`` GPU-seconds per unit of weight ahead of the least-served
tenant with work only fills room left over, so lying urgency takes no more than its tenant's weight.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable, Sequence

from chunkline.server.robot.fleet.urgency import Urgency

__all__ = ["FleetCandidate", "FleetChoice", "FleetConfig", "FleetStrategy", "LatencyCurve", "blocking_cost", "executed_value",
           "stale_rows", "stale_value"]

#: Seconds a batch of ``size`` requests takes on the model's worker (the measured curve).
LatencyCurve = Callable[[int], float]

#: Tolerance for times compared with deadlines and ticks (float residue is not lateness).
_EPS = 1e-9


@dataclasses.dataclass(slots=True)
class FleetCandidate:
    """A queued request as the strategy sees it.

    Args:
        key: the request's id (returned in :attr:`FleetChoice.keys`).
        tenant: its tenant (fair share between tenants).
        arrival: when it was received (server clock, seconds).
        deadline: its hard deadline (the same clock).
        weight: its robot's service weight.
        urgency: its robot's plan, or ``None``: a robot with no plan to tell of (its first
            request) is dry from the request's arrival, credited :attr:`FleetConfig.plain_value_s`
            of executed time.
        robot: who sent it (its session); among equals, the robot that rode in fewest batches goes first.
            ``None``: the key.
        since: when its place in the queue was taken: a replacement's (a fresher observation,
            ``replaces``) is the one it replaced, for the starvation bound and arrival order;
            ``None``: ``arrival``. Its urgency and observation are reckoned from ``arrival``.
    """

    key: Hashable
    tenant: str
    arrival: float
    deadline: float
    weight: float = 1.0
    urgency: Urgency | None = None
    robot: Hashable = None
    since: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FleetChoice:
    """The next batch: the chosen requests (in the order given), its expected end and its value
    per GPU-second; with ``waits_until``, a batch to start then, with requests expected by then
    (none starts now)."""

    keys: tuple[Hashable, ...]
    end: float
    value_rate: float
    waits_until: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FleetConfig:
    """The strategy's settings.

    Args:
        starvation_bound_s: a request queued this long goes first, before any value is weighed.
        tenant_slack_s: how many GPU-seconds per unit of weight a tenant may be ahead of the
            least-served tenant with work queued and still compete on value.
        plain_value_s: the executed time credited to a request without an urgency (its rows
            are unknown; the dry time it is spared counts as for any robot that is dry).
        rows_pass_while_dry: a robot's plan is time-indexed: the rows due while it waited dry
            are lost. ``False`` (the default): it holds and resumes from the chunk's first row,
            losing ticks, not rows.
        wait_gain: how much more per GPU-second (a fraction) waiting for expected requests must be
            worth than the best batch now (predictions can be off).
        wait_options: the most arrival times weighed as starts of a wait.
        max_wait_share: the longest a free worker waits for expected requests, as a share of a
            batch of one's latency (a longer idle wait could nearly have run one).
        age_bound_s: the action age (a row's tick less its observation's time) the strategy keeps
            rows within: the operator's objective (the server sets it from the policy's
            ``fleet_age_bound_ms``); ``None``: ages are not weighed (``docs/design/fleet-age.md``).
        stale_cost: what a row run older than ``age_bound_s`` costs, in rows of executed time
            (unweighted). It is weighed for the heaviest robots only (queued, expected, or heard
            from within ``weight_memory_s``): a lighter robot's freshness never outbids a heavier
            robot's executed time. A robot whose rows run older than the bound however soon it
            is served is not weighed for it.
        weight_memory_s: how long after its latest request a robot's weight still counts for the
            heaviest robots above (one neither queued nor expected is between two requests).
        return_s: a reply's way from its batch's end to its robot (network, both ends' stacks);
            the robot runs the chunk from its first tick after that.
    """

    starvation_bound_s: float = 0.5
    tenant_slack_s: float = 0.5
    plain_value_s: float = 0.1
    rows_pass_while_dry: bool = False
    wait_gain: float = 0.2
    wait_options: int = 4
    max_wait_share: float = 0.6
    age_bound_s: float | None = 0.6
    stale_cost: float = 3.0
    return_s: float = 0.01
    weight_memory_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.starvation_bound_s >= 0 and self.tenant_slack_s >= 0 and self.plain_value_s > 0):
            raise ValueError("starvation_bound_s and tenant_slack_s must be >= 0, plain_value_s > 0")
        if not (self.wait_gain >= 0 and self.wait_options >= 0 and self.max_wait_share >= 0):
            raise ValueError("wait_gain, wait_options and max_wait_share must be >= 0")
        if not ((self.age_bound_s is None or self.age_bound_s > 0) and self.stale_cost >= 0 and self.return_s >= 0
                and self.weight_memory_s >= 0):
            raise ValueError("age_bound_s must be > 0 or None, stale_cost, return_s and weight_memory_s >= 0")


def executed_value(c: FleetCandidate, end: float, defer_s: float, config: FleetConfig) -> float:
    """Weighted executed seconds of ``c``'s chunk if its batch ends at ``end``: the rows its robot
    will execute (less, with ``rows_pass_while_dry``, those whose ticks pass while its plan is
    dry), times its period, plus the dry time it is spared against a batch ``defer_s`` later; all
    times its weight."""
    u = c.urgency
    if u is None:
        # No plan to tell of: dry from its arrival, so a later batch costs it ``defer_s`` dry.
        return c.weight * (config.plain_value_s + defer_s)
    dry_at = c.arrival + u.dry_in_s
    late = end - dry_at
    rows = u.rows
    if config.rows_pass_while_dry and late > _EPS:
        rows -= min(rows, math.ceil(late / u.period_s - _EPS))
    spared = max(0.0, end + defer_s - dry_at) - max(0.0, late)
    return c.weight * (rows * u.period_s + spared)


def stale_rows(c: FleetCandidate, end: float, config: FleetConfig) -> int:
    """Rows of ``c``'s chunk its robot will run older than ``config.age_bound_s`` if its batch
    ends at ``end``. The robot observed as it asked (at ``arrival``, on its tick grid); it runs
    the chunk's rows one a tick, from its first tick after the chunk is back and not before its
    plan runs dry, so its last row is the oldest."""
    u = c.urgency
    bound = config.age_bound_s
    if u is None or bound is None:
        return 0
    span = (u.rows - 1) * u.period_s
    if u.dry_in_s + span > bound + _EPS:
        return 0  # stale however soon it is served: going first would not keep it within the bound
    ticks = math.ceil((end + config.return_s - c.arrival) / u.period_s - _EPS)
    oldest = max(u.dry_in_s, ticks * u.period_s) + span
    return max(0, min(u.rows, math.ceil((oldest - bound) / u.period_s - _EPS)))


def stale_value(c: FleetCandidate, end: float, defer_s: float, config: FleetConfig) -> float:
    """Seconds ``c``'s rows run stale would cost if its batch ended ``defer_s`` after ``end``
    rather than at ``end`` (:func:`stale_rows`; ``config.stale_cost`` rows each). Not weighted: a
    weight buys a robot service, and freshness is the same for every robot."""
    u = c.urgency
    if u is None or config.age_bound_s is None or config.stale_cost == 0:
        return 0.0
    more = stale_rows(c, end + defer_s, config) - stale_rows(c, end, config)
    return config.stale_cost * u.period_s * more


def blocking_cost(c: FleetCandidate, end: float, alone_s: float) -> float:
    """Weighted ticks ``c``, expected to arrive while a batch runs until ``end``, loses held
    waiting for it against a worker free when it arrives (both then run it alone, ``alone_s``):
    a robot holds whole ticks, so a batch that ends in time to serve it before it runs dry costs
    it nothing."""
    u = c.urgency
    if u is None or c.arrival >= end - _EPS:
        return 0.0
    dry_at = c.arrival + u.dry_in_s
    held = math.ceil(max(0.0, end + alone_s - dry_at) / u.period_s - _EPS)
    held_free = math.ceil(max(0.0, c.arrival + alone_s - dry_at) / u.period_s - _EPS)
    return c.weight * u.period_s * max(0, held - held_free)


class FleetStrategy:
    """Chooses each batch for fleet value (see the module's docstring); keeps the tenants' served
    GPU-seconds for their fair share.

    Args:
        config: see :class:`FleetConfig`.
    """

    def __init__(self, config: FleetConfig | None = None) -> None:
        self.config = config if config is not None else FleetConfig()
        # Per tenant, GPU-seconds per unit of weight it is ahead of the least-served tenant with
        # work queued at the last choice; a tenant absent is level with it.
        self._ahead: dict[str, float] = {}
        # Per robot, the batches it rode in and the number of the last (ties go to the least served).
        self._rides: dict[Hashable, tuple[int, int]] = {}
        self._batches = 0

    def value(self, c: FleetCandidate, end: float, defer_s: float, heaviest: float = math.inf) -> float:
        """``c``'s weighted executed seconds if its batch ends at ``end`` rather than ``defer_s``
        later (see :func:`executed_value`), and the stale rows that spares it when no robot
        weighed is heavier than it (``heaviest``: the most weight queued or expected; by
        default they are not weighed)."""
        v = executed_value(c, end, defer_s, self.config)
        return v + stale_value(c, end, defer_s, self.config) if c.weight >= heaviest - _EPS else v

    def ahead(self, tenant: str) -> float:
        """GPU-seconds per unit of weight ``tenant`` has been given beyond the least-served one."""
        return self._ahead.get(tenant, 0.0)

    def choose(
        self,
        now: float,
        queued: Sequence[FleetCandidate],
        latency: LatencyCurve,
        max_size: int,
        tenant_weight: Callable[[str], float] | None = None,
        expected: Sequence[FleetCandidate] = (),
        heaviest: float = 0.0,
        mean_latency: LatencyCurve | None = None,
    ) -> FleetChoice:
        """The next batch among ``queued`` for a worker free at ``now`` (empty: nothing can meet
        its deadline in any batch; admission drops those), or a wait for ``expected`` requests.

        Args:
            now: current time.
            queued: the requests waiting.
            latency: the model's batch-latency curve as admission plans with it (a bad-but-usual
                batch): a request is chosen only for a batch that ends by its deadline on it.
            max_size: most requests in one batch.
            tenant_weight: each tenant's weight (default 1).
            expected: requests predicted to arrive (their ``arrival``), not queued yet.
            heaviest: the most weight of a robot heard from lately, neither queued nor expected
                (ages are weighed only for robots at least as heavy as it and those).
            mean_latency: the average batch latency (default ``latency``): where a batch is
                expected to end, so what it is worth, when its rows run and the GPU time it takes.
        """
        if not queued or max_size < 1:
            return FleetChoice((), now, 0.0)
        cfg = self.config
        aged_at = now - cfg.starvation_bound_s + _EPS
        expect = latency if mean_latency is None else mean_latency
        defer = latency(max_size)  # the next batch, if this one passes a request over
        heaviest = max(heaviest, *(c.weight for c in (*queued, *expected)))
        best = self._best(now, now, queued, latency, expect, max_size, defer, aged_at, FleetChoice((), now, 0.0),
                          ahead=expected, heaviest=heaviest)
        if expected and cfg.wait_options and not any(_since(c) <= aged_at for c in queued):
            until = now + cfg.max_wait_share * latency(1)
            times = sorted({max(c.arrival, now) for c in expected if c.arrival <= until + _EPS})[: cfg.wait_options]
            bar = FleetChoice(best.keys, best.end, best.value_rate * (1.0 + cfg.wait_gain), best.waits_until)
            for t in times:
                came = [c for c in expected if c.arrival <= t + _EPS]
                waited = self._best(now, t, [*queued, *came], latency, expect, max_size, defer, aged_at, bar,
                                    must={c.key for c in came}, ahead=[c for c in expected if c.arrival > t + _EPS],
                                    heaviest=heaviest)
                if waited is not bar:
                    bar = best = waited
        if best.keys and best.waits_until is None:
            self._charge(queued, best, now, tenant_weight)
            self._served_now(queued, best)
        return best

    def _best(self, now: float, start: float, queued: Sequence[FleetCandidate], latency: LatencyCurve,
              expect: LatencyCurve, max_size: int, defer: float, aged_at: float, best: FleetChoice,
              must: set[Hashable] | None = None, ahead: Sequence[FleetCandidate] = (),
              heaviest: float = math.inf) -> FleetChoice:
        """The best batch among ``queued`` started at ``start`` if it beats ``best`` per GPU-second
        from ``now`` (else ``best`` itself); with ``must``, only a batch that takes one of those
        (a wait for them); less what it costs the requests expected ``ahead`` (:func:`blocking_cost`);
        ``heaviest``: the most weight weighed (see :meth:`value`). Deadlines are met on the planning
        ``latency``; values, ages and GPU time are reckoned where a batch ends on average (``expect``)."""
        eligible = self._eligible(queued)
        top = min(max_size, len(queued))
        pool = self._pool(queued, start + latency(top), defer, top, aged_at, eligible)
        # The standing order: the starving first (oldest first), then tenants within their share,
        # then by value at the batch's end; then by when each plan runs dry, fewest rides first.
        rides = self._rides
        since = [_since(c) for c in pool]
        fixed = [((s > aged_at, s if s <= aged_at else 0.0, c.tenant not in eligible),
                  (_dry_at(c), rides.get(_robot(c), (0, 0))[0], s, i), c) for i, (c, s) in enumerate(zip(pool, since, strict=True))]
        waits = None if must is None else start
        for size in _sizes(top):
            planned = start + latency(size)
            end = start + expect(size)
            ranked = heapq.nsmallest(size, ((head, -self.value(c, end, defer, heaviest), tail, c) for head, tail, c in fixed
                                            if c.deadline >= planned - _EPS))
            if len(ranked) < size:
                break  # a larger batch ends later still: fewer fit
            if must is not None and not any(c.key in must for _, _, _, c in ranked):
                continue
            cost = sum(blocking_cost(c, end, expect(1)) for c in ahead)
            rate = (-sum(v for _, v, _, _ in ranked) - cost) / max(end - now, _EPS)
            if rate > best.value_rate + _EPS or not best.keys:
                best = FleetChoice(tuple(c.key for _, _, _, c in ranked), end, rate, waits)
        return best

    def _pool(self, queued: Sequence[FleetCandidate], last_end: float, defer: float, top: int, aged_at: float,
              eligible: set[str]) -> list[FleetCandidate]:
        """The requests any batch of up to ``top`` could take: the aged ones up to the ``top``-th
        oldest that fits every size, and in each tier after them those whose best value reaches
        the ``top``-th best worst value among the tier's requests that fit every size (a request
        below either is outranked at every size)."""
        if len(queued) <= 2 * top:
            return list(queued)
        aged = [c for c in queued if _since(c) <= aged_at]
        fit = [_since(c) for c in aged if c.deadline >= last_end - _EPS]
        cut = heapq.nsmallest(top, fit)[-1] if len(fit) >= top else math.inf
        pool = [c for c in aged if _since(c) <= cut]
        for tier in (True, False):
            group = [c for c in queued if _since(c) > aged_at and (c.tenant in eligible) is tier]
            floors = [self._bounds(c, last_end, defer)[0] for c in group if c.deadline >= last_end - _EPS]
            bar = heapq.nlargest(top, floors)[-1] if len(floors) >= top else -math.inf
            pool += [c for c in group if self._bounds(c, last_end, defer)[1] >= bar - _EPS]
        return pool

    def _bounds(self, c: FleetCandidate, last_end: float, defer: float) -> tuple[float, float]:
        """Lower and upper bounds of ``c``'s value over the batches that end by ``last_end``."""
        u = c.urgency
        cfg = self.config
        if u is None:
            v = c.weight * cfg.plain_value_s
            return v, v + c.weight * defer
        low = executed_value(c, last_end, 0.0, cfg) if cfg.rows_pass_while_dry else c.weight * u.rows * u.period_s
        # A deferral of ``defer`` turns at most its ticks (and one more, the grid) stale.
        stale = 0.0 if cfg.age_bound_s is None else cfg.stale_cost * u.period_s * min(u.rows, math.ceil(defer / u.period_s) + 1)
        return low, c.weight * (u.rows * u.period_s + defer) + stale

    def _served_now(self, queued: Sequence[FleetCandidate], choice: FleetChoice) -> None:
        self._batches += 1
        keys = set(choice.keys)
        rides = self._rides
        for c in queued:
            if c.key in keys:
                r = _robot(c)
                rides[r] = (rides.get(r, (0, 0))[0] + 1, self._batches)
        if len(rides) > 4 * len(queued) + 64:
            # Forget the robots served longest ago (gone, most likely): the map stays bounded.
            for robot, _ in sorted(rides.items(), key=lambda kv: kv[1][1])[: len(rides) // 2]:
                del rides[robot]

    def _eligible(self, queued: Sequence[FleetCandidate]) -> set[str]:
        tenants = {c.tenant for c in queued}
        floor = min(self.ahead(t) for t in tenants)
        return {t for t in tenants if self.ahead(t) <= floor + self.config.tenant_slack_s + _EPS}

    def _charge(self, queued: Sequence[FleetCandidate], choice: FleetChoice, now: float,
                tenant_weight: Callable[[str], float] | None) -> None:
        """Charge each chosen request's tenant its share of the batch's GPU time, over its weight.
        A tenant back from idle starts level with the least-served one queued (no credit for idleness)."""
        floor = min(self.ahead(c.tenant) for c in queued)
        # Measured from the least-served tenant queued: one below it (back from idle) restarts
        # level with it, and only the tenants ahead stay in the map.
        self._ahead = {t: v - floor for t, v in self._ahead.items() if v > floor + _EPS}
        share = (choice.end - now) / len(choice.keys)
        by_key = {c.key: c.tenant for c in queued}
        for k in choice.keys:
            t = by_key[k]
            w = tenant_weight(t) if tenant_weight is not None else 1.0
            self._ahead[t] = self._ahead.get(t, 0.0) + share / max(w, _EPS)


def _sizes(top: int) -> list[int]:
    """Batch sizes weighed: every one up to 4, then powers of two and ``top`` (the sizes a runner
    times; a choice stays cheap on the loop with hundreds queued)."""
    sizes = list(range(1, min(top, 4) + 1))
    b = 8
    while b < top:
        sizes.append(b)
        b *= 2
    if top > 4:
        sizes.append(top)
    return sizes


def _dry_at(c: FleetCandidate) -> float:
    return c.arrival + c.urgency.dry_in_s if c.urgency is not None else c.arrival


def _since(c: FleetCandidate) -> float:
    return c.arrival if c.since is None else c.since


def _robot(c: FleetCandidate) -> Hashable:
    return c.key if c.robot is None else c.robot
