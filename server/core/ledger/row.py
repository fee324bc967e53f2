"""One ledger row: an admitted request as recorded (ids, names, outcome, timings, units; no content)."""

from __future__ import annotations

import dataclasses

__all__ = ["COLUMNS", "LedgerRow"]

#: The ``requests`` table's columns, in the order of :meth:`LedgerRow.as_tuple`.
COLUMNS = (
    "request_id",
    "session",
    "tenant",
    "class",
    "model",
    "fingerprint",
    "outcome",
    "ts",
    "decode_ms",
    "queue_ms",
    "infer_ms",
    "encode_ms",
    "server_ms",
    "batch_size",
    "chunks",
    "tokens_in",
    "tokens_out",
)


@dataclasses.dataclass(frozen=True)
class LedgerRow:
    """One admitted request, as recorded (no content).

    Args:
        request_id: server-unique request id.
        tenant: tenant name.
        cls: request class (``policy``, ``text``).
        model: model name.
        outcome: ``ok`` or the error code it ended with (``deadline_exceeded``, ``cancelled``, ...).
        ts: when it was received, Unix time in seconds (wall clock, for ``--since``).
        session: session id.
        fingerprint: the model's fingerprint (which weights/backend answered).
        decode_ms, queue_ms, infer_ms, encode_ms, server_ms: timings, if it got that far.
        batch_size: the batch it ran in.
        chunks: action chunks returned (policy).
        tokens_in, tokens_out: prompt and generated tokens (text).
    """

    request_id: str
    tenant: str
    cls: str
    model: str
    outcome: str
    ts: float
    session: str = ""
    fingerprint: str = ""
    decode_ms: float | None = None
    queue_ms: float | None = None
    infer_ms: float | None = None
    encode_ms: float | None = None
    server_ms: float | None = None
    batch_size: int | None = None
    chunks: int = 0
    tokens_in: int = 0
    tokens_out: int = 0

    def as_tuple(self) -> tuple[object, ...]:
        """Values in column order."""
        return (
            str(self.request_id),
            self.session,
            self.tenant,
            self.cls,
            self.model,
            self.fingerprint,
            self.outcome,
            float(self.ts),
            self.decode_ms,
            self.queue_ms,
            self.infer_ms,
            self.encode_ms,
            self.server_ms,
            self.batch_size,
            int(self.chunks),
            int(self.tokens_in),
            int(self.tokens_out),
        )
