"""A loop timer for "answer the moment queued work runs out of budget" (robot and text classes)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

__all__ = ["EarliestTimer"]


class EarliestTimer:
    """Fires ``callback`` at the earliest time it has been armed for.

    Arming for a later time than the one pending changes nothing (the pending firing comes first
    and the callback re-arms for whatever is next); arming earlier replaces it.

    Args:
        clock: the time ``arm`` is given in (monotonic seconds).
        callback: called on the loop when the time comes.
    """

    def __init__(self, clock: Callable[[], float], callback: Callable[[], None]) -> None:
        self._clock = clock
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self.at = math.inf

    def arm(self, at: float | None) -> None:
        """Fire at ``at`` (on ``clock``) unless a firing is already due no later; ``None``: nothing to do."""
        if at is None or at >= self.at:
            return
        self.cancel()
        self.at = at
        self._handle = asyncio.get_running_loop().call_later(max(0.0, at - self._clock()), self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self.at = None, math.inf

    def _fire(self) -> None:
        self._handle, self.at = None, math.inf
        self._callback()
