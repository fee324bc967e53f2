"""How long a batch takes, per batch size: the estimates admission plans with (sans-I/O)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

__all__ = ["ServiceTimeModel"]

#: Hand-off samples up to this are never winsorised (sub-millisecond wobble is no outlier).
_HANDOFF_CLIP_FLOOR_S = 0.001


class ServiceTimeModel:
    """Moving estimates of how long a batch takes, per batch size.

    Per observed size it keeps an EWMA of the time and of its absolute deviation (as TCP does
    for round-trip times); :meth:`predict` is ``mean + deviation_factor * deviation`` so that
    admission plans for a bad-but-usual batch, not the average one. Sizes never observed are
    interpolated linearly between the nearest observed ones; above the largest, extrapolated
    along the last segment (or proportionally to the size with a single point); below the
    smallest, the smallest's estimate.

    Two rules keep one bad sample from poisoning admission. A batch size that is rarely seen
    keeps its estimate until it is seen again, and admission refuses the work that would form
    it, so an outlier there (a garbage-collection pause, a neighbour's burst) could otherwise
    refuse work for good. (1) Samples are **winsorised**: one above ``clip_factor`` times the
    estimate for its size (own or interpolated; ``mean + 4 * deviation`` once the size has a
    history) counts as that bound, so a real slow-down still moves the estimate within a few
    batches while a lone pause moves it little. (2) Estimates are **monotone** in the batch
    size: a batch is never predicted to take longer than a larger batch's estimate, since a
    smaller batch does not cost more.

    Besides the batch's own run, a batch holds its worker while it is handed over and its outcome
    handed back (a lane thread waking up, the event loop getting round to the result: fractions of
    a millisecond when the loop is idle, milliseconds when it is busy receiving a storm of
    uploads). That **hand-off** is one more moving estimate (:meth:`observe_handoff`), the same
    for every batch size; :meth:`occupancy` is a batch's time plus it, which is what admission
    plans with: a queue of ``k`` batches ahead is ``k`` occupancies, not ``k`` runs.

    Args:
        alpha: EWMA weight of a new sample for the mean.
        beta: EWMA weight of a new sample for the deviation.
        deviation_factor: how many deviations :meth:`predict` adds.
        default_s: the estimate before anything is observed.
        initial: prior estimates ``{batch_size: seconds}`` (e.g. from a warm-up; see :meth:`prime`).
        clip_factor: a sample counts as at most this many times the estimate for its size
            (``inf`` turns winsorising off).
    """

    def __init__(
        self,
        alpha: float = 0.2,
        beta: float = 0.25,
        deviation_factor: float = 2.0,
        default_s: float = 0.0,
        initial: Mapping[int, float] | None = None,
        clip_factor: float = 3.0,
    ) -> None:
        if not (0 < alpha <= 1 and 0 < beta <= 1) or deviation_factor < 0 or default_s < 0 or not clip_factor > 1:
            raise ValueError("alpha and beta must be in (0, 1], deviation_factor and default_s >= 0, clip_factor > 1")
        self.clip_factor = clip_factor
        self.alpha = alpha
        self.beta = beta
        self.deviation_factor = deviation_factor
        self.default_s = default_s
        self._sizes: list[int] = []
        self._mean: dict[int, float] = {}
        self._dev: dict[int, float] = {}
        self._count: dict[int, int] = {}
        # Answers of mean() and predict() per batch size: admission asks for the same few sizes
        # several times per request. A sample of one size changes the answers of a few sizes only
        # (see _set): the answers for every other size are kept from batch to batch.
        self._means: dict[int, float] = {}
        # (for deviation_factor == _planned_k only: a change of factor clears them)
        self._predictions: dict[int, float] = {}
        # Per observed size, its planning value mean + k * deviation for k = _planned_k (the
        # deviation_factor last asked about): interpolation then reads a dict, with no call per size.
        self._planned: dict[int, float] = {}
        self._planned_k = deviation_factor
        # Per observed size (aligned with _sizes), the least of its value and every larger size's,
        # for _mean and _planned: the monotone cap of an estimate is then one lookup.
        self._mean_floor: list[float] = []
        self._planned_floor: list[float] = []
        self._handoff_mean = 0.0
        self._handoff_dev = 0.0
        self._handoff_count = 0
        self.prime(initial or {})

    def prime(self, times: Mapping[int, float]) -> None:
        """Measured times ``{batch_size: seconds}`` from timing passes (start-up, quiet spells) for
        sizes no real batch has shown yet: each replaces the interpolation or extrapolation for its
        size, and the first real batch of that size replaces it in turn. Sizes already observed
        keep their estimates (real traffic knows better than example observations)."""
        for size, seconds in times.items():
            if self._count.get(int(size), 0) == 0 and math.isfinite(seconds) and seconds >= 0:
                self._set(int(size), float(seconds), 0.0, 0)

    def _set(self, size: int, mean: float, dev: float, count: int) -> None:
        if size < 1:
            raise ValueError("batch size must be >= 1")
        new = size not in self._mean
        if new:
            bisect.insort(self._sizes, size)
        self._mean[size] = mean
        self._dev[size] = dev
        self._planned[size] = planned = mean + self._planned_k * dev
        self._count[size] = count
        sizes, mean_floor, planned_floor = self._sizes, self._mean_floor, self._planned_floor
        i = bisect.bisect_left(sizes, size)
        n = len(sizes)
        if new:
            mean_floor.insert(i, mean)
            planned_floor.insert(i, planned)
        if i + 1 < n:  # (compared, not min(): this runs once per batch)
            if mean_floor[i + 1] < mean:
                mean = mean_floor[i + 1]
            if planned_floor[i + 1] < planned:
                planned = planned_floor[i + 1]
        mean_floor[i], planned_floor[i] = mean, planned
        if i:  # (the smallest size, a batch of one, has no smaller size to walk down to)
            _suffix_min(sizes, self._mean, mean_floor, i - 1)
            _suffix_min(sizes, self._planned, planned_floor, i - 1)
        means, predictions = self._means, self._predictions
        # Drop the answers the new estimate can change (see _interp): every interpolation for a
        # new size; else every size up to it (its own, and the smaller ones it caps), the sizes
        # interpolated between it and the next observed size, and, when it is one of the two
        # largest, the sizes extrapolated beyond the largest.
        if new or i + 2 >= n:
            means.clear()
            predictions.clear()
            # The size's own answers are its suffix minima, kept at once: the next request asks for them.
            means[size] = mean_floor[i]
            predictions[size] = planned_floor[i]
            return
        upper = sizes[i + 1]
        for answers in (means, predictions):
            for b in [b for b in answers if b < upper]:
                del answers[b]
        if len(means) < 64:
            means[size] = mean_floor[i]
        if len(predictions) < 64:
            predictions[size] = planned_floor[i]

    def observe(self, batch_size: int, seconds: float) -> None:
        """Feed one measured batch.

        Args:
            batch_size: how many requests it held.
            seconds: how long it ran.
        """
        if batch_size < 1 or not math.isfinite(seconds) or seconds < 0:
            return  # a bogus measurement must not poison admission
        n = self._count.get(batch_size, 0)
        if n == 0:
            # The first sample replaces any prior (winsorised against it or the interpolation
            # from other sizes); a deviation of a quarter of it keeps the first plans cautious
            # until more samples show how steady the backend is.
            if self._sizes:
                seconds = min(seconds, self.clip_factor * self._raw(batch_size, self._mean))
            self._set(batch_size, seconds, seconds / 4.0, 1)
            return
        m, d = self._mean[batch_size], self._dev[batch_size]
        # min(seconds, max(m + 4 d, clip_factor m)), compared rather than called (once per batch)
        bound, clip = m + 4.0 * d, self.clip_factor * m
        if clip > bound:
            bound = clip
        if seconds > bound:
            seconds = bound
        d = (1 - self.beta) * d + self.beta * abs(seconds - m)
        m = (1 - self.alpha) * m + self.alpha * seconds
        self._set(batch_size, m, d, n + 1)

    def observe_handoff(self, seconds: float) -> None:
        """Feed one batch's hand-off: how long it held its worker beyond its own run (seconds).

        Winsorised as batch times are (at ``clip_factor`` times the mean, ``mean + 4 *
        deviation``, or 1 ms, whichever is largest): a lone pause of the event loop moves the
        estimate little, a loop that stays busy moves it within a few batches.
        """
        if not math.isfinite(seconds):
            return
        if seconds <= 0.0:
            seconds = 0.0
        n = self._handoff_count
        if n == 0:
            self._handoff_mean, self._handoff_dev, self._handoff_count = seconds, seconds / 2.0, 1
            return
        m, d = self._handoff_mean, self._handoff_dev
        # min(seconds, max(m + 4 d, clip_factor m, the floor)), compared rather than called (once per batch)
        bound, clip = m + 4.0 * d, self.clip_factor * m
        if clip > bound:
            bound = clip
        if _HANDOFF_CLIP_FLOOR_S > bound:
            bound = _HANDOFF_CLIP_FLOOR_S
        if seconds > bound:
            seconds = bound
        self._handoff_dev = (1 - self.beta) * d + self.beta * abs(seconds - m)
        self._handoff_mean = (1 - self.alpha) * m + self.alpha * seconds
        self._handoff_count = n + 1

    def handoff(self) -> float:
        """The planning estimate of a batch's hand-off: mean plus ``deviation_factor`` deviations
        (0 until one is observed)."""
        return self._handoff_mean + self.deviation_factor * self._handoff_dev

    def occupancy(self, batch_size: int) -> float:
        """How long a batch of ``batch_size`` is planned to hold its worker: :meth:`predict` plus
        :meth:`handoff`."""
        k = self.deviation_factor
        # (predict's kept answer read here, without the call, while the factor it was made for holds)
        value = self._predictions.get(batch_size) if k == self._planned_k else None
        if value is None:
            value = self.predict(batch_size)
        return value + self.handoff()

    def mean_occupancy(self, batch_size: int) -> float:
        """The average time a batch of ``batch_size`` holds its worker: :meth:`mean` plus the
        hand-off's mean (how often a busy worker takes the next batch)."""
        return self.mean(batch_size) + self._handoff_mean

    def _interp(self, batch_size: int, value: Mapping[int, float], floor: list[float]) -> float:
        """The estimate for ``batch_size`` from ``value`` (per observed size), capped by every
        larger size's (monotone in size; ``floor``: ``value``'s suffix minima)."""
        raw = self._raw(batch_size, value)
        i = bisect.bisect_right(self._sizes, batch_size)
        if i < len(floor) and floor[i] < raw:
            return floor[i]
        return raw

    def _raw(self, batch_size: int, value: Mapping[int, float]) -> float:
        sizes = self._sizes
        if not sizes:
            return self.default_s
        i = bisect.bisect_left(sizes, batch_size)
        if i < len(sizes) and sizes[i] == batch_size:
            return value[batch_size]
        if i == 0:
            return value[sizes[0]]
        if i == len(sizes):
            hi = sizes[-1]
            if len(sizes) == 1:
                return value[hi] * batch_size / hi
            lo = sizes[-2]
            slope = max(0.0, (value[hi] - value[lo]) / (hi - lo))
            return value[hi] + slope * (batch_size - hi)
        lo, hi = sizes[i - 1], sizes[i]
        f = (batch_size - lo) / (hi - lo)
        return value[lo] + f * (value[hi] - value[lo])

    def mean(self, batch_size: int) -> float:
        """The moving average time of a batch of ``batch_size`` (interpolated if unseen)."""
        value = self._means.get(batch_size)
        if value is None:
            value = self._interp(batch_size, self._mean, self._mean_floor)
            if self._sizes and len(self._means) < 64:
                self._means[batch_size] = value
        return value

    def predict(self, batch_size: int) -> float:
        """The planning estimate for a batch of ``batch_size``: mean plus ``deviation_factor`` deviations."""
        k = self.deviation_factor
        if k != self._planned_k:  # a public attribute was changed: the planning values follow, no old answer is kept
            self._planned_k = k
            self._planned = {b: self._mean[b] + k * self._dev[b] for b in self._sizes}
            self._planned_floor = [math.nan] * len(self._sizes)
            _suffix_min(self._sizes, self._planned, self._planned_floor, len(self._sizes) - 1)
            self._predictions.clear()
        value = self._predictions.get(batch_size)
        if value is None:
            value = self._interp(batch_size, self._planned, self._planned_floor)
            if self._sizes and len(self._predictions) < 64:  # bounded whatever sizes callers ask about
                self._predictions[batch_size] = value
        return value

    def handoff_snapshot(self) -> tuple[float, float]:
        """The hand-off's ``(mean_s, deviation_s)``."""
        return self._handoff_mean, self._handoff_dev

    def snapshot(self) -> dict[int, tuple[float, float]]:
        """Observed sizes to ``(mean_s, deviation_s)`` (for the ``chunkline_service_time_seconds`` gauge)."""
        return {b: (self._mean[b], self._dev[b]) for b in self._sizes}


def _suffix_min(sizes: list[int], value: Mapping[int, float], floor: list[float], i: int) -> None:
    """Bring ``floor`` (``value``'s suffix minima over ``sizes``, one per size) up to date at
    indices ``i`` and below, where only the minima above ``i`` changed: the walk down stops at the
    first index that keeps its minimum (every one below it keeps its own)."""
    nxt = floor[i + 1] if i + 1 < len(floor) else math.inf
    for j in range(i, -1, -1):
        v = value[sizes[j]]
        if nxt < v:
            v = nxt
        if floor[j] == v:
            return
        floor[j] = nxt = v
