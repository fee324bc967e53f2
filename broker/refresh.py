"""Refreshing a queued request: a fresher observation sent in its place (``Infer.replaces``).

While the server is saturated the broker keeps one request in flight, and it may wait in the
server's queue for whole batches: the observation it carries ages meanwhile, and so does every
row of its chunk. At most once per control period, when the in-flight observation is two periods
old or more and the request has been out longer than the median round trip (it most likely
waits in the queue; sooner, it mostly runs already), and its replies usually queued two periods
or more (a robot the server usually serves sooner is not aged by the queue: a refresh would only
move its cycle), the broker sends the current observation as
a replacement: the server answers the old request ``superseded`` and runs the new one in its
place (or, once the old one runs, answers the new one ``replace_missed``: that chain is not
refreshed again). The chunk's age, hold anchor and staleness follow the observation actually
answered (the reply's id); its round trip counts from the chain's first send, the wait the
robot's pacing must plan for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..client.wire.errors import ErrorCode
from .latency import LatencyWindow
from .messages import BrokerStats, RequestIntent

__all__ = ["Refresher", "REFRESH_CODES", "SUPERSEDED", "REPLACE_MISSED"]

SUPERSEDED = ErrorCode.SUPERSEDED.value
REPLACE_MISSED = ErrorCode.REPLACE_MISSED.value
#: the answers that settle a refresh, not errors of the robot's request
REFRESH_CODES = frozenset({SUPERSEDED, REPLACE_MISSED})

#: (sent at, observation time) per request id, as the broker core keeps them
Flights = dict[int, tuple[float, float]]


@dataclasses.dataclass(slots=True)
class Refresher:
    """When to refresh the one request in flight, and how its answers settle (pure).

    Args:
        period: the control period.
        enabled: ``BrokerConfig.refresh_queued``.
        stats: the broker's counters (``requests_refreshed``, ``refreshes_missed``).
    """

    period: float
    enabled: bool
    stats: BrokerStats
    last_at: float = -math.inf
    #: refresh id -> the id it replaces, until the server says which one stands
    replacing: dict[int, int] = dataclasses.field(default_factory=dict)
    #: a request whose refresh missed (it runs): not refreshed again
    stopped: int | None = None
    #: the recent replies' queueing (``queue_ms`` plus ``batch_wait_ms``), seconds; none yet: unbounded
    queueing: LatencyWindow = dataclasses.field(default_factory=lambda: LatencyWindow(size=16, initial=math.inf))

    def on_reply(self, timing: Mapping[str, float] | None) -> None:
        """A chunk arrived with the server's ``timing``: learn how long this robot's requests queue."""
        if timing is not None:
            self.queueing.add((float(timing.get("queue_ms", 0.0)) + float(timing.get("batch_wait_ms", 0.0))) / 1000.0)

    def due(self, now: float, flights: Flights, saturated: bool, usual_wait: float) -> int | None:
        """The id of the request to refresh at ``now``, or ``None``: only the one request in
        flight of a saturated server, once a period, from an observation two periods old or more,
        once it has been out longer than ``usual_wait`` (the median round trip: before that it
        most likely runs already, and a refresh would miss), and only while this robot's replies
        usually queued two periods or more (served sooner, its observations do not age in the
        queue, and a replacement only shifts its cycle off the one the server plans for)."""
        if not (self.enabled and saturated and len(flights) == 1) or now - self.last_at < self.period - 1e-9:
            return None
        if self.queueing.median < 2.0 * self.period - 1e-9:
            return None
        rid, (sent, obs_time) = next(iter(flights.items()))
        if rid == self.stopped or now - obs_time < 2.0 * self.period - 1e-9 or now - sent < usual_wait:
            return None
        return rid

    def issued(self, now: float, intent: RequestIntent, replaces: int) -> RequestIntent:
        """``intent``, issued at ``now``, as the refresh of request ``replaces``."""
        self.last_at = now
        self.replacing[intent.request_id] = replaces
        self.stats.requests_refreshed += 1
        if len(self.replacing) > 64:  # answers lost with the link: forget the oldest
            self.replacing.pop(next(iter(self.replacing)))
        return dataclasses.replace(intent, replaces=replaces)

    def settle(self, code: str, request_id: int, flights: Flights, asked: Flights) -> None:
        """The server answered ``request_id`` with ``code`` (:data:`REFRESH_CODES`): it leaves
        ``flights``. Superseded, its round trip's start passes to its replacement in ``asked``
        (the chain's wait); a refresh missed, its chain stops and the request it named stands."""
        flights.pop(request_id, None)
        old = asked.pop(request_id, None)
        if code == REPLACE_MISSED:
            self.stats.refreshes_missed += 1
            self.stopped = self.replacing.pop(request_id, None)
            return
        for new, replaced in list(self.replacing.items()):
            if replaced == request_id:
                del self.replacing[new]
                if old is not None and new in asked:
                    asked[new] = (old[0], asked[new][1])
