"""Round-trip latency estimate: a quantile of a sliding window of measured round trips."""

from __future__ import annotations

import collections
import math

__all__ = ["LatencyWindow"]


class LatencyWindow:
    """The ``quantile`` of the last ``size`` round trips (p95 of 50 by default).

    The estimate is recomputed when a sample arrives (once per chunk, ``O(size log size)``),
    so reading it on the per-tick path is free.

    Args:
        size: samples kept.
        quantile: which quantile to report, in ``(0, 1]``.
        initial: the estimate before any sample.
    """

    def __init__(self, size: int = 50, quantile: float = 0.95, initial: float = 0.1) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self.quantile = quantile
        self.initial = initial
        self.estimate = initial
        self.last: float | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, seconds: float) -> None:
        """Record one measured round trip (ignored unless finite and >= 0)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._samples.append(seconds)
        self.last = seconds
        ordered = sorted(self._samples)
        # Nearest-rank quantile: the smallest sample with at least `quantile` of them at or below it.
        rank = max(1, math.ceil(self.quantile * len(ordered)))
        self.estimate = ordered[rank - 1]

    def reset(self) -> None:
        """Forget every sample."""
        self._samples.clear()
        self.last = None
        self.estimate = self.initial
