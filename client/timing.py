"""Durations as the wire and the reports carry them."""

from __future__ import annotations

__all__ = ["ms"]


def ms(seconds: float) -> float:
    """Seconds as milliseconds, rounded for the wire and for reports."""
    return round(seconds * 1000.0, 4)
