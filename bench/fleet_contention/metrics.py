"""Fleet metrics with FleetVLA's definitions, from per-tick records.

Useful actions: ticks that executed a policy row. Starved ticks: ticks that did not, over all
ticks. Action age: tick time minus the answered observation's time, p95 at rank ``ceil(0.95 n)``.
Fairness: Jain's index over per-robot progress (executed / ticks). Per-tier progress: the mean
progress of the robots of each service weight. Also requests offered per robot-second (not the
refreshes, a fresher observation in a queued request's place: no new GPU work, counted apart),
and rows executed per chunk; ``indexed``: the useful actions FleetVLA's own ``latest-indexed``
executor would have run from the same requests and chunks (:class:`IndexedReplay`). Where the
round trip goes, from the replies' own timing: the mean queueing (``queue_ms`` plus
``batch_wait_ms``), the mean batch, the mean round trip from a request's (chain's) first send
to its reply; useful actions per GPU-second (the replies' shares of their batches' inference time).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

from chunkline.broker.refresh import REFRESH_CODES

__all__ = ["IndexedReplay", "RobotRecord", "FleetMetrics", "fleet_metrics", "percentile"]


@dataclasses.dataclass(slots=True)
class IndexedReplay:
    """FleetVLA's ``latest-indexed`` executor fed one robot's requests and chunks: a chunk replaces
    what is buffered, less the rows whose index the robot ran since the observation (a held tick
    runs none); a tick runs the next buffered row or starves. A chunk's row ``j`` stands for the
    ``j``-th tick after its observation's. Beside the broker's own count it says whether the
    broker ran fewer rows than index execution would have from the same arrivals, or more (a chunk
    asked while the robot held resumes from the row of its observation's tick, which a FleetVLA
    chunk does not have)."""

    executed: int = 0
    ages: list[float] = dataclasses.field(default_factory=list)
    next_index: int = 0
    buffered: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    obs_time: float = math.nan  # the buffered chunk's observation's
    asked: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)  # request id -> (its tick's index, obs time)

    def tick(self, now: float) -> None:
        """A counted control tick at ``now``."""
        if self.buffered:
            self.next_index = self.buffered.popleft() + 1
            self.executed += 1
            self.ages.append(now - self.obs_time)

    def request(self, request_id: int, obs_time: float) -> None:
        """A request sent at the tick just counted (or before the first)."""
        self.asked[request_id] = (self.next_index - 1, obs_time)

    def chunk(self, request_id: int, rows: int) -> None:
        """The chunk answering ``request_id``, ``rows`` long, landed."""
        asked = self.asked.pop(request_id, None)
        if asked is None:
            return
        base, self.obs_time = asked
        self.buffered = collections.deque(range(max(self.next_index, base), base + rows))


@dataclasses.dataclass(slots=True)
class RobotRecord:
    """What one robot did over a run."""

    weight: float
    ticks: int = 0
    executed: int = 0
    requests: int = 0
    refreshes: int = 0  # requests sent in a queued one's place (``replaces``): no new GPU work
    chunks: int = 0
    refusals: int = 0
    ages: list[float] = dataclasses.field(default_factory=list)
    #: per reply: its queueing (s), the batch it rode in, its round trip on the robot (s)
    queued: list[float] = dataclasses.field(default_factory=list)
    batches: list[float] = dataclasses.field(default_factory=list)
    round_trips: list[float] = dataclasses.field(default_factory=list)
    replay: IndexedReplay = dataclasses.field(default_factory=IndexedReplay)
    gpu_s: float = 0.0  # its replies' shares of their batches' inference time


    def on_reply(self, timing: Mapping[str, float] | None, round_trip: float | None) -> None:
        """A chunk arrived with the server's ``timing`` after ``round_trip`` seconds."""
        self.chunks += 1
        if timing:
            self.queued.append((float(timing.get("queue_ms", 0.0)) + float(timing.get("batch_wait_ms", 0.0))) / 1000.0)
            self.batches.append(float(timing.get("batch_size", 1.0)))
            self.gpu_s += float(timing.get("infer_ms", 0.0)) / 1000.0 / max(1.0, float(timing.get("batch_size", 1.0)))
        if round_trip is not None:
            self.round_trips.append(round_trip)

    def on_error(self, code: str) -> None:
        """The server answered an error ``code``; a refresh settled (:data:`REFRESH_CODES`) is no refusal."""
        self.refusals += code not in REFRESH_CODES


@dataclasses.dataclass(frozen=True, slots=True)
class FleetMetrics:
    useful_actions: int
    starved: float
    age_p95_s: float
    fairness: float
    tiers: dict[float, float]
    requests_per_robot_s: float
    rows_per_chunk: float
    refusals: int
    queue_ms: float = math.nan
    batch_mean: float = math.nan
    round_trip_ms: float = math.nan
    indexed: int = 0
    ran: int = 0
    per_gpu_s: float = math.nan
    refreshes_per_robot_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["tiers"] = {str(k): v for k, v in self.tiers.items()}
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """FleetVLA's percentile: the value at rank ``ceil(q n)`` (NaN when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def fleet_metrics(records: Sequence[RobotRecord], duration_s: float, indexed: bool = False) -> FleetMetrics:
    """The fleet's figures over a run of ``duration_s``: of the rows the robots' brokers ran, or
    with ``indexed`` each robot by the stricter of its broker and FleetVLA's executor on the same
    arrivals (:class:`IndexedReplay`): never more than either ran."""
    strict = [r.replay if indexed and r.replay.executed < r.executed else r for r in records]
    done = [x.executed for x in strict]
    ratios = [x / r.ticks if r.ticks else 0.0 for r, x in zip(records, done, strict=True)]
    ticks = sum(r.ticks for r in records)
    executed = sum(done)
    squares = len(ratios) * sum(x * x for x in ratios)
    tiers: dict[float, list[float]] = {}
    for r, x in zip(records, ratios, strict=True):
        tiers.setdefault(r.weight, []).append(x)
    chunks = sum(r.chunks for r in records)
    return FleetMetrics(
        useful_actions=executed,
        starved=(ticks - executed) / ticks if ticks else 0.0,
        age_p95_s=percentile([a for x in strict for a in x.ages], 0.95),
        fairness=sum(ratios) ** 2 / squares if squares else 1.0,
        tiers={w: sum(v) / len(v) for w, v in sorted(tiers.items())},
        requests_per_robot_s=sum(r.requests for r in records) / (len(records) * duration_s),
        rows_per_chunk=executed / chunks if chunks else 0.0,
        refusals=sum(r.refusals for r in records),
        queue_ms=1000.0 * _mean([q for r in records for q in r.queued]),
        batch_mean=_mean([b for r in records for b in r.batches]),
        round_trip_ms=1000.0 * _mean([x for r in records for x in r.round_trips]),
        indexed=sum(r.replay.executed for r in records),
        ran=sum(r.executed for r in records),
        per_gpu_s=executed / gpu if (gpu := sum(r.gpu_s for r in records)) > 0 else math.nan,
        refreshes_per_robot_s=sum(r.refreshes for r in records) / (len(records) * duration_s),
    )


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
