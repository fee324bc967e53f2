"""Round-trip latency model: quantiles, the mean and the spread of a sliding window of round trips."""

from __future__ import annotations

import collections
import itertools
import math

__all__ = ["LatencyWindow"]


class LatencyWindow:
    """The last ``size`` round trips: their ``quantile`` (p95 of 50 by default), mean and spread.

    ``estimate`` is the larger of the quantile and ``mean + spread_k * spread`` (the standard
    deviation): a window too short for its quantile to see a heavy tail still budgets for the
    spread it has seen. It sizes what must not fail (when to ask so that the plan never runs
    dry). ``typical`` is a lower quantile (p75 by default): the round trip most answers beat,
    for what is better sized to the common case than to the tail (how many prefix rows a
    real-time-chunking policy freezes, how often requests overlap), where a late answer costs a
    smooth cross-fade rather than an empty plan. ``median`` is the usual round trip (how often a
    paced robot asks: a few slow answers do not move it). Everything is recomputed when a sample arrives
    (once per chunk, ``O(size log size)``), so reading it on the per-tick path is free.

    Args:
        size: samples kept.
        quantile: which quantile to report as ``estimate``, in ``(0, 1]``.
        initial: both estimates before any sample.
        spread_k: standard deviations above the mean that ``estimate`` covers at least.
        typical_quantile: which quantile to report as ``typical``, in ``(0, 1]``.
    """

    def __init__(self, size: int = 50, quantile: float = 0.95, initial: float = 0.1, spread_k: float = 2.0,
                 typical_quantile: float = 0.75) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self.quantile = quantile
        self.typical_quantile = typical_quantile
        self.initial = initial
        self.spread_k = spread_k
        self.estimate = initial
        self.typical = initial
        self.median = initial
        self.mean = initial
        self.spread = 0.0
        self.last: float | None = None
        self._added = 0  # samples recorded since the last reset, the window's and those it dropped

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, seconds: float) -> None:
        """Record one measured round trip (ignored unless finite and >= 0)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._samples.append(seconds)
        self._added += 1
        self.last = seconds
        ordered = sorted(self._samples)
        n = len(ordered)
        self.mean = mean = math.fsum(ordered) / n
        self.spread = math.sqrt(max(0.0, math.fsum((x - mean) ** 2 for x in ordered) / n))
        self.estimate = max(_nearest_rank(ordered, self.quantile), mean + self.spread_k * self.spread)
        self.typical = _nearest_rank(ordered, self.typical_quantile)
        self.median = _nearest_rank(ordered, 0.5)

    def median_after(self, first: int, least: int = 1) -> float | None:
        """The median of the window's round trips less the first ``first`` recorded (while it
        still holds them), or ``None`` while fewer than ``least`` others are."""
        skip = max(0, first - (self._added - len(self._samples)))
        later = sorted(itertools.islice(self._samples, skip, None))
        return _nearest_rank(later, 0.5) if later and len(later) >= least else None

    def reset(self) -> None:
        """Forget every sample."""
        self._samples.clear()
        self._added = 0
        self.last = None
        self.estimate = self.mean = self.typical = self.median = self.initial
        self.spread = 0.0


def _nearest_rank(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile: the smallest sample with at least ``q`` of them at or below it."""
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]
