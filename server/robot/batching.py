"""When to start the next batch (sans-I/O): gather robots' requests into one forward pass without
putting the earliest deadline at risk.

The lane runs a batch as soon as it is free and any of these holds:

* the queue holds ``max_batch_size`` requests (a full batch gains nothing by waiting);
* the oldest queued request has waited ``max_batch_wait`` (bounded extra latency);
* waiting any longer would make the earliest deadline in the queue miss, given the predicted
  service time of the batch that waiting could produce (one more request than queued now);
* requests arrive too rarely for another one to be expected within the wait (a lone robot
  never pays the batching wait);
* a batch of one more would cost no less per request than the batch queued now (predicted
  service times, as timed at start-up and measured since, plus what every batch costs besides
  its run, the hand-off to a lane and back): nothing to wait for.

While the lane is busy requests accumulate on their own, so a free lane with a backlog starts at
once; waiting only ever happens on an idle lane with a small queue.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

__all__ = ["ArrivalRate", "BatchPolicy", "dispatch_time"]


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
        # The bigger batch would cost no less per request: a policy whose batch time grows as
        # fast as its size (per-robot work, each robot's images copied into the batch: a CPU
        # model, the no-op inline) gains nothing from waiting but the wait.
        return now
    by_wait = oldest_arrival + policy.max_batch_wait
    by_deadline = earliest_deadline - predict(min(policy.max_batch_size, queued + 1)) - policy.margin
    return max(now, min(by_wait, by_deadline))
