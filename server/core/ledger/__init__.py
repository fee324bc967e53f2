"""The usage ledger: an unsampled, append-only record of every admitted request, in SQLite (WAL).

Three layers, so that the rules are testable without threads or timing (plus the row type,
``row``, and the summary queries, ``summary``):

* :class:`LedgerBuffer` (``buffer``, sans-I/O): rows waiting to be written, and when a batch is due
  (``batch_size`` rows, or the oldest row ``max_age_s`` old, on an injected clock). The two bounds
  are what a crash can lose: at most one batch, at most ``max_age_s`` old.
* :class:`LedgerStore` (``store``): the SQLite file (WAL mode, ``synchronous=NORMAL``: a
  committed batch survives a process crash, mode 0600), one ``INSERT`` transaction per batch,
  triggers refusing ``UPDATE`` and ``DELETE``; :class:`FleetLedgerStore` writes a fleet's rows
  exactly once through the same transaction.
* :class:`Ledger` (``writer``): the shell the server uses. ``record(row)`` only appends to the buffer under a
  lock (never blocks on disk, never raises); one background thread writes due batches;
  ``flush()`` waits for everything recorded so far; ``close()`` flushes and stops.

Fail closed: when a write fails (disk full, database locked, folder gone) the batch is kept and
retried with backoff, :attr:`Ledger.healthy` turns false and :attr:`Ledger.last_error` says why;
the server then reports not-ready on ``/readyz``, sets ``chunkline_ledger_healthy`` to 0 and, by
default, refuses new work until a write succeeds again. If the buffer reaches ``max_pending`` rows
(only possible when the server is configured to keep serving unrecorded), further rows are
counted in :attr:`Ledger.dropped` rather than growing memory without bound.

Rows hold ids, names, outcome, timings and units, never observation or prompt content.
``chunkline ledger summary --since ...`` reads the file with :func:`summarize` (WAL allows reading
while the server writes).
"""

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
