"""The server's ledger: non-blocking ``record``, one background writer thread, fail-closed health."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from chunkline.server.core.ledger.buffer import LedgerBuffer
from chunkline.server.core.ledger.errors import LedgerError
from chunkline.server.core.ledger.row import LedgerRow
from chunkline.server.core.ledger.store import LedgerStore, RowSink
from chunkline.server.core.ledger.summary import TenantSummary, summarize

__all__ = ["Ledger"]

log = logging.getLogger(__name__)


class Ledger:
    """The server's ledger: non-blocking ``record``, a background writer, fail-closed health.

    Args:
        path: the SQLite file.
        batch_size: rows per write (and the most a crash can lose).
        max_age_s: the longest a row waits before it is written (and the oldest a crash can lose).
        max_pending: most rows buffered while the disk is failing; beyond it rows are dropped and
            counted (the server refuses work long before, unless configured not to).
        busy_timeout_s: how long a write waits for another process's lock.
        max_bytes: largest the file may grow (see :class:`LedgerStore`).
        retry_s: first retry delay after a failed write (doubles up to 10 s).
        clock: monotonic time, for the age bound.
        on_write: called from the writer thread after each write attempt with ``(ok, rows)``
            (e.g. to update metrics at once); it must not block nor call :meth:`flush`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        batch_size: int = 256,
        max_age_s: float = 1.0,
        max_pending: int = 100_000,
        busy_timeout_s: float = 1.0,
        max_bytes: int | None = None,
        retry_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        on_write: Callable[[bool, int], None] | None = None,
        store_factory: Callable[[], RowSink] | None = None,
    ) -> None:
        self.path = Path(path)
        self._store_factory: Callable[[], RowSink] = store_factory or (
            lambda: LedgerStore(self.path, busy_timeout_s, max_bytes))
        self._on_write = on_write
        self._buffer = LedgerBuffer(batch_size, max_age_s, max_pending)
        self._clock = clock
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._recorded = 0  # rows accepted by record()
        self._written = 0  # rows committed (rows are written in order, so this is a prefix)
        self._attempts = 0  # write attempts finished (success or failure)
        self._flush_wanted = 0  # highest row count a flush() waits for
        self._closing = False
        self._dropped = 0
        self._healthy = True
        self._last_error: str | None = None
        self._store: RowSink | None = None
        try:
            self._store = self._store_factory()
        except LedgerError as exc:
            self._fail(str(exc))
        self._thread = threading.Thread(target=self._run, name="chunkline-ledger", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state

    @property
    def healthy(self) -> bool:
        """False after a failed write or open, until a write succeeds (the server refuses work meanwhile)."""
        return self._healthy

    @property
    def last_error(self) -> str | None:
        """Why the last write or open failed (``None`` once healthy again)."""
        return self._last_error

    @property
    def pending(self) -> int:
        """Rows recorded and not yet written."""
        return len(self._buffer)

    @property
    def written(self) -> int:
        """Rows written since start."""
        return self._written

    @property
    def dropped(self) -> int:
        """Rows refused because the buffer was full (only while unhealthy and serving anyway)."""
        return self._dropped

    def _fail(self, message: str) -> None:
        if self._healthy or message != self._last_error:
            log.error("usage ledger unhealthy: %s", message)
        self._healthy = False
        self._last_error = message

    # ------------------------------------------------------------------ API

    def record(self, row: LedgerRow) -> bool:
        """Queue ``row`` for writing; never blocks on the disk, never raises.

        Returns:
            ``False`` if the row could not be kept (buffer full, or the ledger is closed).
        """
        with self._cond:
            if self._closing or not self._buffer.add(row, self._clock()):
                self._dropped += 1
                return False
            self._recorded += 1
            if self._buffer.due(self._clock()) or len(self._buffer) == 1:
                self._cond.notify_all()  # due now, or the age timer must start
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Write every row recorded so far; wait until done.

        Args:
            timeout: most seconds to wait (``None``: until written or a write fails).

        Returns:
            ``True`` if every row recorded before the call is on disk; ``False`` if a write
            failed (rows are kept and retried) or the timeout passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._recorded
            if self._written >= target:
                return True
            self._flush_wanted = max(self._flush_wanted, target)
            attempts = self._attempts
            self._cond.notify_all()
            while self._written < target:
                if not self._thread.is_alive():
                    return False
                # one failed attempt after this flush began is the answer: the disk says no
                if self._attempts > attempts and not self._healthy:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Flush and stop the writer. Later :meth:`record` calls are refused.

        Returns:
            ``True`` if every recorded row was written.
        """
        ok = self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._store is not None:
            self._store.close()
        lost = len(self._buffer)
        if lost:
            log.error("usage ledger closed with %d rows unwritten: %s", lost, self._last_error)
        return ok and lost == 0

    def summary(self, since: float | None = None) -> list[TenantSummary]:
        """Usage per tenant since ``since`` (Unix time), from the file (call :meth:`flush` first
        to include the latest rows)."""
        return summarize(self.path, since)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        retry = self._retry_s
        next_try = 0.0
        with self._cond:
            while True:
                now = self._clock()
                flush = self._flush_wanted > self._written
                if self._closing:
                    return
                want = flush or self._buffer.due(now)
                if want and (flush or now >= next_try):
                    batch = self._buffer.take()
                    self._cond.release()
                    try:
                        error = self._write([r for _, r in batch])
                    finally:
                        self._cond.acquire()
                    self._attempts += 1
                    if error is None:
                        self._written += len(batch)
                        self._healthy = True
                        self._last_error = None
                        retry = self._retry_s
                    else:
                        self._buffer.put_back(batch)
                        self._fail(error)
                        next_try = self._clock() + retry
                        retry = min(retry * 2, 10.0)
                        # a waiting flush() learns of the failure; it will not re-ask this round
                        self._flush_wanted = min(self._flush_wanted, self._written)
                    self._cond.notify_all()
                    if self._on_write is not None:
                        self._cond.release()
                        try:
                            self._on_write(error is None, len(batch))
                        except Exception:  # a faulty hook must not stop the ledger
                            log.exception("ledger on_write hook failed")
                        finally:
                            self._cond.acquire()
                    continue
                if want:
                    timeout: float | None = max(0.0, next_try - now)
                else:
                    due = self._buffer.due_at()
                    timeout = None if due is None else max(0.0, due - now)
                self._cond.wait(timeout)

    def _write(self, rows: list[LedgerRow]) -> str | None:
        if self._store is None:
            try:
                self._store = self._store_factory()
            except LedgerError as exc:
                return str(exc)
        try:
            # Rows are written in order, so ``_written`` is this batch's offset in the stream: a
            # remote sink uses it to make a retried batch idempotent.
            self._store.write(rows, offset=self._written)
        except LedgerError as exc:
            return str(exc)
        return None
