"""Where ledger rows go: the :class:`RowSink` protocol and the SQLite file (:class:`LedgerStore`,
and :class:`FleetLedgerStore`, one file for a fleet's replicas).

The file is in WAL mode with ``synchronous=NORMAL`` (a committed batch survives a process crash),
one ``INSERT`` transaction per batch, and triggers refusing ``UPDATE`` and ``DELETE``. Every write,
local or fleet, goes through the one transaction helper, :meth:`LedgerStore._transaction`.

The file is created readable by its owner only (mode 0600), and SQLite gives its ``-wal`` and
``-shm`` side files the database file's mode: the rows name tenants and their usage.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from chunkline.server.core.ledger.errors import LedgerError
from chunkline.server.core.ledger.row import COLUMNS, LedgerRow

__all__ = ["RowSink", "LedgerStore", "FleetLedgerStore"]

#: Owner read/write only, for the database file and (through SQLite) its side files.
_FILE_MODE = 0o600

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


class RowSink(Protocol):
    """Where a :class:`Ledger` writes its batches: the local :class:`LedgerStore`, or a fleet's
    shared ledger (``chunkline.server.cluster``). ``offset`` is the position of ``rows[0]`` in
    this ledger's stream of rows, so that a sink can ignore rows it already holds when a batch
    whose acknowledgement was lost is retried. A failed write raises :class:`LedgerError`."""

    def write(self, rows: Iterable[LedgerRow], offset: int | None = None) -> int: ...

    def close(self) -> None: ...


def _create_owner_only(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists (SQLite would create it 0644).

    SQLite makes an empty file its database, and creates the ``-wal`` and ``-shm`` side files
    with the database file's mode, so all three are owner-only. An existing file keeps its mode:
    that is the operator's choice.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    except FileExistsError:
        return
    except OSError as exc:
        raise LedgerError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, _FILE_MODE)  # exactly 0600 whatever the umask (a umask may also take bits away)
    finally:
        os.close(fd)


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
        _create_owner_only(self.path)
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
        self._insert = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"

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

