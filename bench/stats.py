"""Percentiles, slopes and summaries used by every benchmark and the demo."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["percentiles", "slope", "fmt_ms"]


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` (linear interpolation); NaN for no values."""
    if len(values) == 0:
        return {f"p{q:g}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


def slope(points: Iterable[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points (0 with fewer than two distinct times)."""
    pts = list(points)
    if len(pts) < 2:
        return 0.0
    ts = np.array([p[0] for p in pts], np.float64)
    ys = np.array([p[1] for p in pts], np.float64)
    var = float(((ts - ts.mean()) ** 2).sum())
    if var == 0.0:
        return 0.0
    return float(((ts - ts.mean()) * (ys - ys.mean())).sum() / var)


def fmt_ms(seconds: float) -> str:
    return "   n/a" if seconds != seconds else f"{seconds * 1000:6.2f}"
