"""The first-come-first-served baseline that deadline-aware admission is compared against.

A benchmark strategy, not a serving mode: arrival order across every tenant and priority
(:class:`FifoSelector`), nothing refused or dropped for its deadline, and a queue bounded only in
name (:func:`fifo_config`). Build a controller or a runner with both to measure the baseline.
"""

from __future__ import annotations

import math

from chunkline.server.core.admission import AdmissionConfig, QueueView, Request
from chunkline.server.core.admission.selection import Compatible, take_in_order

__all__ = ["FifoSelector", "fifo_config", "FIFO_MAX_QUEUE"]

#: The baseline's queue bound: in effect none.
FIFO_MAX_QUEUE = 1_000_000


def fifo_config(max_batch_size: int = 1, workers: int = 1, max_queue: int = FIFO_MAX_QUEUE) -> AdmissionConfig:
    """Admission settings of the baseline: no refusal or drop for a deadline."""
    return AdmissionConfig(max_queue=max_queue, max_batch_size=max_batch_size, workers=workers, drop_late=False,
                           deadlines=False)


class FifoSelector:
    """The next batch in arrival order, whatever the tenants, priorities and deadlines."""

    fairness_slack = math.inf  # what admission's predictions assume: nobody waits for fairness

    def select(self, queue: QueueView, now: float, limit: int, compatible: Compatible | None) -> list[Request]:
        # Queue items are (-deadline, -arrival sequence, request): the oldest has the largest -seq.
        queued = sorted((item for flows in queue.levels.values() for flow in flows.values() for item in flow.items),
                        key=lambda item: -item[1])
        return take_in_order(queue, (request for _, _, request in queued), limit, compatible)
