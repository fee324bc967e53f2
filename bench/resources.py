"""CPU, memory and open descriptors of the server process, sampled by the benchmarks.

Two views of one process, both read through ``psutil`` (the ``bench`` extra):

* :class:`ProcessMonitor`: CPU and peak memory of a process and its children over a load step.
  Driven by the caller: call :meth:`ProcessMonitor.start`, :meth:`~ProcessMonitor.sample` now and
  then, and :meth:`~ProcessMonitor.stop`; the clock is injectable.
* :func:`read_process`: one :class:`ResourceSample` (resident memory, open descriptors) of one
  process, for a soak's memory and descriptor slopes.

Without psutil every figure is NaN (``read_process`` answers ``None``) and the reports say
``n/a``, so a benchmark never fails for want of it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ProcessMonitor", "ResourceUsage", "ResourceSample", "read_process"]

try:  # optional: the bench extra
    import psutil
except ImportError:  # pragma: no cover - exercised only where psutil is missing
    psutil = None


@dataclasses.dataclass(frozen=True)
class ResourceSample:
    """One process at one moment.

    Args:
        t: seconds from the start of the run.
        rss_bytes: resident memory.
        fds: open file descriptors.
    """

    t: float
    rss_bytes: int
    fds: int


def read_process(pid: int, t: float) -> ResourceSample | None:
    """Resident memory and open descriptors of ``pid`` (``None`` without psutil, or once it is gone).

    Args:
        pid: the process (its children are not counted).
        t: the sample's time, stored as is.
    """
    if psutil is None:
        return None
    try:
        proc = psutil.Process(pid)
        return ResourceSample(t, proc.memory_info().rss, proc.num_fds())
    except psutil.Error:
        return None


class ResourceUsage:
    """CPU and memory over an interval.

    Args:
        cpu_percent: CPU time over wall time, percent of one core (200 = two cores busy).
        rss_mb: the largest resident memory sampled, MiB.
    """

    __slots__ = ("cpu_percent", "rss_mb")

    def __init__(self, cpu_percent: float = math.nan, rss_mb: float = math.nan) -> None:
        self.cpu_percent = cpu_percent
        self.rss_mb = rss_mb

    def as_dict(self) -> dict[str, float]:
        return {"cpu_percent": self.cpu_percent, "rss_mb": self.rss_mb}


class ProcessMonitor:
    """Measures one process tree between :meth:`start` and :meth:`stop`.

    Args:
        pid: the process to watch (``None``: nothing to watch; every figure is NaN).
        clock: wall-clock seconds for the CPU-percent denominator.
    """

    def __init__(self, pid: int | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self._clock = clock
        self._proc: Any = None
        if pid is not None and psutil is not None:
            try:
                self._proc = psutil.Process(pid)
            except psutil.Error:
                self._proc = None
        self._cpu0 = math.nan
        self._t0 = math.nan
        self._rss_max = math.nan

    @property
    def available(self) -> bool:
        """Whether figures can be measured (psutil installed, process alive)."""
        return self._proc is not None

    def _tree(self) -> list[Any]:
        procs = [self._proc]
        try:
            procs += self._proc.children(recursive=True)
        except psutil.Error:
            pass
        return procs

    def _cpu_seconds(self) -> float:
        total = 0.0
        for p in self._tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue  # a child that just exited
        return total

    def start(self) -> None:
        """Begin an interval."""
        self._rss_max = math.nan
        if self._proc is None:
            return
        self._t0 = self._clock()
        self._cpu0 = self._cpu_seconds()
        self.sample()

    def sample(self) -> None:
        """Record the current resident memory (the interval keeps the largest)."""
        if self._proc is None:
            return
        rss = 0
        for p in self._tree():
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                continue
        mb = rss / (1024 * 1024)
        self._rss_max = mb if math.isnan(self._rss_max) else max(self._rss_max, mb)

    def stop(self) -> ResourceUsage:
        """End the interval: CPU percent over it and peak memory."""
        if self._proc is None or math.isnan(self._t0):
            return ResourceUsage()
        self.sample()
        wall = self._clock() - self._t0
        cpu = self._cpu_seconds() - self._cpu0
        return ResourceUsage(cpu_percent=100.0 * cpu / wall if wall > 0 else math.nan, rss_mb=self._rss_max)
