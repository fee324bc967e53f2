"""The admission controller's queue structures: per (priority, tenant) flows in deadline order,
arrival-rate estimates, and the entries and batches it tracks (internal to the controller)."""

from __future__ import annotations

import enum
import math

from chunkline.server.core.admission.decisions import Request

__all__ = ["EPS", "QueueItem", "Flow", "TenantWorkRate", "EntryState", "Entry", "RunningBatch"]

# Tolerance for comparing predicted times with deadlines: a request admitted to finish exactly at
# its deadline is not dropped later for a rounding error.
EPS = 1e-9

# An item in a flow: sorted ascending by (-deadline, -seq), so the earliest deadline (and among
# equal deadlines the earliest arrival) is at the end, where list.pop() is O(1).
QueueItem = tuple[float, int, Request]


class Flow:
    __slots__ = ("priority", "tenant", "items", "work")

    def __init__(self, priority: int, tenant: str) -> None:
        self.priority = priority
        self.tenant = tenant
        self.items: list[QueueItem] = []
        self.work = 0.0

    def head(self) -> Request:
        return self.items[-1][2]

    def head_deadline(self) -> float:
        return -self.items[-1][0]


class TenantWorkRate:
    # An exponentially decayed count of admissions: ``items`` (and ``work``) per second over
    # about ``tau``. Until the flow is ``tau`` old the count covers less than a full window, so
    # it is scaled up (bias correction, as Adam does for its moments), at most tenfold.
    __slots__ = ("items", "work", "stamp", "first")

    def __init__(self, stamp: float) -> None:
        self.items = 0.0
        self.work = 0.0
        self.stamp = stamp
        self.first = stamp

    def _decayed(self, now: float, tau: float) -> tuple[float, float]:
        f = math.exp(-(now - self.stamp) / tau) if now > self.stamp else 1.0
        return self.items * f, self.work * f

    def now(self, now: float, tau: float) -> tuple[float, float]:
        items, work = self._decayed(now, tau)
        cover = max(0.1, -math.expm1(-(now - self.first) / tau)) if now > self.first else 0.1
        return items / cover, work / cover

    def add(self, now: float, tau: float, work: float) -> None:
        self.items, self.work = self._decayed(now, tau)
        self.items += 1.0 / tau
        self.work += work / tau
        if now > self.stamp:
            self.stamp = now


class EntryState(enum.Enum):
    QUEUED = 1
    RUNNING = 2


_QUEUED = EntryState.QUEUED  # (an enum member read through its class costs a metaclass lookup)


class Entry:
    # Its promised completion, while it is queued, is kept by the level's Promises (promises.py).
    __slots__ = ("request", "seq", "state", "batch", "cancelled")

    def __init__(self, request: Request, seq: int) -> None:
        self.request = request
        self.seq = seq
        self.state = _QUEUED
        self.batch = -1
        self.cancelled = False


class RunningBatch:
    __slots__ = ("start", "size", "predicted_end", "remaining")

    def __init__(self, start: float, size: int, predicted_end: float) -> None:
        self.start = start
        self.size = size
        self.predicted_end = predicted_end
        self.remaining = size
