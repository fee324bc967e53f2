"""Capacity planning, the pure part: a policy's service curve, the replicas a fleet needs, and the cost
per in-deadline chunk (steps 1, 2 and 4 of :mod:`chunkline.bench.capacity`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .report import Progress

__all__ = [
    "LATENCY_FACTOR",
    "CapacityError",
    "ServicePoint",
    "Fleet",
    "Plan",
    "measure_service_curve",
    "replicas_lower_bound",
    "plan_capacity",
    "cost_per_qualified_result",
    "format_cost",
    "curve_warnings",
]


#: a usable batch size satisfies ``LATENCY_FACTOR * s(b) <= deadline`` (wait for the batch in
#: progress, then one's own).
LATENCY_FACTOR = 2.0


class CapacityError(ValueError):
    """The fleet cannot be planned: bad parameters, or no batch size meets the deadline."""


@dataclasses.dataclass(frozen=True)
class ServicePoint:
    """Time to serve one batch of ``batch_size`` on this device.

    Args:
        batch_size: requests per forward pass.
        seconds: median time of one batch.
        p90: 90th percentile time of one batch.
        samples: batches timed.
    """

    batch_size: int
    seconds: float
    p90: float
    samples: int

    @property
    def per_request(self) -> float:
        """Service time per request at this batch size: ``seconds / batch_size``."""
        return self.seconds / self.batch_size

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "per_request": self.per_request}


@dataclasses.dataclass(frozen=True)
class Fleet:
    """The robots to serve.

    Args:
        robots: how many robots.
        rate_hz: inference requests per robot per second.
        deadline_ms: each request's deadline.
        peak_factor: peak load over mean load (>= 1).
        utilisation_cap: the busiest a replica may be planned at, in ``(0, 1]``.
    """

    robots: int
    rate_hz: float
    deadline_ms: float
    peak_factor: float = 1.5
    utilisation_cap: float = 0.8

    def __post_init__(self) -> None:
        if self.robots < 1:
            raise CapacityError(f"robots must be >= 1, got {self.robots}")
        for name in ("rate_hz", "deadline_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise CapacityError(f"{name} must be > 0, got {v}")
        if not (math.isfinite(self.peak_factor) and self.peak_factor >= 1):
            raise CapacityError(f"peak_factor must be >= 1, got {self.peak_factor}")
        if not 0 < self.utilisation_cap <= 1:
            raise CapacityError(f"utilisation_cap must be in (0, 1], got {self.utilisation_cap}")

    @property
    def mean_rate(self) -> float:
        """Requests per second, on average."""
        return self.robots * self.rate_hz

    @property
    def peak_rate(self) -> float:
        """Requests per second at the peak."""
        return self.mean_rate * self.peak_factor


@dataclasses.dataclass(frozen=True)
class Plan:
    """A replica count for a fleet and what it leaves spare.

    Args:
        fleet: the fleet.
        batch_size: the batch size the plan assumes at full load.
        batch_service_s: ``s(b)``, one batch's time.
        service_time_s: ``s(b) / b``, per request.
        lower_bound: ``ceil(peak_rate * service_time_s / utilisation_cap)``.
        replicas: the planned count (the lower bound, or more after a failed check).
    """

    fleet: Fleet
    batch_size: int
    batch_service_s: float
    service_time_s: float
    lower_bound: int
    replicas: int

    @property
    def replica_capacity(self) -> float:
        """Requests per second one replica serves at 100 % busy."""
        return 1.0 / self.service_time_s

    @property
    def utilisation_at_peak(self) -> float:
        return self.fleet.peak_rate * self.service_time_s / self.replicas

    @property
    def utilisation_at_mean(self) -> float:
        return self.fleet.mean_rate * self.service_time_s / self.replicas

    @property
    def headroom_at_peak(self) -> float:
        """Fraction of the fleet's capacity still free at the peak."""
        return 1.0 - self.utilisation_at_peak

    @property
    def share_mean(self) -> float:
        """Requests per second one replica receives at the mean."""
        return self.fleet.mean_rate / self.replicas

    @property
    def share_peak(self) -> float:
        return self.fleet.peak_rate / self.replicas

    def with_replicas(self, replicas: int) -> Plan:
        return dataclasses.replace(self, replicas=replicas)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fleet": {**dataclasses.asdict(self.fleet), "mean_rate": self.fleet.mean_rate, "peak_rate": self.fleet.peak_rate},
            "batch_size": self.batch_size,
            "batch_service_s": self.batch_service_s,
            "service_time_s": self.service_time_s,
            "lower_bound": self.lower_bound,
            "replicas": self.replicas,
            "replica_capacity": self.replica_capacity,
            "utilisation_at_peak": self.utilisation_at_peak,
            "utilisation_at_mean": self.utilisation_at_mean,
            "headroom_at_peak": self.headroom_at_peak,
        }


