"""How urgent a robot's request is, as the server schedules on it (sans-I/O).

An urgency is a robot's own account of its plan: the time from its message until the plan runs dry
(a duration, so no clock sync), the rows of the new chunk it will execute, its control period. It
only orders work: the hard deadline still bounds it. Nothing a client claims is trusted: a value
that is not a number, negative or zero where it must be positive is refused (:class:`UrgencyError`,
``invalid_message``); one beyond the tenant's bounds is clamped to them (:class:`UrgencyBounds`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal

__all__ = ["Urgency", "UrgencyBounds", "UrgencyError", "urgency_from_wire"]


class UrgencyError(Refusal):
    """An ``urgency`` map that cannot be true (``invalid_message``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_MESSAGE, f"urgency: {message}")


@dataclasses.dataclass(frozen=True, slots=True)
class UrgencyBounds:
    """What a tenant's robots may claim; a claim beyond is clamped, not trusted.

    Args:
        max_dry_in_s: the furthest plan end taken as told (a robot further off is no more urgent).
        max_rows: the most rows of a chunk a robot is credited with executing.
        min_period_s: the shortest control period taken as told (a faster claim loses rows as fast).
        max_period_s: the longest.
    """

    max_dry_in_s: float = 5.0
    max_rows: int = 256
    min_period_s: float = 0.001
    max_period_s: float = 1.0

    def __post_init__(self) -> None:
        if not (0 < self.min_period_s <= self.max_period_s and self.max_dry_in_s >= 0 and self.max_rows >= 1):
            raise ValueError("urgency bounds need 0 < min_period_s <= max_period_s, max_dry_in_s >= 0, max_rows >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class Urgency:
    """A request's urgency, checked and clamped (see :func:`urgency_from_wire`).

    Args:
        dry_in_s: seconds from the message until the robot's plan runs dry.
        rows: rows of the new chunk the robot will execute.
        period_s: its control period.
    """

    dry_in_s: float
    rows: int
    period_s: float


def _number(fields: Mapping[str, object], name: str) -> float:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UrgencyError(f"{name} must be a number")
    out = float(value)
    if not math.isfinite(out):
        raise UrgencyError(f"{name} must be finite")
    return out


def urgency_from_wire(fields: Mapping[str, object], bounds: UrgencyBounds | None = None) -> Urgency:
    """The :class:`Urgency` of an ``infer``'s ``urgency`` map (``dry_in_ms``, ``rows``, ``period_ms``).

    Raises:
        UrgencyError: a field is missing, not a number, not finite, ``dry_in_ms < 0``,
            ``rows < 1`` or not whole, or ``period_ms <= 0``; or an unknown field.
    """
    b = bounds if bounds is not None else UrgencyBounds()
    unknown = set(fields) - {"dry_in_ms", "rows", "period_ms"}
    if unknown:
        raise UrgencyError(f"unknown field(s) {sorted(map(str, unknown))}")
    dry_in = _number(fields, "dry_in_ms") / 1000.0
    rows = _number(fields, "rows")
    period = _number(fields, "period_ms") / 1000.0
    if dry_in < 0:
        raise UrgencyError("dry_in_ms must be >= 0 (a plan already dry is 0)")
    if rows < 1 or rows != int(rows):
        raise UrgencyError("rows must be a whole number >= 1")
    if period <= 0:
        raise UrgencyError("period_ms must be > 0")
    return Urgency(
        dry_in_s=min(dry_in, b.max_dry_in_s),
        rows=min(int(rows), b.max_rows),
        period_s=min(max(period, b.min_period_s), b.max_period_s),
    )
