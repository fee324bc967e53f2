"""The in-flight window and the request cadence, from the latency model (pure: no clock, no state).

The broker overlaps requests so that the plan does not run empty while round trips stay below a
chunk's duration. How many it lets out at once (the *window*) and how often they go (the *paces*)
follow from three figures: the typical round trip (a lower quantile of the recent ones), the
expected one (their tail: the larger of a high quantile and the mean plus a few standard
deviations) and the chunk's coverage (how long after its observation a chunk stays valid).

* Where a chunk outlasts the tail round trip with a regular pace to spare (its coverage less the
  expected round trip and the margin is at least half a typical round trip), the window is the
  configured ``in_flight_window``: nothing the plan needs is held back by it, and more overlap
  would only add hand-overs (each overlapping rtc answer is a deferred switch) and, in the
  fallback, re-asks that land together.
* Where it does not (the tail round trip nears or passes the chunk's duration: 300 ms one way
  with 1 s chunks), the plan lives on overlap, and a window of four held it back: a stall held
  every slot, no fresh request went out until the held answers landed, and the plan ran dry a
  round trip after the stall. The window then widens to as many requests as a tail round trip
  holds at the pace the plan needs (up to ``max_in_flight``), and the paces that share a typical
  round trip among the window shrink with it.

Computed when a round trip is measured (once per chunk), read on every tick.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Cadence", "plan_cadence"]


@dataclasses.dataclass(frozen=True, slots=True)
class Cadence:
    """What the broker's request decisions read on every tick.

    Args:
        window: how many requests may be in flight at once.
        rtc_pace: ``rtc``: the least time after the newest request before another overlaps it.
        dry_pace: in the fallback, the least time between two requests while others are in flight.
        stretched: whether the window is wider than the configured ``in_flight_window`` (the tail
            round trip nears the chunk's coverage).
    """

    window: int
    rtc_pace: float
    dry_pace: float
    stretched: bool


def plan_cadence(
    *,
    typical: float,
    expected: float,
    coverage: float | None,
    lead: float,
    period: float,
    min_replan: float,
    window: int,
    max_window: int,
    pace_share: float = 0.5,
) -> Cadence:
    """The in-flight window and the paces for the current latency model.

    Args:
        typical: the typical round trip (``LatencyWindow.typical``), seconds.
        expected: the expected, tail round trip (``LatencyWindow.estimate``), seconds.
        coverage: how long after its observation a chunk stays valid (``None``: not known yet).
        lead: what the plan must hold beyond a round trip when an answer lands (the prefetch
            margin plus one control period).
        period: the control period (no pace is shorter: one request per tick at most).
        min_replan: the execution horizon (``rtc_min_replan_s``; 0 outside ``rtc``).
        window: the configured window where chunks outlast the tail round trip.
        max_window: the most requests ever in flight (``max_in_flight``).
        pace_share: the share of a typical round trip rtc overlaps at while the plan has room.
    """
    base = max(1, min(window, max_window))
    share = pace_share * typical
    # What a chunk has left, at the tail round trip, after it lands and the margin: the longest
    # pace that keeps the plan full. Before any chunk has come, assume it is enough.
    spare = share if coverage is None else coverage - expected - lead
    wanted = max(min(share, spare), period, min_replan)
    size = base
    if spare < share:
        # A tail round trip holds ceil(expected / wanted) requests sent at the pace the plan
        # needs: fewer slots and the window, not the pace, decides when the next one goes (a
        # stall then holds every slot and nothing fresh goes out until it clears).
        size = min(max_window, max(base, math.ceil(expected / wanted - 1e-9)))
    # Never more often than a typical round trip shared among the window: requests sent in a
    # burst land in one.
    burst = typical / size
    return Cadence(size, max(burst, wanted), max(burst, period), size > base)
