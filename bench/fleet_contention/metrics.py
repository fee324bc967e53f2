"""Fleet metrics with FleetVLA's definitions, from per-tick records.

Useful actions: ticks that executed a policy row. Starved ticks: ticks that did not, over all
ticks. Action age: tick time minus the answered observation's time, p95 at rank ``ceil(0.95 n)``.
Fairness: Jain's index over per-robot progress (executed / ticks). Per-tier progress: the mean
progress of the robots of each service weight. Also requests offered per robot-second and rows
executed per chunk. Where the round trip goes, from the replies' own timing: the mean queueing
(``queue_ms`` plus ``batch_wait_ms``), the mean batch a reply rode in, and the mean round trip
from a request's send to its reply on the robot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

__all__ = ["RobotRecord", "FleetMetrics", "fleet_metrics", "percentile"]


@dataclasses.dataclass(slots=True)
class RobotRecord:
    """What one robot did over a run."""

    weight: float
    ticks: int = 0
    executed: int = 0
    requests: int = 0
    chunks: int = 0
    refusals: int = 0
    ages: list[float] = dataclasses.field(default_factory=list)
    #: per reply: its queueing (s), the batch it rode in, its round trip on the robot (s)
    queued: list[float] = dataclasses.field(default_factory=list)
    batches: list[float] = dataclasses.field(default_factory=list)
    round_trips: list[float] = dataclasses.field(default_factory=list)

    def on_reply(self, timing: Mapping[str, float] | None, round_trip: float | None) -> None:
        """A chunk arrived with the server's ``timing`` after ``round_trip`` seconds."""
        self.chunks += 1
        if timing:
            self.queued.append((float(timing.get("queue_ms", 0.0)) + float(timing.get("batch_wait_ms", 0.0))) / 1000.0)
            self.batches.append(float(timing.get("batch_size", 1.0)))
        if round_trip is not None:
            self.round_trips.append(round_trip)


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


def fleet_metrics(records: Sequence[RobotRecord], duration_s: float) -> FleetMetrics:
    """The fleet's figures over a run of ``duration_s``."""
    ratios = [r.executed / r.ticks if r.ticks else 0.0 for r in records]
    ticks = sum(r.ticks for r in records)
    executed = sum(r.executed for r in records)
    squares = len(ratios) * sum(x * x for x in ratios)
    tiers: dict[float, list[float]] = {}
    for r, x in zip(records, ratios, strict=True):
        tiers.setdefault(r.weight, []).append(x)
    chunks = sum(r.chunks for r in records)
    return FleetMetrics(
        useful_actions=executed,
        starved=(ticks - executed) / ticks if ticks else 0.0,
        age_p95_s=percentile([a for r in records for a in r.ages], 0.95),
        fairness=sum(ratios) ** 2 / squares if squares else 1.0,
        tiers={w: sum(v) / len(v) for w, v in sorted(tiers.items())},
        requests_per_robot_s=sum(r.requests for r in records) / (len(records) * duration_s),
        rows_per_chunk=executed / chunks if chunks else 0.0,
        refusals=sum(r.refusals for r in records),
        queue_ms=1000.0 * _mean([q for r in records for q in r.queued]),
        batch_mean=_mean([b for r in records for b in r.batches]),
        round_trip_ms=1000.0 * _mean([x for r in records for x in r.round_trips]),
    )


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
