"""When to start the next batch (sans-I/O): gather robots' requests into one forward pass without
putting the earliest deadline at risk.

The lane runs a batch as soon as it is free and any of these holds:

* the queue holds ``max_batch_size`` requests (a full batch gains nothing by waiting);
* the oldest queued request has waited ``max_batch_wait`` (bounded extra latency);
* waiting any longer would make the earliest deadline in the queue miss, given the predicted
  service time of the batch that waiting could produce (one more request than queued now).

While the lane is busy requests accumulate on their own, so a free lane with a backlog starts at
once; waiting only ever happens on an idle lane with a small queue.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

__all__ = ["BatchPolicy", "dispatch_time"]


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


def dispatch_time(
    now: float,
    *,
    queued: int,
    oldest_arrival: float,
    earliest_deadline: float,
    policy: BatchPolicy,
    predict: Callable[[int], float],
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
    """
    if queued <= 0:
        return math.inf
    if queued >= policy.max_batch_size or policy.max_batch_wait == 0:
        return now
    by_wait = oldest_arrival + policy.max_batch_wait
    by_deadline = earliest_deadline - predict(min(policy.max_batch_size, queued + 1)) - policy.margin
    return max(now, min(by_wait, by_deadline))
