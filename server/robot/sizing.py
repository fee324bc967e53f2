"""Which batch sizes a policy may run now, and which size to time next (sans-I/O).

Start-up times batch 1 only (and any ``warm_batch_sizes``), so that a server is ready after one
pass rather than after a pass of every size (a real ACT on a CPU: batch 8 takes 11x batch 1), and
a large model on a GPU is never asked for a batch it may not fit before it serves anyone. The
larger sizes -- a ladder of powers of two up to ``max_batch_size`` -- are then learnt two ways:

* **in quiet spells** (background timing): while the runner is idle and no request has arrived
  for ``quiet_s`` or for longer than the pass is predicted to take (whichever is longer), the
  smallest size not timed yet runs on a lane with example observations, one size per spell;
* **on first use under backlog**: batches may hold at most the ``allowed`` size, which starts at
  the largest size timed and climbs one rung when more requests are queued than it allows and
  its current size has a measurement (one untimed size in use at a time).

A size that runs out of device memory or hangs caps the batch size below it. On a GPU every
timing pass also reports its peak memory; the memory per robot (above what was allocated before
the pass) predicts the peak of larger batches, and the sizes whose prediction does not fit in
``headroom`` of the memory the process can get are capped before they are tried.

The runner (:mod:`.runner`) owns the timers and lanes; this core only decides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

__all__ = ["BatchSizing", "MemorySample", "size_ladder"]


def size_ladder(max_batch_size: int) -> tuple[int, ...]:
    """The sizes learnt one after another: powers of two below ``max_batch_size``, then it."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    sizes = [1 << k for k in range(max_batch_size.bit_length()) if 1 << k < max_batch_size]
    return (*sizes, max_batch_size)


@dataclasses.dataclass(frozen=True)
class MemorySample:
    """Device memory around one timing pass (bytes).

    Args:
        base: allocated before the pass (weights, caches).
        peak: the most allocated during the pass.
        limit: what the process can hold: free device memory plus its allocator's own pool.
    """

    base: int
    peak: int
    limit: int


class BatchSizing:
    """The batch-size state of one policy.

    Args:
        max_batch_size: the configured most robots per batch.
        timed: sizes already timed (start-up); must hold 1.
        background: time the other sizes in quiet spells (``False``: only on first use).
        quiet_s: the shortest silence that counts as a quiet spell.
        headroom: the share of the memory the process can get that a batch's predicted peak may use.
    """

    def __init__(self, max_batch_size: int, timed: Iterable[int] = (1,), *, background: bool = True,
                 quiet_s: float = 0.5, headroom: float = 0.9) -> None:
        if quiet_s < 0 or not 0 < headroom <= 1:
            raise ValueError("quiet_s must be >= 0 and headroom in (0, 1]")
        self.max_batch_size = max_batch_size
        self.ladder = size_ladder(max_batch_size)
        self.timed: set[int] = {s for s in timed if s <= max_batch_size}
        if 1 not in self.timed:
            raise ValueError("batch 1 must be timed before serving")
        self.background = background
        self.quiet_s = quiet_s
        self.headroom = headroom
        #: the most robots a batch may hold: never above it, lowered by out-of-memory, hangs and the memory guard
        self.cap = max_batch_size
        #: the most robots a batch may hold now (grows up to ``cap``)
        self.allowed = max(self.timed)
        #: the size whose background timing is running, if any
        self.timing: int | None = None
        #: why the cap was last lowered (for the console and ``stats``)
        self.cap_reason: str | None = None
        self._done = False  # every size within the cap timed (see done)

    # ------------------------------------------------------------------ state

    @property
    def pending(self) -> tuple[int, ...]:
        """Ladder sizes within the cap not timed yet."""
        return tuple(s for s in self.ladder if s <= self.cap and s not in self.timed)

    @property
    def done(self) -> bool:
        """Every size within the cap is timed. Once true it stays true (sizes timed are never
        forgotten and the cap only falls), so it is worked out until then only: the runner asks
        after every batch."""
        if not self._done:
            self._done = not self.pending
        return self._done

    # ------------------------------------------------------------------ decisions

    def next_timing(self, last_arrival: float, predict: Callable[[int], float]) -> tuple[int, float] | None:
        """The size to time next in the background and the earliest time it may start (the runner
        must also be idle then); ``None`` when there is nothing to time or a timing runs.

        Args:
            last_arrival: when the latest request arrived (``-inf``: none yet).
            predict: the service-time model's estimate of a batch's time.
        """
        if not self.background or self.timing is not None or self.done:
            return None
        size = self.pending[0]
        # A spell longer than the pass suggests the pass fits in the next gap too.
        return size, last_arrival + max(self.quiet_s, predict(size))

    def limit(self, queued: int) -> int:
        """The most robots the next batch may hold, with ``queued`` requests waiting: ``allowed``,
        one rung higher when the backlog exceeds it and it has been measured (first use)."""
        if queued > self.allowed and self.allowed < self.cap and self.allowed in self.timed and self.timing is None:
            self.allowed = min(self.cap, next(s for s in self.ladder if s > self.allowed))
        return self.allowed

    # ------------------------------------------------------------------ outcomes

    def started(self, size: int) -> None:
        """A background timing of ``size`` has started."""
        self.timing = size

    def record_timing(self, size: int, memory: MemorySample | None = None) -> None:
        """The background timing of ``size`` succeeded; with its memory on a GPU."""
        if self.timing == size:
            self.timing = None
        self.measured(size)
        if memory is not None:
            self._guard(size, memory)

    def measured(self, size: int) -> None:
        """A batch of ``size`` ran (a real batch, or a timing pass): it fits."""
        if size <= self.cap:
            self.timed.add(size)
            self.allowed = max(self.allowed, size)

    def _guard(self, size: int, memory: MemorySample) -> None:
        per_robot = (memory.peak - memory.base) / size
        if per_robot <= 0:
            return
        # Linear in the batch size through the measured point: cautious, as part of a pass's
        # memory does not grow with the batch.
        fits = math.floor((self.headroom * memory.limit - memory.base) / per_robot)
        if fits < self.cap:
            self._lower(max(size, fits), f"batch {fits + 1} would need more than {self.headroom:.0%} of the device memory")

    def failed(self, size: int, reason: str) -> None:
        """A batch of ``size`` ran out of memory or hung: serve only smaller batches from now on."""
        if self.timing == size:
            self.timing = None
        if size > 1:
            self._lower(max((s for s in self.ladder if s < size), default=1), f"batch {size} {reason}")

    def _lower(self, cap: int, reason: str) -> None:
        if cap >= self.cap:
            return
        self.cap = cap
        self.cap_reason = reason
        self.allowed = min(self.allowed, cap)
