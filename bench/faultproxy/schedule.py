"""The sans-I/O core of the fault proxy: per-direction faults, outages and the delivery schedule
(times in, times out; no sockets, no clock). The closed-loop discrete-event simulation runs the
same core."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

from .errors import FaultProxyError

__all__ = ["OUTAGE_MODES", "RTO_MIN_S", "LinkFaults", "Outage", "Scenario", "Direction", "retransmit_arrival"]


OUTAGE_MODES = ("blackhole", "reset")
RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout
_MAX_RETRANSMITS = 15  # TCP gives up after ~15 retransmissions (tcp_retries2)


@dataclasses.dataclass
class LinkFaults:
    """Faults of one direction.

    Args:
        delay_s: one-way delay.
        jitter_s: each read's delay is uniform in ``delay_s +- jitter_s`` (at least 0).
        bandwidth_bps: bits per second, ``None`` for no cap.
        stall_rate_hz: mean stalls per second (Poisson), 0 for none.
        stall_s: how long a stall holds the bytes in transit.
    """

    delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None
    stall_rate_hz: float = 0.0
    stall_s: float = RTO_MIN_S

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s", "stall_rate_hz", "stall_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FaultProxyError(f"{name} must be finite and >= 0, got {value}")
        if self.bandwidth_bps is not None and not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise FaultProxyError(f"bandwidth_bps must be > 0, got {self.bandwidth_bps}")

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LinkFaults:
        """From ``{"delay_ms", "jitter_ms", "bandwidth_mbps", "stall_rate_hz", "stall_ms"}``."""
        bw = doc.get("bandwidth_mbps")
        return cls(delay_s=float(doc.get("delay_ms", 0.0)) / 1000.0, jitter_s=float(doc.get("jitter_ms", 0.0)) / 1000.0,
                   bandwidth_bps=None if bw is None else float(bw) * 1e6,
                   stall_rate_hz=float(doc.get("stall_rate_hz", 0.0)),
                   stall_s=float(doc.get("stall_ms", RTO_MIN_S * 1000.0)) / 1000.0)


@dataclasses.dataclass(frozen=True)
class Outage:
    """Both directions down from ``start`` for ``duration`` seconds.

    Args:
        start: when it begins (the schedule's clock).
        duration: how long, seconds (> 0).
        mode: ``blackhole`` or ``reset``.
    """

    start: float
    duration: float
    mode: str = "blackhole"

    def __post_init__(self) -> None:
        if self.mode not in OUTAGE_MODES:
            raise FaultProxyError(f"outage mode must be one of {OUTAGE_MODES}, got {self.mode!r}")
        if not (math.isfinite(self.start) and math.isfinite(self.duration) and self.duration > 0):
            raise FaultProxyError("an outage needs a finite start and a duration > 0")

    @property
    def end(self) -> float:
        return self.start + self.duration

    def overlaps(self, a: float, b: float) -> bool:
        """Whether ``[a, b]`` (a transit) meets the outage."""
        return a < self.end and b >= self.start


def retransmit_arrival(sent: float, delay: float, outage_end: float, rto: float = RTO_MIN_S) -> float | None:
    """When a segment first sent at ``sent`` and lost to an outage arrives: at the first
    retransmission at or after ``outage_end`` (backing off ``rto, 2 rto, 4 rto, ...``) plus
    the one-way delay; ``None`` if TCP would have given up by then.

    Args:
        sent: first transmission.
        delay: one-way delay.
        outage_end: when the path works again.
        rto: the first retransmission timeout.
    """
    t = sent
    wait = rto
    for _ in range(_MAX_RETRANSMITS):
        t += wait
        if t >= outage_end:
            return t + delay
        wait *= 2
    return None


class Scenario:
    """The outages both directions share.

    Args:
        outages: the outages (any order; they should not overlap).
    """

    def __init__(self, outages: Sequence[Outage] = ()) -> None:
        self.outages: list[Outage] = sorted(outages, key=lambda o: o.start)

    def add(self, outage: Outage) -> None:
        """Schedule one more outage."""
        self.outages.append(outage)
        self.outages.sort(key=lambda o: o.start)

    def active(self, t: float) -> Outage | None:
        """The outage in force at ``t``, if any."""
        for o in self.outages:
            if o.start <= t < o.end:
                return o
        return None

    def hit(self, a: float, b: float) -> Outage | None:
        """The first outage that a transit over ``[a, b]`` meets, if any."""
        for o in self.outages:
            if o.overlaps(a, b):
                return o
        return None

    def resets(self, after: float, until: float) -> list[Outage]:
        """Reset outages starting in ``(after, until]``."""
        return [o for o in self.outages if o.mode == "reset" and after < o.start <= until]


class Direction:
    """The delivery schedule of one direction (sans-I/O).

    Call :meth:`schedule` with the time bytes were read and their count; it returns when to
    deliver them, never earlier than the bytes before (no reordering), or ``None`` when a
    reset outage destroyed them (the connection is gone).

    Args:
        faults: this direction's faults (may be replaced between calls).
        scenario: the outages.
        seed: seed of the jitter and stall draws.
    """

    def __init__(self, faults: LinkFaults, scenario: Scenario | None = None, seed: int = 0) -> None:
        self.faults = faults
        self.scenario = scenario if scenario is not None else Scenario()
        self._rng = random.Random(seed)
        self.last_delivery = -math.inf
        self._link_free = -math.inf
        self._stalls: list[float] = []
        self._stall_horizon = -math.inf
        self.delivered_bytes = 0
        self.dropped_bytes = 0

    def _stall_end(self, a: float, b: float) -> float | None:
        f = self.faults
        if f.stall_rate_hz <= 0:
            return None
        if self._stall_horizon == -math.inf:
            self._stall_horizon = a
        # Draw stall start times (Poisson) up to b; keep them (bounded: old ones are dropped).
        while self._stall_horizon <= b:
            self._stall_horizon += self._rng.expovariate(f.stall_rate_hz)
            self._stalls.append(self._stall_horizon)
        self._stalls = [s for s in self._stalls if s + f.stall_s >= a - 60.0][-10_000:]
        end = None
        for s in self._stalls:
            if s <= b and s + f.stall_s > a:
                end = max(end or -math.inf, s + f.stall_s)
        return end

    def schedule(self, t: float, nbytes: int) -> float | None:
        """When the ``nbytes`` read at ``t`` are delivered (``None``: lost with the connection).

        Args:
            t: when the bytes were read.
            nbytes: how many.
        """
        f = self.faults
        start = t
        if f.bandwidth_bps is not None:
            start = max(t, self._link_free)
            self._link_free = start + nbytes * 8.0 / f.bandwidth_bps
            start = self._link_free
        delay = f.delay_s
        if f.jitter_s > 0:
            delay = max(0.0, delay + self._rng.uniform(-f.jitter_s, f.jitter_s))
        arrival = start + delay
        outage = self.scenario.hit(t, arrival)
        if outage is not None:
            if outage.mode == "reset":
                self.dropped_bytes += nbytes
                return None
            late = retransmit_arrival(start, delay, outage.end)
            if late is None:
                self.dropped_bytes += nbytes
                return None
            arrival = late
        stall = self._stall_end(t, arrival)
        if stall is not None:
            arrival = max(arrival, stall + delay)
        arrival = max(arrival, self.last_delivery)  # a byte stream: never reordered
        self.last_delivery = arrival
        self.delivered_bytes += nbytes
        return arrival

    def reset(self) -> None:
        """Forget the stream (a new connection)."""
        self.last_delivery = -math.inf
        self._link_free = -math.inf
