"""When to start the next batch (sans-I/O): gather robots' requests into one forward pass without
putting the earliest deadline at risk.

A free lane runs a batch at once when the queue is full, when the oldest request has waited
``max_batch_wait``, when waiting longer would miss the earliest deadline, when no other request is
expected within the wait, or when a bigger batch would cost no less per request (predicted times,
plus the per-batch hand-off). Waiting only ever happens on an idle lane with a small queue: while
lanes are busy requests accumulate on their own. :class:`ArrivalTracker` supplies the arrivals
that could still join a batch: a robot waiting for its own reply will not send again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

__all__ = ["ArrivalRate", "ArrivalTracker", "BatchPolicy", "dispatch_time"]


@dataclasses.dataclass(frozen=True)
class BatchPolicy:
    """Batching settings of one model.

    Args:
        max_batch_size: most requests in one forward pass (1 disables batching).
        max_batch_wait: seconds the oldest request may wait for others to join.
        margin: seconds kept free before the earliest deadline (scheduling and reply jitter).
    """

    max_batch_size: int = 16
    max_batch_wait: float = 0.002
    margin: float = 0.001

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_batch_wait < 0 or self.margin < 0:
            raise ValueError("need max_batch_size >= 1, max_batch_wait >= 0, margin >= 0")


class ArrivalRate:
    """Moving estimate of the arrival rate (requests per second) from inter-arrival times.

    Args:
        alpha: weight of the newest inter-arrival time in the moving average.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._last: float | None = None
        self._gap: float | None = None

    def observe(self, now: float) -> None:
        """Record an arrival at ``now``."""
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self._gap = gap if self._gap is None else (1 - self.alpha) * self._gap + self.alpha * gap
        self._last = now

    def rate(self, now: float) -> float:
        """Arrivals per second; a long silence since the last arrival lowers it at once."""
        if self._gap is None or self._last is None:
            return 0.0
        gap = max(self._gap, now - self._last)
        return math.inf if gap == 0 else 1.0 / gap


class ArrivalTracker:
    """The arrivals one model's batching rule reads: the rate, which sessions are waiting for a
    reply, and the window of requests queued since the queue was last empty.

    Args:
        forget_after_s: a session silent this long no longer counts as active.
    """

    def __init__(self, forget_after_s: float = 2.0) -> None:
        self.forget_after_s = forget_after_s
        self.rate = ArrivalRate()
        #: when the latest request was admitted (``-inf``: none yet)
        self.last_arrival = -math.inf
        #: when the oldest request queued since the queue was empty arrived (a conservative bound)
        self.window_start = math.inf
        #: the earliest deadline offered since the queue was empty
        self.window_deadline = math.inf
        self._last_seen: dict[str, float] = {}
        self._pending: dict[str, int] = {}
        self._waiting = 0  # sessions in _last_seen with a request pending
        self._pruned_at = 0.0

    @property
    def waiting(self) -> int:
        """Recently active sessions that are waiting for a reply."""
        return self._waiting

    @property
    def pending(self) -> int:
        """Sessions with an admitted request not answered yet."""
        return len(self._pending)

    def admitted(self, session: str, deadline: float, now: float) -> None:
        """A request of ``session`` was admitted at ``now``: it is pending until :meth:`answered`."""
        pending = self._pending.get(session, 0)
        self._pending[session] = pending + 1
        if pending == 0 or session not in self._last_seen:
            self._waiting += 1
        self.rate.observe(now)
        self.last_arrival = now
        self._last_seen[session] = now
        if now - self._pruned_at > 1.0:
            self._prune(now)
        if now < self.window_start:
            self.window_start = now
        if deadline < self.window_deadline:
            self.window_deadline = deadline

    def answered(self, session: str, _future: object = None) -> None:
        """A request :meth:`admitted` was answered (any outcome; a future's done-callback may call it)."""
        left = self._pending.get(session, 1) - 1
        if left > 0:
            self._pending[session] = left
        else:
            self._pending.pop(session, None)
            if session in self._last_seen:
                self._waiting -= 1

    def queue_emptied(self) -> None:
        """Nothing is queued any more: the next request opens a new window."""
        self.window_start = self.window_deadline = math.inf

    def expected_rate(self, now: float) -> float:
        """Arrivals per second that could still join a batch: the measured rate, scaled by the
        share of recently active sessions not already waiting for a reply."""
        active = len(self._last_seen)
        if active == 0:
            return 0.0
        return self.rate.rate(now) * (active - self._waiting) / active

    def _prune(self, now: float) -> None:
        # An O(sessions) walk once a second rather than at every dispatch decision.
        self._pruned_at = now
        self._last_seen = {k: t for k, t in self._last_seen.items() if now - t < self.forget_after_s}
        self._waiting = sum(1 for k in self._last_seen if k in self._pending)


def dispatch_time(
    now: float,
    *,
    queued: int,
    oldest_arrival: float,
    earliest_deadline: float,
    policy: BatchPolicy,
    predict: Callable[[int], float],
    arrival_rate: float = math.inf,
    per_batch: float = 0.0,
) -> float:
    """The time at which a free lane should take the next batch (``now`` or later; ``inf`` when
    nothing is queued).

    Args:
        now: current time.
        queued: requests waiting.
        oldest_arrival: when the oldest of them was queued.
        earliest_deadline: the earliest deadline among them.
        policy: the model's batching settings.
        predict: predicted service time (seconds) of a batch of the given size.
        arrival_rate: requests per second expected; below one per ``max_batch_wait`` there is
            nothing to wait for.
        per_batch: seconds every batch costs besides its run (a lane's hand-off), which a
            bigger batch shares among more requests.
    """
    if queued <= 0:
        return math.inf
    if queued >= policy.max_batch_size or policy.max_batch_wait == 0:
        return now
    if arrival_rate * policy.max_batch_wait < 1.0:
        return now
    bigger = min(policy.max_batch_size, queued + 1)
    current = predict(queued)
    if current > 0 and (predict(bigger) + per_batch) * queued >= (current + per_batch) * bigger:
        return now  # a batch time that grows as fast as its size gains nothing from waiting
    by_wait = oldest_arrival + policy.max_batch_wait
    by_deadline = earliest_deadline - predict(min(policy.max_batch_size, queued + 1)) - policy.margin
    return max(now, min(by_wait, by_deadline))