def measure_service_curve(policy: Any, batch_sizes: Sequence[int], *, repeats: int = 5, warmup: int = 1,
                          seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                          progress: Progress | None = None) -> list[ServicePoint]:
    """Time ``policy.infer_batch`` at each batch size.

    Sizes are measured in ``repeats`` interleaved rounds (1, 2, 4, ..., 1, 2, 4, ...), not one
    after the other, so that a burst of machine noise does not fall on one size only.

    Args:
        policy: a loaded :class:`~chunkline.policies.base.Policy` (warmed up or not).
        batch_sizes: sizes to measure (>= 1).
        repeats: timed batches per size.
        warmup: untimed batches per size first (first-call compilation, allocator growth).
        seed: observation contents.
        clock: seconds.
        progress: advanced by one per timed batch.
    """
    from chunkline.policies.base import example_observation, stack_observations

    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise CapacityError("batch sizes must be >= 1")
    if repeats < 1:
        raise CapacityError("repeats must be >= 1")
    rng = np.random.default_rng(seed)
    spec = policy.spec
    one = [example_observation(spec, rng) for _ in range(max(sizes))]
    batches = {b: stack_observations(spec, one[:b]) for b in sizes}
    for b in sizes:
        for _ in range(warmup):
            policy.infer_batch(batches[b])
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(repeats):
        for b in sizes:
            t = clock()
            policy.infer_batch(batches[b])
            times[b].append(clock() - t)
            if progress is not None:
                progress.update(advance=1, extra=f"batch {b}")
    return [ServicePoint(batch_size=b, seconds=float(np.median(times[b])), p90=float(np.percentile(times[b], 90)),
                         samples=len(times[b])) for b in sizes]


def replicas_lower_bound(peak_rate: float, service_time_s: float, utilisation_cap: float) -> int:
    """``ceil(peak_rate * service_time_s / utilisation_cap)``, at least 1.

    Args:
        peak_rate: requests per second at the peak.
        service_time_s: seconds of one replica per request.
        utilisation_cap: the busiest a replica may be, in ``(0, 1]``.
    """
    if not (peak_rate >= 0 and service_time_s > 0 and 0 < utilisation_cap <= 1):
        raise CapacityError("need peak_rate >= 0, service_time_s > 0 and utilisation_cap in (0, 1]")
    load = peak_rate * service_time_s / utilisation_cap
    # Rounding noise (e.g. 2.0000000000000004) must not cost a whole replica.
    return max(1, math.ceil(load - 1e-9))


def plan_capacity(curve: Sequence[ServicePoint], fleet: Fleet) -> Plan:
    """The fewest replicas for ``fleet`` from a service curve (the lower bound; see the module
    docstring for the batch-size rule).

    Raises:
        CapacityError: an empty curve, or no batch size with ``2 * s(b) <= deadline``.
    """
    if not curve:
        raise CapacityError("the service curve is empty")
    deadline_s = fleet.deadline_ms / 1000.0
    usable = [p for p in curve if LATENCY_FACTOR * p.seconds <= deadline_s]
    if not usable:
        fastest = min(curve, key=lambda p: p.seconds)
        raise CapacityError(
            f"no batch size meets the deadline: the fastest batch (size {fastest.batch_size}) takes "
            f"{fastest.seconds * 1000:.1f} ms, and a request may wait for one batch before its own, so the deadline "
            f"must be at least {LATENCY_FACTOR * fastest.seconds * 1000:.1f} ms on this device")
    best = min(usable, key=lambda p: (p.per_request, p.batch_size))
    lb = replicas_lower_bound(fleet.peak_rate, best.per_request, fleet.utilisation_cap)
    return Plan(fleet=fleet, batch_size=best.batch_size, batch_service_s=best.seconds, service_time_s=best.per_request,
                lower_bound=lb, replicas=lb)


def cost_per_qualified_result(replicas: int, price_per_device_hour: float, mean_rate: float,
                              qualified_fraction: float) -> float:
    """Money per in-deadline result, idle capacity included.

    Args:
        replicas: devices paid for, all the time.
        price_per_device_hour: price of one device for an hour.
        mean_rate: requests per second the fleet sends on average.
        qualified_fraction: share of requests answered within their deadline (or objective).

    Returns:
        ``replicas * price / (mean_rate * 3600 * qualified_fraction)``; ``inf`` when nothing qualifies.
    """
    if replicas < 0 or price_per_device_hour < 0 or mean_rate < 0 or not 0 <= qualified_fraction <= 1:
        raise CapacityError("replicas, price and rate must be >= 0 and the qualified fraction in [0, 1]")
    per_hour = mean_rate * 3600.0 * qualified_fraction
    if per_hour == 0:
        return math.inf
    return replicas * price_per_device_hour / per_hour


def format_cost(cost: float) -> str:
    """A cost per result with its unit, scaled to read as a plain number (``34.72 per million
    chunks``, not ``3.47222e-05``); the money is in the currency of the device-hour price."""
    if not math.isfinite(cost):
        return "unbounded (no request qualified)"
    scales = ((1.0, "per chunk"), (1e3, "per thousand chunks"), (1e6, "per million chunks"))
    scale, unit = next(((k, u) for k, u in scales if cost * k >= 0.1), scales[-1])
    value = cost * scale
    return f"{value:,.2f} {unit}" if value >= 1 else f"{value:.3f} {unit}"


#: a larger batch measured this much faster than a smaller one is a warning, not noise.
CURVE_TOLERANCE = 0.05


def curve_warnings(curve: Sequence[ServicePoint], tolerance: float = CURVE_TOLERANCE) -> list[str]:
    """What is wrong with a service curve a plan should not silently trust: a larger batch that
    took less time than a smaller one (a forward pass does not get faster with more work; the
    machine was busy with something else, or too few repeats were timed).

    Args:
        curve: the measured points.
        tolerance: the relative difference ignored as noise.
    """
    points = sorted(curve, key=lambda p: p.batch_size)
    out = []
    for small, large in zip(points, points[1:], strict=False):
        if large.seconds < small.seconds * (1.0 - tolerance):
            out.append(f"batch {large.batch_size} took {large.seconds * 1000:.2f} ms, less than batch {small.batch_size} "
                       f"({small.seconds * 1000:.2f} ms): a batch does not get faster with more work, so the machine was "
                       "busy or the timing is noisy; re-run on an idle machine or with more --repeats")
    return out
