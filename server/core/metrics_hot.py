"""Counters and histograms for the request path, kept off it: plain arithmetic now, Prometheus later.

A prometheus-client ``Counter`` or ``Histogram`` child takes a lock per observation and a
histogram walks its bucket bounds in Python; a request records six of them. Here each thread
records into its own :class:`HotShard` (a dict of plain lists: one count per bucket and a sum),
with no lock, since a shard has one writer. :class:`HotAccumulator` is a prometheus-client
collector: at scrape time it adds the shards up and yields ordinary metric families, so the
exposition is what a ``Counter`` or ``Histogram`` fed the same values would print (a property
test checks exactly that).

A scrape reads shards while their threads write: each cell (one label set) is copied whole
under the GIL, and a histogram's count is the sum of its buckets, so every family is
self-consistent; a scrape may miss observations made while it runs, which the next one shows.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = ["HotAccumulator", "HotFamily", "HotShard"]

#: How prometheus-client spells a bucket bound in ``le`` (``+Inf``, ``0.005``, ``1.0``): theirs, typed.
_le: Callable[[float], str] = floatToGoString


@dataclasses.dataclass(frozen=True, eq=False)
class HotFamily:
    """One counter or histogram family (``buckets`` is ``None`` for a counter).

    Args:
        name: the metric's name (a counter's with its ``_total``).
        documentation: its help text.
        labelnames: its label names, in order.
        buckets: a histogram's finite upper bounds, ascending (``+Inf`` is implied).
        accumulator: where its shards live.
    """

    name: str
    documentation: str
    labelnames: tuple[str, ...]
    buckets: tuple[float, ...] | None
    accumulator: HotAccumulator

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0) to the counter with these label values."""
        self.accumulator.shard().inc(self, labels, amount)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        """Record ``value`` in the histogram with these label values."""
        self.accumulator.shard().observe(self, labels, value)


class HotShard:
    """One thread's cells: ``(family, labels)`` to ``[count]`` (a counter) or to one count per
    bucket, ``+Inf`` last, then the sum (a histogram). Only its own thread writes to it."""

    __slots__ = ("cells",)

    def __init__(self) -> None:
        self.cells: dict[tuple[HotFamily, tuple[str, ...]], list[float]] = {}

    def inc(self, family: HotFamily, labels: tuple[str, ...], amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        key = (family, labels)
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = [0.0]
        cell[0] += amount

    def observe(self, family: HotFamily, labels: tuple[str, ...], value: float) -> None:
        buckets = family.buckets
        assert buckets is not None, "observe on a counter"
        key = (family, labels)
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = [0.0] * (len(buckets) + 2)
        # The first bound >= value is its bucket (Prometheus' ``le``). NaN fails every ``<=``: as
        # in prometheus-client it is counted in no bucket, only added to the sum.
        if value == value:
            cell[bisect_left(buckets, value)] += 1
        cell[-1] += value


class HotAccumulator:
    """The request path's counters and histograms: per-thread shards, folded at scrape time.

    Register it in a ``CollectorRegistry`` (it is a collector); make its families with
    :meth:`counter` and :meth:`histogram` before the first scrape.
    """

    def __init__(self) -> None:
        self._families: list[HotFamily] = []
        self._shards: list[HotShard] = []
        self._local = threading.local()
        self._lock = threading.Lock()  # taken once per thread (its first record) and per scrape

    def counter(self, name: str, documentation: str, labelnames: Sequence[str]) -> HotFamily:
        return self._add(HotFamily(name, documentation, tuple(labelnames), None, self))

    def histogram(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> HotFamily:
        bounds = tuple(float(b) for b in buckets if b != math.inf)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram buckets must be distinct and ascending")
        return self._add(HotFamily(name, documentation, tuple(labelnames), bounds, self))

    def _add(self, family: HotFamily) -> HotFamily:
        self._families.append(family)
        return family

    def shard(self) -> HotShard:
        """The calling thread's shard (made on its first record)."""
        try:
            shard: HotShard = self._local.shard
        except AttributeError:
            shard = self._local.shard = HotShard()
            with self._lock:
                self._shards.append(shard)
        return shard

    # ------------------------------------------------------------------ collector

    def describe(self) -> Iterator[Metric]:
        """The families, without samples (the registry checks names with this at registration)."""
        for family in self._families:
            yield self._empty(family)

    def _empty(self, family: HotFamily) -> Metric:
        if family.buckets is None:
            return CounterMetricFamily(family.name, family.documentation, labels=family.labelnames)
        return HistogramMetricFamily(family.name, family.documentation, labels=family.labelnames)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            shards = list(self._shards)
        totals: dict[tuple[HotFamily, tuple[str, ...]], list[float]] = {}
        for shard in shards:
            for key, cell in shard.cells.copy().items():  # copy(): atomic under the GIL
                values = list(cell)
                total = totals.get(key)
                if total is None:
                    totals[key] = values
                else:
                    for i, v in enumerate(values):
                        total[i] += v
        by_family: dict[HotFamily, list[tuple[tuple[str, ...], list[float]]]] = {f: [] for f in self._families}
        for (family, labels), values in totals.items():
            by_family[family].append((labels, values))
        for family, cells in by_family.items():
            metric = self._empty(family)
            for labels, values in cells:
                if family.buckets is None:
                    assert isinstance(metric, CounterMetricFamily)
                    metric.add_metric(list(labels), values[0])
                    continue
                assert isinstance(metric, HistogramMetricFamily)
                cumulative, running = [], 0.0
                for bound, count in zip((*family.buckets, math.inf), values[:-1], strict=True):
                    running += count
                    cumulative.append((_le(bound), running))
                metric.add_metric(list(labels), cumulative, values[-1])
            yield metric
