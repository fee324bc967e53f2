"""The usage ledger: an unsampled, append-only record of every admitted request, in SQLite (WAL).

Three layers, so that the rules are testable without threads or timing:

* :class:`LedgerBuffer` (sans-I/O): rows waiting to be written, and when a batch is due
  (``batch_size`` rows, or the oldest row ``max_age_s`` old, on an injected clock). The two bounds
  are what a crash can lose: at most one batch, at most ``max_age_s`` old.
* :class:`LedgerStore`: the SQLite file (WAL mode, ``synchronous=NORMAL``: a committed batch
  survives a process crash), one ``INSERT`` transaction per batch, triggers refusing ``UPDATE``
  and ``DELETE``.
* :class:`Ledger`: the shell the server uses. ``record(row)`` only appends to the buffer under a
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

import collections
import contextlib
import dataclasses
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

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

log = logging.getLogger(__name__)

_COLUMNS = (
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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id  TEXT    NOT NULL,
    session     TEXT    NOT NULL,
    tenant      TEXT    NOT NULL,
    class       TEXT    NOT NULL,
    model       TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    outcome     TEXT    NOT NULL,
    ts          REAL    NOT NULL,
    decode_ms   REAL,
    queue_ms    REAL,
    infer_ms    REAL,
    encode_ms   REAL,
    server_ms   REAL,
    batch_size  INTEGER,
    chunks      INTEGER NOT NULL DEFAULT 0,
    tokens_in   INTEGER NOT NULL DEFAULT 0,
    tokens_out  INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TRIGGER IF NOT EXISTS requests_no_update BEFORE UPDATE ON requests
    BEGIN SELECT RAISE(ABORT, 'the usage ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS requests_no_delete BEFORE DELETE ON requests
    BEGIN SELECT RAISE(ABORT, 'the usage ledger is append-only'); END;
"""


class LedgerError(Exception):
    """The ledger file cannot be opened, written or read."""


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


class RowSink(Protocol):
    """Where a :class:`Ledger` writes its batches: the local :class:`LedgerStore`, or a fleet's
    shared ledger (``chunkline.server.cluster``). ``offset`` is the position of ``rows[0]`` in
    this ledger's stream of rows, so that a sink can ignore rows it already holds when a batch
    whose acknowledgement was lost is retried. A failed write raises :class:`LedgerError`."""

    def write(self, rows: Iterable[LedgerRow], offset: int | None = None) -> int: ...

    def close(self) -> None: ...


class LedgerStore:
    """The SQLite ledger file.

    Args:
        path: the database file (created with its table if missing).
        busy_timeout_s: how long a write waits for a lock held by another process before failing.
        max_bytes: largest the file may grow (SQLite ``max_page_count``); beyond it writes fail
            as if the disk were full. ``None``: no limit.
    """

    def __init__(self, path: str | os.PathLike[str], busy_timeout_s: float = 1.0, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        try:
            # check_same_thread=False: the Ledger opens it in the server thread (to report a bad
            # path at once) and then uses it only from its writer thread.
            self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open {self.path}: {exc}") from None
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise LedgerError(f"{self.path}: cannot switch to WAL mode (got {mode})")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
            if max_bytes is not None:
                page = self._conn.execute("PRAGMA page_size").fetchone()[0]
                self._conn.execute(f"PRAGMA max_page_count={max(1, int(max_bytes) // int(page))}")
        except sqlite3.Error as exc:
            self._conn.close()
            raise LedgerError(f"cannot initialise {self.path}: {exc}") from None
        except LedgerError:
            self._conn.close()
            raise
        self._insert = f"INSERT INTO requests ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"

    def write(self, rows: Iterable[LedgerRow], offset: int | None = None) -> int:
        """Insert ``rows`` in one transaction; return how many (``offset`` is unused here).

        Raises:
            LedgerError: nothing was written (the transaction was rolled back).
        """
        values = [r.as_tuple() for r in rows]
        with self._transaction():
            self._conn.executemany(self._insert, values)
        return len(values)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction: committed whole, or rolled back and reported as :class:`LedgerError`."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot write {self.path}: {exc}") from None

    def close(self) -> None:
        """Close the file (checkpointing the WAL)."""
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()


