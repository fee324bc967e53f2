"""The queue chores of a request class that starts its requests one at a time (text, planner).

The robot class forms batches and keeps its own lane machinery; the text and planner classes
start one admitted request whenever a slot frees. Both need the same three chores around their
:class:`~chunkline.server.core.admission.controller.AdmissionController`, kept here so there is
one way to do each:

- draw the next request to start (admission's choice: priority, fairness, deadline);
- answer, at once, every queued request admission dropped (expired or evicted): the client must
  learn that nothing is coming, with the reason admission gave;
- keep one timer on the earliest queued deadline, so expiry is answered even while every slot is
  busy and nothing else happens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from chunkline.server.core.admission.controller import AdmissionController
from chunkline.server.core.admission.decisions import Dropped
from chunkline.server.core.timers import EarliestTimer
from chunkline.server.errors import Refusal

__all__ = ["OneAtATimeQueue", "refusal_for_drop"]


def refusal_for_drop(dropped: Dropped) -> Refusal:
    """The answer a dropped request gets: admission's code, reason and retry time."""
    return Refusal(dropped.code, dropped.reason, retry_after_ms=dropped.retry_after_ms)


class OneAtATimeQueue:
    """Draws, drop answers and expiry for one model's admission queue (see the module docstring).

    Args:
        admission: the model's admission controller (the caller still offers, completes and
            cancels on it directly).
        clock: the controller's time (monotonic seconds).
        on_dropped: called with a dropped request's payload and its refusal, once per drop.
        after_expiry: called after an expiry firing has answered its drops (a class that
            publishes its queue state refreshes it here).
    """

    def __init__(
        self,
        admission: AdmissionController,
        clock: Callable[[], float],
        on_dropped: Callable[[Any, Refusal], None],
        after_expiry: Callable[[], None] | None = None,
    ) -> None:
        self.admission = admission
        self._clock = clock
        self._on_dropped = on_dropped
        self._after_expiry = after_expiry
        # Created on first use: an EarliestTimer arms on the running loop.
        self._expiry: EarliestTimer | None = None

    def take_next(self, now: float) -> Any | None:
        """The payload of the next request to start, or ``None`` when none is queued (or what
        was queued has just been dropped: those are answered before this returns)."""
        batch = self.admission.next_batch(now, 1)
        self.answer_dropped()
        return batch[0].payload if batch else None

    def answer_dropped(self) -> None:
        """Answer every request admission has dropped since the last call."""
        if not self.admission.dropped:  # the usual case: nothing to take
            return
        for dropped in self.admission.take_dropped():
            self._on_dropped(dropped.request.payload, refusal_for_drop(dropped))

    def arm_expiry(self) -> None:
        """Fire at the earliest queued deadline (call after anything that queues or dequeues)."""
        if self._expiry is None:
            self._expiry = EarliestTimer(self._clock, functools.partial(OneAtATimeQueue._on_expiry, self))
        self._expiry.arm(self.admission.next_expiry())

    def close(self) -> None:
        """Stop the expiry timer (the class is stopping)."""
        if self._expiry is not None:
            self._expiry.cancel()

    def _on_expiry(self) -> None:
        self.admission.expire(self._clock())
        self.answer_dropped()
        self.arm_expiry()
        if self._after_expiry is not None:
            self._after_expiry()
