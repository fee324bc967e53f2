"""The network fault plan: a seeded schedule of partitions, lossy periods and resets (pure), and how
one is applied to a :class:`chunkline.bench.faultproxy.FaultProxy`."""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any

__all__ = ["FaultEvent", "FaultPlan", "apply_fault"]


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    """One scheduled network fault, applied through :class:`chunkline.bench.faultproxy.FaultProxy`.

    Args:
        at: seconds from the start.
        kind: ``partition`` (a blackhole outage of both directions for ``duration``: bytes are
            held and arrive at TCP's first retransmission after it), ``lossy`` (``delay_s`` each
            way with jitter, and stalls as lost segments would cause, for ``duration``) or ``cut``
            (every connection reset; new ones refused for ``duration``).
        duration: how long it lasts.
        delay_s: the one-way delay of a ``lossy`` period.
    """

    at: float
    kind: str
    duration: float = 0.0
    delay_s: float = 0.0

    @property
    def end(self) -> float:
        return self.at + self.duration


class FaultPlan:
    """A seeded schedule of network faults, one kind after the other (pure: no clock, no I/O).

    Args:
        duration_s: the run's length.
        seed: the random seed.
        mean_gap_s: mean time between faults.
        max_partition_s: longest partition (with the retransmission after it, keep it well under
            the server's send timeout).
    """

    KINDS = ("partition", "lossy", "cut")

    def __init__(self, duration_s: float, seed: int = 0, mean_gap_s: float = 4.0, max_partition_s: float = 1.2) -> None:
        rng = random.Random(seed)
        kinds = list(self.KINDS)
        rng.shuffle(kinds)
        self.events: list[FaultEvent] = []
        t = rng.expovariate(1.0 / mean_gap_s)
        while t < duration_s - 1.0:
            kind = kinds[len(self.events) % len(kinds)]  # every kind, in turn: a short run still sees each
            if kind == "partition":
                event = FaultEvent(t, kind, duration=rng.uniform(0.2, max_partition_s))
            elif kind == "lossy":
                event = FaultEvent(t, kind, duration=rng.uniform(1.0, 4.0), delay_s=rng.uniform(0.005, 0.04))
            else:
                event = FaultEvent(t, kind, duration=rng.uniform(0.1, 0.5))
            self.events.append(event)
            t = event.end + 1.0 + rng.expovariate(1.0 / mean_gap_s)  # at least 1 s of quiet between faults

    def starting(self, t0: float, t1: float) -> list[FaultEvent]:
        """The faults that start in ``[t0, t1)``."""
        return [e for e in self.events if t0 <= e.at < t1]

    def ending(self, t0: float, t1: float) -> list[FaultEvent]:
        """The faults that end in ``[t0, t1)``."""
        return [e for e in self.events if t0 <= e.end < t1]

    def counts(self) -> dict[str, int]:
        """How many faults of each kind."""
        return dict(collections.Counter(e.kind for e in self.events))


def apply_fault(proxy: Any, event: FaultEvent, starting: bool) -> None:
    """Start or end ``event`` on a running :class:`chunkline.bench.faultproxy.FaultProxy`."""
    if event.kind == "lossy":
        ms = event.delay_s * 1000.0
        link = {"delay_ms": ms, "jitter_ms": ms / 2, "stall_rate_hz": 0.5, "stall_ms": 200.0} if starting else {}
        proxy.set(up=link, down=link)
    elif starting:
        proxy.outage(event.duration, "blackhole" if event.kind == "partition" else "reset")
