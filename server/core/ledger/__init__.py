"""The usage ledger: an unsampled, append-only record of every admitted request, in SQLite (WAL).

- :class:`LedgerBuffer` (sans-I/O): rows waiting to be written and when a batch is due (``batch_size``
  rows or the oldest ``max_age_s`` old, on an injected clock): a crash loses at most one batch.
- :class:`LedgerStore`: one ``INSERT`` transaction per batch, triggers refusing ``UPDATE``/``DELETE``,
  file mode 0600; :class:`FleetLedgerStore` writes a fleet's rows exactly once.
- :class:`Ledger`: the server's shell; ``record`` only appends under a lock (never blocks, never
  raises), one thread writes due batches.
Fail closed: a failed write is kept and retried with backoff, ``healthy`` turns false and the server
turns not-ready and, by default, refuses new work until a write succeeds; past ``max_pending`` rows
(only when configured to serve unrecorded) rows are counted in ``dropped``, not kept. Rows hold ids,
names, outcome, timings and units, never observation or prompt content."""

from __future__ import annotations

from chunkline.server.core.ledger.buffer import LedgerBuffer
from chunkline.server.core.ledger.errors import LedgerError
from chunkline.server.core.ledger.row import LedgerRow
from chunkline.server.core.ledger.store import FleetLedgerStore, LedgerStore, RowSink
from chunkline.server.core.ledger.summary import TenantSummary, summarize
from chunkline.server.core.ledger.writer import Ledger

__all__ = [
    "LedgerError",
    "LedgerRow",
    "LedgerBuffer",
    "LedgerStore",
    "FleetLedgerStore",
    "RowSink",
    "Ledger",
    "TenantSummary",
    "summarize",
]
