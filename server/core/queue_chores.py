"""The chores around one model's admission queue, the same in every request class (the I/O side of
:mod:`chunkline.server.core.admission`, which stays sans-I/O): draws, drop answers and the expiry
timer. Each :class:`~chunkline.server.core.pool.ModelPool` keeps one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from chunkline.server.core.admission import AdmissionController, Dropped, Request
from chunkline.server.core.admission.selection import Compatible
from chunkline.server.core.timers import EarliestTimer
from chunkline.server.errors import Refusal

__all__ = ["QueueChores", "refusal_for_drop"]


def refusal_for_drop(dropped: Dropped) -> Refusal:
    """The answer a dropped request gets: admission's code, reason and retry time."""
    return Refusal(dropped.code, dropped.reason, retry_after_ms=dropped.retry_after_ms)


class QueueChores:
    """The chores around one model's admission queue, the same in every class: draw the next
    batch to start (admission's choice), answer at once every queued request admission dropped
    (expired or evicted: the client must learn that nothing is coming, with admission's reason),
    and keep one loop timer on the earliest queued deadline, so that expiry is answered even while
    every slot is busy and nothing else happens.

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

    def take(self, now: float, size: int, compatible: Compatible | None = None) -> list[Request]:
        """The next batch to start, at most ``size`` requests (admission's choice), marked running;
        ``[]`` when none is queued (or what was queued has just been dropped: those are answered
        before this returns)."""
        admission = self.admission
        batch = admission.next_batch(now, size, compatible)
        if admission.dropped:
            self.answer_dropped()
        return batch

    def answer_dropped(self) -> None:
        """Answer every request admission has dropped since the last call."""
        if not self.admission.dropped:  # the usual case: nothing to take
            return
        for dropped in self.admission.take_dropped():
            self._on_dropped(dropped.request.payload, refusal_for_drop(dropped))

    def arm_expiry(self) -> None:
        """Fire at the earliest queued deadline (call after anything that queues or dequeues)."""
        if self._expiry is None:
            self._expiry = EarliestTimer(self._clock, functools.partial(QueueChores._on_expiry, self))
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
