"""Percentiles and summaries used by every benchmark and the demo."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["percentiles", "fmt_ms"]


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` (linear interpolation); NaN for no values."""
    if len(values) == 0:
        return {f"p{q:g}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


def fmt_ms(seconds: float) -> str:
    return "   n/a" if seconds != seconds else f"{seconds * 1000:6.2f}"
