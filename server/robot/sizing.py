"""Which batch sizes a policy may run now, and which size to time next (sans-I/O).

Start-up times batch 1 only (and any ``warm_batch_sizes``), so a server is ready after one pass and
a large model is never asked for a batch it may not fit before it serves anyone. The larger sizes
(powers of two up to ``max_batch_size``) are learnt in quiet spells (a timing pass on a lane while
the runner is idle) and on first use under backlog (one rung more than the largest size known).
A size that runs out of device memory, hangs, or whose predicted peak memory does not fit caps
the batch size below it. :class:`BatchSizeTuner` is what the runner asks; it owns no timer or lane.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal
from chunkline.server.robot.batching import BatchPolicy

__all__ = ["BatchSizeTuner", "BatchSizing", "MemorySample", "TimingPass", "size_ladder"]

log = logging.getLogger("chunkline.server")


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


@dataclasses.dataclass(frozen=True, slots=True)
class TimingPass:
    """A background timing pass: its size, when it started and how long admission plans it to take."""

    size: int
    started: float
    planned_s: float


class BatchSizeTuner:
    """One model's batch size over time: the batching rule with the size allowed now, the caps
    that failures set, and when to time the next size in the background (sans-I/O).

    Args:
        name: the model's name (for the log).
        batching: the configured batching rule.
        sizing: the batch-size state; ``None``: every size up to ``max_batch_size`` from the first
            batch, nothing timed in the background.
    """

    def __init__(self, name: str, batching: BatchPolicy, sizing: BatchSizing | None) -> None:
        if sizing is not None and sizing.max_batch_size != batching.max_batch_size:
            raise ValueError("sizing and batching must agree on max_batch_size")
        self.name = name
        self.sizing = sizing
        #: the batching rule, its size lowered to the cap
        self.batching = batching
        self._now = batching  # `batching` with the size allowed now
        self._since: float | None = None  # when serving began (background timing may start)
        #: when the last size within the cap was timed (``None`` until then)
        self.sizes_timed_at: float | None = None
        #: whether sizes may be left to time in the background: ``False`` for good once every size
        #: within the cap is timed (see :attr:`BatchSizing.done`), so the runner stops asking
        self.timing_left = sizing is not None and sizing.background
        self._pass: TimingPass | None = None  # the latest timing pass started (see while_timing)

    @property
    def max_batch_size(self) -> int:
        return self.batching.max_batch_size

    @property
    def timing(self) -> bool:
        """Whether a background timing pass is running."""
        return self.sizing is not None and self.sizing.timing is not None

    def batching_now(self, queued: int) -> BatchPolicy:
        """The batching rule with the batch size allowed now (one rung more under a backlog)."""
        if self.sizing is None:
            return self.batching
        limit = self.sizing.limit(queued)
        if limit != self._now.max_batch_size:
            if limit > self._now.max_batch_size and limit not in self.sizing.timed:
                log.info("policy %s: %d requests queued; first batch of %d", self.name, queued, limit)
            self._now = dataclasses.replace(self.batching, max_batch_size=limit)
        return self._now

    def ran(self, size: int) -> None:
        """A batch of ``size`` ran cleanly (its first run lets the next rung be tried)."""
        if self.sizing is not None and size not in self.sizing.timed:
            self.sizing.measured(size)

    def failed(self, size: int, reason: str, now: float) -> int | None:
        """A batch or timing pass of ``size`` ran out of memory, hung or failed. Returns the new
        most robots per batch when that lowered it (admission must follow), else ``None``."""
        if self.sizing is None:
            return None
        self.sizing.failed(size, reason)
        return self._cap(now)

    def serving(self, now: float) -> bool:
        """Serving has begun at ``now``. Returns whether there are sizes left to time."""
        if self.sizing is None or self._since is not None:
            return False
        self._since = now
        if self.sizing.done:
            self.sizes_timed_at = now
            return False
        return True

    def next_timing(self, last_arrival: float, predict: Callable[[int], float]) -> tuple[int, float] | None:
        """The size to time next and the earliest time it may start (the runner must be idle
        then); ``None`` when nothing is to be timed now."""
        sizing = self.sizing
        if sizing is None or self._since is None or not self.timing_left:
            return None
        nxt = sizing.next_timing(last_arrival, predict)
        if nxt is None and sizing.done:
            self.timing_left = False
        return nxt

    def start(self, size: int, now: float | None = None, planned_s: float | None = None) -> None:
        """A timing pass of ``size`` starts at ``now``, planned to take ``planned_s`` (both known:
        :meth:`while_timing` can tell a refused request when it ends)."""
        assert self.sizing is not None
        self.sizing.started(size)
        self._pass = TimingPass(size, now, planned_s) if now is not None and planned_s is not None else None
        log.info("policy %s: quiet; timing batch %d in the background ...", self.name, size)

    def while_timing(self, refusal: Refusal, now: float) -> Refusal:
        """``refusal`` as answered at ``now``: a ``deadline_unmeetable`` one without a retry time
        (a batch of one alone predicted past the budget) while a timing pass holds a lane gets
        the pass's planned end as its retry time, and says so. Nothing re-measures a stale
        estimate while the pass runs (see the runner's idle re-measurement); once it ends, a
        retry is judged, or starts that re-measurement, on an idle runner. A pass running past
        its plan is given about its planned time again."""
        run = self._pass
        if refusal.code is not ErrorCode.DEADLINE_UNMEETABLE or refusal.retry_after_ms is not None or run is None \
                or self.sizing is None or self.sizing.timing != run.size:
            return refusal
        left = run.started + run.planned_s - now
        planned_ms = run.planned_s * 1e3
        why = f"planned to end in {left * 1e3:.0f} ms" if left > 0 else f"{-left * 1e3:.0f} ms past its planned {planned_ms:.0f} ms"
        return Refusal(refusal.code, f"{refusal.message}; batch {run.size} is being timed in the background ({why})",
                       max(1.0, 1e3 * (left if left > 0 else run.planned_s)))

    def timed(self, size: int, seconds: float, memory: MemorySample | None, now: float) -> int | None:
        """A timing pass of ``size`` took ``seconds``. Returns the new most robots per batch when
        the memory guard lowered it, else ``None``."""
        assert self.sizing is not None and self._since is not None
        self.sizing.record_timing(size, memory)
        peak = "" if memory is None else f", peak {memory.peak / 2**20:.0f} MiB"
        log.info("policy %s: batch %d takes %.2f ms (timed in the background%s; %d sizes left, %.1f s after ready)",
                 self.name, size, seconds * 1e3, peak, len(self.sizing.pending), now - self._since)
        return self._cap(now)

    def _cap(self, now: float) -> int | None:
        sizing = self.sizing
        assert sizing is not None
        capped: int | None = None
        if sizing.cap < self.batching.max_batch_size:
            log.warning("policy %s: %s; serving at most %d robots per batch", self.name, sizing.cap_reason, sizing.cap)
            self.batching = dataclasses.replace(self.batching, max_batch_size=sizing.cap)
            capped = sizing.cap
        if sizing.done and self.sizes_timed_at is None and self._since is not None:
            self.sizes_timed_at = now
            if sizing.background:
                log.info("policy %s: every batch size up to %d timed, %.1f s after ready", self.name, sizing.cap,
                         now - self._since)
        return capped
