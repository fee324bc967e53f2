"""Usage ledger: batch bounds (sans-I/O buffer), SQLite WAL store, fail-closed health, summaries, CLI."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.config import ServerConfig
from chunkline.server.core.ledger import FleetLedgerStore, Ledger, LedgerBuffer, LedgerError, LedgerRow, LedgerStore, summarize
from chunkline.server.entrypoints.cli import main
from chunkline.server.entrypoints.keys_cli import parse_since


def row(i: int, tenant: str = "acme", outcome: str = "ok", ts: float = 1000.0, **kw: object) -> LedgerRow:
    return LedgerRow(request_id=f"r{i}", tenant=tenant, cls="policy", model="pi0", outcome=outcome, ts=ts, **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- buffer (sans-I/O)


def test_buffer_is_due_on_size_or_age() -> None:
    b = LedgerBuffer(batch_size=3, max_age_s=2.0, max_pending=5)
    assert not b.due(0.0) and b.due_at() is None
    b.add(row(0), 10.0)
    b.add(row(1), 10.5)
    assert not b.due(11.9) and b.due_at() == 12.0
    assert b.due(12.0)  # the oldest row is max_age_s old
    b.add(row(2), 11.0)
    assert b.due(11.0)  # batch_size rows wait
    batch = b.take()
    assert [r.request_id for _, r in batch] == ["r0", "r1", "r2"] and len(b) == 0
    for i in range(5):
        assert b.add(row(i), 20.0)
    assert not b.add(row(9), 20.0)  # full: refused, not grown
    first = b.take()
    b.put_back(first)
    assert [r.request_id for _, r in b.take()] == ["r0", "r1", "r2"]
    with pytest.raises(ValueError):
        LedgerBuffer(batch_size=10, max_pending=5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.floats(0.01, 5.0), st.lists(st.floats(0.0, 3.0), max_size=60))
def test_a_writer_that_writes_when_due_never_holds_more_than_the_bounds(batch_size: int, max_age: float, gaps: list[float]) -> None:
    """What a crash can lose: fewer than batch_size rows, none older than max_age."""
    b = LedgerBuffer(batch_size=batch_size, max_age_s=max_age, max_pending=1000)
    now = 0.0
    for i, gap in enumerate(gaps):
        now += gap
        # the writer wakes at due_at (age) and on every add (size)
        while b.due_at() is not None and b.due_at() <= now:  # type: ignore[operator]
            b.take()
        b.add(row(i), now)
        while b.due(now):
            b.take()
        assert len(b) < batch_size
        assert b.due_at() is None or b.due_at() > now  # type: ignore[operator]


# ----------------------------------------------------------------------------- store


def test_store_uses_wal_and_is_append_only(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    store = LedgerStore(db)
    assert store.write([row(i) for i in range(3)]) == 3
    store.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 3
    for stmt in ("UPDATE requests SET outcome = 'x'", "DELETE FROM requests"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute(stmt)
    conn.close()


def test_store_in_unwritable_place_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LedgerError):
        LedgerStore(blocker / "ledger.db")


def test_summary_per_tenant(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    store = LedgerStore(db)
    store.write(
        [
            row(1, "acme", ts=100.0, chunks=1, infer_ms=10.0, server_ms=20.0),
            row(2, "acme", ts=200.0, chunks=1, infer_ms=30.0, server_ms=40.0),
            row(3, "acme", outcome="deadline_exceeded", ts=300.0),
            LedgerRow("r4", "lab", "text", "llm", "ok", 250.0, tokens_in=12, tokens_out=30, infer_ms=500.0),
            row(5, "old", ts=50.0, chunks=1),
        ]
    )
    store.close()
    by = {s.tenant: s for s in summarize(db, since=100.0)}
    assert set(by) == {"acme", "lab"}
    acme = by["acme"]
    assert acme.requests == 3 and acme.outcomes == {"deadline_exceeded": 1, "ok": 2}
    assert acme.chunks == 2 and acme.infer_s == pytest.approx(0.04) and acme.mean_server_ms == pytest.approx(30.0)
    lab = by["lab"]
    assert (lab.tokens_in, lab.tokens_out, lab.chunks, lab.mean_server_ms) == (12, 30, 0, None)
    assert [s.tenant for s in summarize(db)] == ["acme", "lab", "old"]
    assert [s.requests for s in summarize(db, since=0, until=150.0)] == [1, 1]
    with pytest.raises(LedgerError):
        summarize(tmp_path / "missing.db")


# ----------------------------------------------------------------------------- ledger (thread shell)


def test_record_flush_summary_close(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.db", batch_size=4, max_age_s=60.0)
    assert led.healthy
    for i in range(10):
        assert led.record(row(i, "acme" if i % 2 else "lab", chunks=1))
    assert led.flush(timeout=30)
    assert led.written == 10 and led.pending == 0
    assert {s.tenant: s.requests for s in led.summary()} == {"acme": 5, "lab": 5}
    led.record(row(10))
    assert led.close()
    assert not led.record(row(11))  # closed
    assert sum(s.requests for s in summarize(tmp_path / "ledger.db")) == 11


def test_a_full_batch_is_written_without_a_flush(tmp_path: Path) -> None:
    done = threading.Event()
    seen: list[tuple[bool, int]] = []

    def hook(ok: bool, n: int) -> None:
        seen.append((ok, n))
        done.set()

    led = Ledger(tmp_path / "ledger.db", batch_size=3, max_age_s=3600.0, on_write=hook)
    for i in range(3):
        led.record(row(i))
    assert done.wait(30)
    assert seen == [(True, 3)] and led.written == 3
    led.close()


def test_unwritable_folder_is_unhealthy_from_the_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    led = Ledger(blocker / "ledger.db", retry_s=3600.0)
    assert not led.healthy and led.last_error and "cannot open" in led.last_error
    assert led.record(row(1))  # kept in memory, not lost
    assert not led.flush(timeout=30)
    assert led.pending == 1 and not led.healthy
    assert not led.close(timeout=30)


def test_locked_database_flips_health_and_recovers_without_loss(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    led = Ledger(db, batch_size=100, max_age_s=3600.0, busy_timeout_s=0.05, retry_s=3600.0)
    led.record(row(0))
    assert led.flush(timeout=30) and led.healthy
    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    for i in range(1, 4):
        led.record(row(i))
    assert not led.flush(timeout=30)
    assert not led.healthy and "locked" in (led.last_error or "")
    assert led.pending == 3
    locker.execute("ROLLBACK")
    locker.close()
    assert led.flush(timeout=30)  # a flush retries at once, whatever the backoff
    assert led.healthy and led.last_error is None
    assert led.close()
    ids = [r[0] for r in sqlite3.connect(db).execute("SELECT request_id FROM requests ORDER BY rowid")]
    assert ids == ["r0", "r1", "r2", "r3"]  # each row exactly once, in order


def test_full_disk_fails_closed_and_bounds_memory(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.db", batch_size=50, max_pending=50, max_age_s=3600.0, max_bytes=64 * 1024, retry_s=3600.0)
    i = 0
    while led.healthy and i < 20_000:
        for _ in range(50):
            led.record(row(i, fingerprint="f" * 200))
            i += 1
        led.flush(timeout=30)
    assert not led.healthy and "full" in (led.last_error or "")
    # the failed batch is kept; beyond max_pending new rows are refused and counted
    assert led.pending == 50
    assert not led.record(row(i))
    assert led.dropped == 1
    assert not led.close(timeout=30)


# ----------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("store_type", [LedgerStore, FleetLedgerStore])
def test_ledger_files_are_owner_only_whatever_the_umask(tmp_path: Path, store_type: type[LedgerStore]) -> None:
    db = tmp_path / "ledger.db"
    old = os.umask(0)  # SQLite alone would create the file 0644 (0666 under this umask)
    try:
        store = store_type(db)
        store.write([row(i) for i in range(3)])
        side_files = [tmp_path / "ledger.db-wal", tmp_path / "ledger.db-shm"]
        assert all(p.exists() for p in side_files)  # WAL mode, connection open: both are there
        for p in [db, *side_files]:
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
        store.close()
    finally:
        os.umask(old)


def test_an_existing_ledger_file_keeps_its_mode(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    LedgerStore(db).close()
    os.chmod(db, 0o640)  # the operator's choice, e.g. for a reporting group
    LedgerStore(db).close()
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o640


def _cli(argv: list[str]) -> int:
    return main(argv)


def test_ledger_summary_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "ledger.db"
    store = LedgerStore(db)
    store.write([row(1, ts=1_000_000.0, chunks=1), row(2, ts=2_000_000.0, chunks=1), row(3, "lab", ts=2_000_000.0, outcome="cancelled")])
    store.close()
    assert _cli(["ledger", "summary", "--db", str(db), "--since", "1970-01-20T00:00:00Z", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(t["tenant"], t["requests"], t["chunks"]) for t in out["tenants"]] == [("acme", 1, 1), ("lab", 1, 0)]
    assert _cli(["ledger", "summary", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert "acme" in text and "cancelled=1" in text
    assert _cli(["ledger", "summary", "--db", str(db), "--since", "yesterday-ish"]) == 2
    assert _cli(["ledger", "summary", "--db", str(tmp_path / "none.db")]) == 2


def test_ledger_summary_reads_where_serve_writes_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` run in a directory writes ./chunkline-ledger.db; `ledger summary` there needs no --db."""
    monkeypatch.chdir(tmp_path)
    store = LedgerStore(ServerConfig(no_auth=True).ledger)
    store.write([row(1, ts=1_000_000.0, chunks=1)])
    store.close()
    assert (tmp_path / "chunkline-ledger.db").exists()
    assert _cli(["ledger", "summary", "--json"]) == 0
    assert [t["tenant"] for t in json.loads(capsys.readouterr().out)["tenants"]] == ["acme"]