@dataclasses.dataclass(frozen=True)
class TenantSummary:
    """A tenant's usage over a period.

    Args:
        tenant: its name.
        requests: admitted requests.
        outcomes: outcome to count.
        chunks: action chunks returned.
        tokens_in, tokens_out: text tokens.
        infer_s: total inference time of its requests (their batches' time, each counted once
            per request).
        mean_server_ms: mean server latency of requests that have one.
    """

    tenant: str
    requests: int
    outcomes: dict[str, int]
    chunks: int
    tokens_in: int
    tokens_out: int
    infer_s: float
    mean_server_ms: float | None


def summarize(path: str | os.PathLike[str], since: float | None = None, until: float | None = None) -> list[TenantSummary]:
    """Usage per tenant from a ledger file, in tenant order.

    Args:
        path: the ledger database.
        since: only requests received at or after this Unix time.
        until: only requests received before this Unix time.

    Raises:
        LedgerError: the file is missing or unreadable.
    """
    p = Path(path)
    if not p.exists():
        raise LedgerError(f"no ledger at {p}")
    where = "WHERE ts >= ? AND ts < ?"
    args = (-math.inf if since is None else float(since), math.inf if until is None else float(until))
    try:
        conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=5.0)
        try:
            totals = conn.execute(
                f"SELECT tenant, COUNT(*), SUM(chunks), SUM(tokens_in), SUM(tokens_out), "
                f"TOTAL(infer_ms), AVG(server_ms) FROM requests {where} GROUP BY tenant ORDER BY tenant",
                args,
            ).fetchall()
            outcomes: dict[str, dict[str, int]] = collections.defaultdict(dict)
            for tenant, outcome, n in conn.execute(
                f"SELECT tenant, outcome, COUNT(*) FROM requests {where} GROUP BY tenant, outcome", args
            ):
                outcomes[tenant][outcome] = n
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot read {p}: {exc}") from None
    return [
        TenantSummary(
            tenant=t,
            requests=int(n),
            outcomes=dict(sorted(outcomes[t].items())),
            chunks=int(ch or 0),
            tokens_in=int(ti or 0),
            tokens_out=int(to or 0),
            infer_s=float(inf_ms or 0.0) / 1000.0,
            mean_server_ms=None if srv is None else float(srv),
        )
        for t, n, ch, ti, to, inf_ms, srv in totals
    ]


class FleetLedgerStore(LedgerStore):
    """One ledger file for a fleet of replicas, written through :meth:`write_from`.

    Each replica's :class:`Ledger` sends its batches with their offset in that replica's row
    stream. The file keeps, in the same transaction as the rows, how many rows of each source it
    holds, so a batch retried after a lost acknowledgement (or re-sent with more rows appended)
    inserts only the rows it does not have yet: exactly once, across restarts of the writer too.
    """

    def __init__(self, path: str | os.PathLike[str], busy_timeout_s: float = 1.0, max_bytes: int | None = None) -> None:
        super().__init__(path, busy_timeout_s, max_bytes)
        try:
            self._conn.execute("CREATE TABLE IF NOT EXISTS sources (source TEXT PRIMARY KEY, rows INTEGER NOT NULL)")
        except sqlite3.Error as exc:
            self._conn.close()
            raise LedgerError(f"cannot initialise {self.path}: {exc}") from None

    def write_from(self, source: str, offset: int, rows: Sequence[LedgerRow]) -> int:
        """Append the rows of ``source`` from position ``offset`` on that it does not hold yet.

        Returns:
            how many rows were inserted.

        Raises:
            LedgerError: nothing was written; or ``offset`` is past what the file holds for
                ``source`` (rows would be missing in between).
        """
        with self._transaction():
            got = self._conn.execute("SELECT rows FROM sources WHERE source = ?", (source,)).fetchone()
            held = int(got[0]) if got else 0
            if offset > held:
                raise LedgerError(f"{source}: rows {held}..{offset} never arrived")
            fresh = [r.as_tuple() for r in rows[held - offset:]]
            self._conn.executemany(self._insert, fresh)
            self._conn.execute("INSERT INTO sources (source, rows) VALUES (?, ?) ON CONFLICT(source) DO UPDATE SET rows = excluded.rows",
                               (source, max(held, offset + len(rows))))
        return len(fresh)


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
