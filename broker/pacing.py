"""Load-aware pacing: whether the server is saturated, learned from its replies.

A pure object fed by the broker core (:mod:`.core`). A reply that waited in the server's queue
longer than its inference took (and than a control period), or a refusal (``deadline_unmeetable``, ``overloaded``,
``retry_after_ms``), says the server is saturated: the broker then keeps one request in flight and
asks only when the answer is worth the server's time (a chunk it will mostly run). Only a run of
replies that barely queued, each served alone with none left queued behind it (a reply batched
with others, or a ``backlog`` of others left waiting out its inference, shows the server shared
and busy: a fleet scheduler may serve a weighted robot alone and at once while the rest queue),
says it has room again (the hysteresis keeps a fleet that paced itself down from flooding the
server the moment its queue empties). Until the first reply the server counts as saturated (a
fleet that starts together finds it so); a first reply that queued behind no one and left no one
waiting, or says nothing, ends that at once. While paced, :func:`paced_ahead_s` says how far
before the plan runs dry the next request goes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..client.wire.protocol import MAX_DRY_IN_MS, MAX_URGENCY_ROWS, Urgency
from .latency import LatencyWindow

__all__ = ["LoadPacer", "SATURATION_CODES", "urgency_for", "paced_ahead_s"]

#: the first round trips, left out of the lead's median, and those measured after them before the
#: lead follows them (the first answers of a fleet that starts together queued behind all of it:
#: no guide to the round trip after, and a lead cut by them is a cycle the fleet keeps)
_LEAD_SAMPLES = 4

#: error codes that say the server had no room for the request
SATURATION_CODES = frozenset({"deadline_unmeetable", "overloaded", "quota_exceeded", "deadline_exceeded"})


@dataclasses.dataclass(slots=True)
class LoadPacer:
    """Saturated or not, from the replies' queueing time and the refusals.

    Args:
        enter_share: a reply whose queueing time is at least this share of its inference time
            says the server is saturated (it waited behind at least that much other work).
        leave_share: a reply queued less than this share of its inference time, in a batch of
            one, had room.
        leave_after: that many such replies in a row end the saturated regime.
        min_queue_s: queueing shorter than this (the robot's control period) never counts: a fast
            policy's queueing and inference are both a millisecond's noise.
    """

    min_queue_s: float = 0.0
    enter_share: float = 1.0
    leave_share: float = 0.25
    leave_after: int = 8
    saturated: bool = True
    _calm: int = 0
    _first: bool = True  # no reply yet: saturated by assumption, not by evidence

    def on_reply(self, timing: Mapping[str, float] | None) -> None:
        """A chunk arrived with the server's ``timing`` (``queue_ms``, ``batch_wait_ms``, ``infer_ms``,
        ``batch_size``, ``backlog``: the requests still queued when its batch started)."""
        first, self._first = self._first, False
        timing = timing or {}
        queued = float(timing.get("queue_ms", 0.0)) + float(timing.get("batch_wait_ms", 0.0))
        service = float(timing.get("infer_ms", 0.0))
        if not (queued == queued and service == service) or service <= 0.0:
            # NaN or no inference time says nothing: the assumption made before any reply ends.
            self.saturated = self.saturated and not first
            return
        batched = float(timing.get("batch_size", 1.0)) > 1.0
        # Others left waiting at least this batch's inference (and a control period) queue behind it.
        behind = float(timing.get("backlog", 0.0)) > 0.0 and service >= 1000.0 * self.min_queue_s
        if first and not behind and not (queued >= 1000.0 * self.min_queue_s and (queued >= self.enter_share * service
                                                                                  or batched)):
            self.saturated = False  # the first reply queued behind no one: the server has room
            return
        if queued >= self.enter_share * service and queued >= 1000.0 * self.min_queue_s:
            self.saturated = True
            self._calm = 0
        elif (queued < self.leave_share * service or queued < 250.0 * self.min_queue_s) and not batched and not behind:
            self._calm += 1
            if self._calm >= self.leave_after:
                self.saturated = False
        else:
            self._calm = 0

    def on_refusal(self, code: str | None, retry_after_s: float | None) -> None:
        """A request was refused: ``code`` and the server's retry hint."""
        first, self._first = self._first, False
        if code in SATURATION_CODES or retry_after_s is not None:
            self.saturated = True
            self._calm = 0
        elif first:
            self.saturated = False  # refused for another reason: nothing says the server is busy


def urgency_for(coverage: float | None, remaining: float, expected: float, period: float, holding: bool,
                frozen: int = 0) -> Urgency | None:
    """A request's scheduling key: when the plan runs dry (``remaining`` seconds), and the rows the
    answer will run: all a chunk covers after its ``frozen`` prefix rows when it will resume a hold,
    those left after the ``expected`` round trip otherwise. ``None`` before a chunk has told the
    ``coverage``."""
    if coverage is None:
        return None
    rows = coverage / period - frozen if holding else (coverage - expected) / period
    dry_in = min(max(0.0, remaining), MAX_DRY_IN_MS / 1000.0)
    # Built without validation: every value is within the model's bounds by construction.
    return Urgency.model_construct(dry_in_ms=dry_in * 1000.0, rows=max(1, min(MAX_URGENCY_ROWS, int(rows + 1e-9))),
                                   period_ms=period * 1000.0)


def paced_ahead_s(most_rows: int, coverage: float | None, latency: LatencyWindow, period: float) -> float:
    """While paced (``rtc``, hold-and-resume): how long before the plan runs dry the next request
    goes, as the plan's last rows frozen as its prefix: ``most_rows`` (``BrokerConfig.paced_lead_rows``)
    at most, fewer where that makes requests go out every two round trips.

    With ``k`` rows frozen, an answer landing ``r`` ticks (the median round trip) after its
    observation leaves the robot holding ``r - k`` ticks, then running the ``n - k`` rows of its
    chunk after them (``n``: the chunk's rows from its observation's tick, ``coverage / period``),
    the next request going out when ``k`` remain: a cycle of ``n + r - 2k`` ticks, two round trips
    for ``k = (n - r) / 2``. A chunk that barely outlasts the round trip is asked for at its last
    row: no row frozen for nothing and fewer requests on the shared server, whose round trip is
    then the others' (one row at least; ``most_rows`` until :data:`_LEAD_SAMPLES` round trips are
    measured after the first :data:`_LEAD_SAMPLES`, which its median leaves out)."""
    rows = most_rows
    median = latency.median_after(_LEAD_SAMPLES, _LEAD_SAMPLES) if rows > 1 else None
    if median is not None and coverage is not None:
        ticks = math.ceil(median / period - 1e-9)
        rows = min(rows, max(1, (round(coverage / period) - ticks) // 2))
    return rows * period