def test_parse_since() -> None:
    assert parse_since("24h", now=100_000.0) == 100_000.0 - 86_400
    assert parse_since("90s", now=100.0) == 10.0
    assert parse_since("2w", now=2e6) == 2e6 - 14 * 86400
    assert parse_since("1970-01-02") == 86_400.0
    assert parse_since("1970-01-01T01:00:00+01:00") == 0.0
    with pytest.raises(ValueError):
        parse_since("soon")


def test_fleet_ledger_writes_a_retried_or_extended_batch_exactly_once(tmp_path) -> None:
    def row(n: int) -> LedgerRow:
        return LedgerRow(request_id=f"s:{n}", tenant="acme", cls="policy", model="m", outcome="ok", ts=1.0, session="s",
                         fingerprint="f")

    store = FleetLedgerStore(tmp_path / "fleet.db")
    assert store.write_from("r1/a", 0, [row(0), row(1)]) == 2
    assert store.write_from("r1/a", 0, [row(0), row(1), row(2)]) == 1  # retried with one more row appended
    assert store.write_from("r2/b", 0, [row(0)]) == 1  # another replica's stream
    with pytest.raises(LedgerError):
        store.write_from("r1/a", 5, [row(5)])  # rows 3..5 never arrived
    store.close()
    store = FleetLedgerStore(tmp_path / "fleet.db")  # the manager restarted: still exactly once
    assert store.write_from("r1/a", 2, [row(2), row(3)]) == 1
    store.close()
    con = sqlite3.connect(tmp_path / "fleet.db")
    assert con.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 5
