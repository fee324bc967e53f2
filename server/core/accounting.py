"""Where every request class counts its outcomes: metrics, outcome counters, the ledger row.

The robot path (:meth:`ChunklineServer.record`) and the text class (:class:`TextService`) call
the same two methods, so a refusal, a drop, a deadline miss or an admitted request is counted by
one rule whatever its class: ``refused`` for requests turned away before admission (no ledger
row: they were never admitted), ``finished`` for admitted ones (exactly one ledger row each).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.ledger import Ledger, LedgerRow
from chunkline.server.core.metrics import UNKNOWN_MODEL, Metrics

__all__ = ["Accounting", "DROPPED_OUTCOMES", "MISSED_OUTCOMES"]

#: Outcomes of admitted requests that were dropped without an answer (counted as refusals too).
DROPPED_OUTCOMES = frozenset({ErrorCode.DEADLINE_EXCEEDED.value, ErrorCode.OVERLOADED.value, ErrorCode.SHUTTING_DOWN.value})
#: Outcomes of admitted requests that missed their deadline: answered late, or dropped or failed
#: once it passed.
MISSED_OUTCOMES = frozenset({"late", ErrorCode.DEADLINE_EXCEEDED.value})


class Accounting:
    """Counts outcomes into the metrics and the ledger, and keeps what a fleet controller reads.

    Args:
        metrics: the server's Prometheus metrics.
        ledger: the usage ledger, or ``None``.
    """

    def __init__(self, metrics: Metrics, ledger: Ledger | None) -> None:
        self.metrics = metrics
        self.ledger = ledger
        #: cumulative outcomes of every class (a fleet compares versions and load with them)
        self.outcomes: collections.Counter[str] = collections.Counter()
        #: recent queue waits in ms (taken by :meth:`take_queue_waits`)
        self._queue_ms: collections.deque[float] = collections.deque(maxlen=4096)

    def refused(self, cls: str, model: str, tenant: str, code: str, *, limit: str | None = None,
                timing_ms: Mapping[str, float] | None = None) -> None:
        """A request turned away before admission (no ledger row). An ``unknown_model`` refusal is
        counted under :data:`UNKNOWN_MODEL`, whatever model the caller resolved it to."""
        if code == ErrorCode.UNKNOWN_MODEL.value:
            model = UNKNOWN_MODEL
        self.metrics.observe_request(cls, model, tenant, code, timing_ms)
        self.metrics.observe_refusal(cls, model, code, limit)
        self.outcomes[code] += 1

    def finished(self, cls: str, model: str, tenant: str, outcome: str, timing_ms: Mapping[str, float],
                 *, session: str, request_id: str,
                 fingerprint: str | None = None, ts: float | None = None, chunks: int = 0,
                 tokens_in: int = 0, tokens_out: int = 0) -> None:
        """An admitted request ended (``ok``, ``late``, dropped, failed, cancelled): its metrics
        and its one ledger row, built here from ``request_id`` and the timings so that every
        class writes the same columns the same way."""
        self.metrics.observe_request(cls, model, tenant, outcome, timing_ms)
        self.outcomes[outcome] += 1
        queue_ms = timing_ms.get("queue_ms")
        if queue_ms is not None:
            self._queue_ms.append(queue_ms)
        if outcome in MISSED_OUTCOMES:
            self.metrics.observe_deadline_miss(cls, model)
        if outcome in DROPPED_OUTCOMES:
            self.metrics.observe_refusal(cls, model, outcome)
        if self.ledger is None:
            return
        batch_size = timing_ms.get("batch_size")
        self.ledger.record(LedgerRow(
            request_id=request_id, tenant=tenant, cls=cls, model=model, outcome=outcome,
            ts=time.time() if ts is None else ts, session=session, fingerprint=fingerprint or "",
            decode_ms=timing_ms.get("decode_ms"), queue_ms=timing_ms.get("queue_ms"), infer_ms=timing_ms.get("infer_ms"),
            encode_ms=timing_ms.get("encode_ms"), server_ms=timing_ms.get("server_ms"),
            batch_size=int(batch_size) if batch_size is not None else None, chunks=chunks,
            tokens_in=tokens_in, tokens_out=tokens_out,
        ))

    def take_queue_waits(self) -> list[float]:
        """The queue waits recorded since the last call (each reported once)."""
        waits = list(self._queue_ms)
        self._queue_ms.clear()
        return waits

    def snapshot(self) -> dict[str, Any]:
        """Cumulative outcomes and the recent queue waits (taken)."""
        return {"outcomes": dict(self.outcomes), "queue_ms": self.take_queue_waits()}
