"""Rows waiting for the disk, and when a batch is due: the ledger's rules without threads or timing.

A batch is due at ``batch_size`` rows, or once the oldest row is ``max_age_s`` old on an injected
clock. The two bounds are what a crash can lose: at most one batch, at most ``max_age_s`` old.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from chunkline.server.core.ledger.row import LedgerRow

__all__ = ["LedgerBuffer"]


class LedgerBuffer:
    """Rows waiting for the disk, and when the next batch is due (sans-I/O).

    Args:
        batch_size: a batch is due once this many rows wait.
        max_age_s: a batch is due once the oldest waiting row is this old.
        max_pending: most rows held; more are refused (and counted by the caller).
    """

    def __init__(self, batch_size: int = 256, max_age_s: float = 1.0, max_pending: int = 100_000) -> None:
        if batch_size < 1 or max_age_s <= 0 or max_pending < batch_size:
            raise ValueError("need batch_size >= 1, max_age_s > 0, max_pending >= batch_size")
        self.batch_size = batch_size
        self.max_age_s = max_age_s
        self.max_pending = max_pending
        self._rows: collections.deque[tuple[float, LedgerRow]] = collections.deque()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, row: LedgerRow, now: float) -> bool:
        """Append ``row`` recorded at ``now``; ``False`` if the buffer is full (row not kept)."""
        if len(self._rows) >= self.max_pending:
            return False
        self._rows.append((now, row))
        return True

    def due_at(self) -> float | None:
        """When the age bound makes a batch due (``None``: nothing waits)."""
        return self._rows[0][0] + self.max_age_s if self._rows else None

    def due(self, now: float) -> bool:
        """Whether a batch should be written now (size or age bound reached)."""
        if not self._rows:
            return False
        return len(self._rows) >= self.batch_size or now >= self._rows[0][0] + self.max_age_s

    def take(self) -> list[tuple[float, LedgerRow]]:
        """Remove and return the oldest batch (at most ``batch_size`` rows)."""
        n = min(self.batch_size, len(self._rows))
        return [self._rows.popleft() for _ in range(n)]

    def put_back(self, batch: Sequence[tuple[float, LedgerRow]]) -> None:
        """Return a batch that failed to write, at the front, in order (may exceed ``max_pending``
        by that one batch: rows already accepted are never thrown away here)."""
        self._rows.extendleft(reversed(batch))
