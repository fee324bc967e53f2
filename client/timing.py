"""Durations as the wire and the reports carry them."""

from __future__ import annotations

from math import floor

__all__ = ["ms"]


def ms(seconds: float) -> float:
    """Seconds as milliseconds, to the tenth of a microsecond (half up), for the wire and for
    reports. ``floor`` rather than ``round(x, 4)``, whose correctly rounded decimal conversion
    costs several times as much: a reply carries half a dozen of these."""
    return floor(seconds * 1e7 + 0.5) / 1e4
