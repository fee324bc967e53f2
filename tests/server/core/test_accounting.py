"""One counting rule for every request class: refusals have no ledger row, admitted requests one."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from chunkline.server.core.accounting import Accounting
from chunkline.server.core.ledger import Ledger, summarize
from chunkline.server.core.metrics import Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = m.render(None)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def test_refusals_and_admitted_requests_are_counted_alike_for_every_class(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db")
    acc = Accounting(Metrics(), ledger)
    acc.refused("policy", "m", "acme", "deadline_unmeetable")
    acc.refused("text", "m", "acme", "quota_exceeded", limit="rate")
    acc.finished("policy", "m", "acme", "ok", {"queue_ms": 3.0, "batch_size": 2.0}, session="s", request_id="s:1", chunks=1)
    acc.finished("text", "m", "acme", "late", {"queue_ms": 5.0}, session="s", request_id="s:2", tokens_in=4, tokens_out=7)
    acc.finished("policy", "m", "acme", "deadline_exceeded", {}, session="s", request_id="s:3")
    assert ledger.flush(10)
    rows = {s.tenant: s for s in summarize(ledger.path)}
    assert rows["acme"].requests == 3  # admitted ones only, one row each, built by the one rule
    with sqlite3.connect(ledger.path) as db:
        got_rows = db.execute("SELECT request_id, class, batch_size, chunks, tokens_in, tokens_out FROM requests ORDER BY request_id").fetchall()
    assert got_rows == [("s:1", "policy", 2, 1, 0, 0), ("s:2", "text", None, 0, 4, 7), ("s:3", "policy", None, 0, 0, 0)]
    ledger.close()
    got = _samples(acc.metrics)
    assert got[("chunkline_refusals_total", (("class", "policy"), ("model", "m"), ("reason", "deadline_unmeetable")))] == 1
    assert got[("chunkline_refusals_total", (("class", "text"), ("model", "m"), ("reason", "quota_exceeded:rate")))] == 1
    # dropped after admission: a refusal and a deadline miss
    assert got[("chunkline_refusals_total", (("class", "policy"), ("model", "m"), ("reason", "deadline_exceeded")))] == 1
    assert got[("chunkline_deadline_misses_total", (("class", "policy"), ("model", "m")))] == 1
    assert got[("chunkline_deadline_misses_total", (("class", "text"), ("model", "m")))] == 1
    assert acc.outcomes == {"deadline_unmeetable": 1, "quota_exceeded": 1, "ok": 1, "late": 1, "deadline_exceeded": 1}
    assert acc.take_queue_waits() == [3.0, 5.0] and acc.take_queue_waits() == []
