"""Fleet metrics with FleetVLA's definitions, from per-tick records.

Useful actions: ticks that executed a policy row. Starved ticks: ticks that did not, over all
ticks. Action age: tick time minus the answered observation's time, p95 at rank ``ceil(0.95 n)``.
Fairness: Jain's index over per-robot progress (executed / ticks). Per-tier progress: the mean
progress of the robots of each service weight. Also requests offered per robot-second and rows
executed per chunk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

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
    )
