"""Fixed-rate control loops: drift-free scheduling on a monotonic clock, with tick jitter measured.

:class:`RateScheduler` is the sans-I/O core: it owns the grid of due times
``start + k * period`` and, told when the loop actually woke, reports the tick's jitter and
how many ticks were skipped because the previous one overran (the grid never drifts: a late
tick does not push the later ones back). Two thin shells sleep until the next due time:

* :class:`SyncRunner` - blocking, for synchronous robot code (run it in the calling thread
  or in a thread of its own with :meth:`SyncRunner.start_thread`);
* :class:`AsyncRunner` - for asyncio programs.

Both take the clock and the sleep function as arguments, so tests drive them on a fake clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .exceptions import BrokerConfigError

__all__ = ["TickInfo", "JitterStats", "RateScheduler", "SyncRunner", "AsyncRunner"]


@dataclasses.dataclass(frozen=True, slots=True)
class TickInfo:
    """When one tick ran.

    Args:
        index: the tick's position on the grid (``scheduled = start + index * period``).
        scheduled: when it was due.
        started: when the loop actually ran it.
        jitter: ``started - scheduled`` (>= 0 unless the clock woke early).
        skipped: grid ticks skipped just before this one because the loop overran.
    """

    index: int
    scheduled: float
    started: float
    jitter: float
    skipped: int


class JitterStats:
    """Running jitter statistics: exact count, mean and max, percentiles over the last ``window`` ticks.

    Args:
        window: how many recent jitters to keep for percentiles.
    """

    def __init__(self, window: int = 100_000) -> None:
        self._ring = np.zeros(window)
        self._n = 0
        self.count = 0
        self.skipped = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, jitter: float, skipped: int = 0) -> None:
        """Record one tick."""
        self._ring[self._n % self._ring.shape[0]] = jitter
        self._n += 1
        self.count += 1
        self.skipped += skipped
        self.total += jitter
        if jitter > self.max:
            self.max = jitter

    @property
    def mean(self) -> float:
        """Mean jitter, seconds (NaN before any tick)."""
        return self.total / self.count if self.count else math.nan

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the kept jitters, seconds."""
        kept = self._ring[: min(self._n, self._ring.shape[0])]
        return float(np.percentile(kept, q)) if kept.size else math.nan

    def summary(self) -> dict[str, float]:
        """Count, skipped ticks, and mean / p50 / p99 / max jitter in seconds."""
        return {
            "ticks": float(self.count),
            "skipped": float(self.skipped),
            "mean_s": self.mean,
            "p50_s": self.percentile(50),
            "p99_s": self.percentile(99),
            "max_s": self.max if self.count else math.nan,
        }


class RateScheduler:
    """The due-time grid of a fixed-rate loop (sans-I/O).

    Args:
        period: seconds between ticks (> 0).
        start: the first tick's due time.

    Raises:
        BrokerConfigError: the period is not a positive finite number.
    """

    def __init__(self, period: float, start: float) -> None:
        if not (math.isfinite(period) and period > 0):
            raise BrokerConfigError(f"period must be finite and > 0, got {period}")
        self.period = float(period)
        self.start = float(start)
        self._k = 0
        self.stats = JitterStats()

    @property
    def next_due(self) -> float:
        """When the next tick is due."""
        return self.start + self._k * self.period

    def wake(self, now: float) -> TickInfo:
        """The loop runs a tick at ``now``: account for it and move to the next slot.

        The tick takes the latest slot already due. If the loop woke so late that several
        slots passed (the previous tick overran), the older ones are skipped rather than run
        back to back: a control loop wants the current state, not a burst.
        """
        k = self._k
        latest = int(math.floor((now - self.start) / self.period + 1e-9))
        run = max(k, latest)
        scheduled = self.start + run * self.period
        self._k = run + 1
        info = TickInfo(run, scheduled, now, now - scheduled, run - k)
        self.stats.add(info.jitter, run - k)
        return info


StepFn = Callable[[TickInfo], Any]


def _next_due(sched: RateScheduler, ticks: int, end: float, max_ticks: int | None, stop: Any) -> float | None:
    """When the next tick is due, or ``None`` when a run's limit is reached (shared by both runners)."""
    if stop is not None and stop.is_set():
        return None
    if max_ticks is not None and ticks >= max_ticks:
        return None
    due = sched.next_due
    return None if due >= end else due


class SyncRunner:
    """A blocking fixed-rate loop.

    Args:
        period: seconds between ticks.
        clock: monotonic clock (``time.monotonic`` by default).
        sleep: sleep function (``time.sleep`` by default).
        spin_s: sleep until this long before each due time, then busy-wait: less jitter at
            the cost of a busy core (0 by default).
    """

    def __init__(
        self,
        period: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        spin_s: float = 0.0,
    ) -> None:
        self.period = period
        self.clock = clock
        self.sleep = sleep
        self.spin_s = spin_s
        self.scheduler: RateScheduler | None = None

    @property
    def stats(self) -> JitterStats | None:
        """Jitter statistics of the current or last run."""
        return None if self.scheduler is None else self.scheduler.stats

    def run(
        self,
        step: StepFn,
        *,
        max_ticks: int | None = None,
        duration_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> JitterStats:
        """Call ``step(tick)`` every period until a limit is reached, ``stop`` is set, or
        ``step`` returns ``False``.

        Args:
            step: the per-tick work.
            max_ticks: stop after this many ticks.
            duration_s: stop after this long.
            stop: stop when this event is set (checked every tick).
        """
        clock = self.clock
        sched = self.scheduler = RateScheduler(self.period, clock())
        end = math.inf if duration_s is None else sched.start + duration_s
        ticks = 0
        while (due := _next_due(sched, ticks, end, max_ticks, stop)) is not None:
            self._wait_until(due)
            info = sched.wake(clock())
            ticks += 1
            if step(info) is False:
                break
        return sched.stats

    def _wait_until(self, due: float) -> None:
        clock = self.clock
        while True:
            left = due - clock()
            if left <= 0:
                return
            if left > self.spin_s:
                self.sleep(left - self.spin_s)
            # else: busy-wait the last spin_s

    def start_thread(self, step: StepFn, *, name: str = "chunkline-control", **kwargs: Any) -> threading.Thread:
        """Run :meth:`run` in a daemon thread (``kwargs`` as for :meth:`run`) and return it."""
        thread = threading.Thread(target=self.run, args=(step,), kwargs=kwargs, name=name, daemon=True)
        thread.start()
        return thread


class AsyncRunner:
    """An asyncio fixed-rate loop. ``step`` may be a plain function or a coroutine function.

    Args:
        period: seconds between ticks.
        clock: monotonic clock (``time.monotonic`` by default; the event loop's clock is too
            coarse on some platforms).
        sleep: async sleep (``asyncio.sleep`` by default).
    """

    def __init__(
        self,
        period: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.period = period
        self.clock = clock
        self.sleep = sleep
        self.scheduler: RateScheduler | None = None

    @property
    def stats(self) -> JitterStats | None:
        """Jitter statistics of the current or last run."""
        return None if self.scheduler is None else self.scheduler.stats

    async def run(
        self,
        step: Callable[[TickInfo], Any],
        *,
        max_ticks: int | None = None,
        duration_s: float | None = None,
        stop: asyncio.Event | None = None,
    ) -> JitterStats:
        """Like :meth:`SyncRunner.run`; awaits ``step`` when it returns an awaitable."""
        clock = self.clock
        sched = self.scheduler = RateScheduler(self.period, clock())
        end = math.inf if duration_s is None else sched.start + duration_s
        ticks = 0
        while (due := _next_due(sched, ticks, end, max_ticks, stop)) is not None:
            left = due - clock()
            while left > 0:
                await self.sleep(left)
                left = due - clock()
            info = sched.wake(clock())
            ticks += 1
            result = step(info)
            if inspect.isawaitable(result):
                result = await result
            if result is False:
                break
        return sched.stats
