"""A bounded soak in the suite (about 25 s): robot sessions and text streams with faults against
a real server. The full run is ``chunkline bench soak`` (10 minutes by default)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from chunkline.bench.soak import FaultEvent, FaultPlan, SessionBook, SoakConfig, apply_fault, reconcile, run_soak, slope
from chunkline.client.wire.protocol import Chunk, Error

DOCUMENTED = frozenset({"invalid_message", "policy_failed", "cancelled", "duplicate_id", "overloaded"})


def _chunk(request_id: str, late: bool = False) -> Chunk:
    return Chunk(id=request_id, actions=np.zeros((2, 2), np.float32), t0=None, dt=0.02, expires=None, model="m",
                 fingerprint="f", late=late, timing={})


def test_books_count_each_answer_once() -> None:
    book = SessionBook("s", DOCUMENTED)
    book.on_sent("a", "normal", [frozenset({"chunk"})], 0.0)
    book.on_sent("b", "duplicate", [frozenset({"chunk"})], 0.0)
    book.on_sent("b", "duplicate", [frozenset({"chunk", "duplicate_id"})], 0.0)
    book.on_garbage_sent()
    book.on_answer(_chunk("a"))
    book.on_answer(Error(id="b", code="duplicate_id", message="in flight"))
    book.on_answer(Error(id=None, code="invalid_message", message="malformed"))
    assert not book.idle
    book.on_answer(_chunk("b", late=True))
    assert book.idle and not book.problems
    book.on_answer(_chunk("a"))  # a second answer for a request already answered
    book.on_answer(_chunk("zzz"))  # an answer for nothing ever sent
    book.on_answer(Error(id=None, code="made_up", message="?"))
    book.on_end(clean=True, close_code=1000)
    assert book.duplicated == 1 and book.lost == 0
    assert book.admitted == collections.Counter({"ok": 1, "late": 1})
    assert len(book.problems) == 3  # never sent, undocumented code, unexpected session error


def test_books_tell_lost_from_abandoned() -> None:
    lost = SessionBook("s1", DOCUMENTED)
    lost.on_sent(1, "normal", [frozenset({"chunk"})], 0.0)
    lost.on_end(clean=True, close_code=1000)  # the connection stayed up: no answer is a loss
    gone = SessionBook("s2", DOCUMENTED)
    gone.on_sent(1, "normal", [frozenset({"chunk"})], 0.0)
    gone.on_end(clean=False, close_code=1006)  # the client cut it: the answer may never come
    assert (lost.lost, lost.abandoned) == (1, 0) and (gone.lost, gone.abandoned) == (0, 1)
    assert gone.problems == ["session closed with 1006, expected [1000]"]


def test_reconcile_is_exact_where_it_can_be_and_bounded_where_not() -> None:
    clean = SessionBook("c", DOCUMENTED)
    clean.on_sent(1, "normal", [frozenset({"chunk"})], 0.0)
    clean.on_answer(_chunk(1))
    clean.on_end(True, 1000)
    cut = SessionBook("x", DOCUMENTED)
    cut.on_sent(1, "normal", [frozenset({"chunk"})], 0.0)
    cut.on_sent(2, "normal", [frozenset({"chunk"})], 0.0)
    cut.on_answer(_chunk(1))
    cut.on_end(False, 1006)
    good = reconcile([("c", "ok"), ("x", "ok"), ("x", "cancelled")], [clean, cut])
    assert (good.exact_sessions, good.abandoned_sessions, good.abandoned_admitted, good.mismatches) == (1, 1, 1, [])
    assert reconcile([("c", "ok"), ("c", "ok"), ("x", "ok")], [clean, cut]).mismatches  # a row too many
    assert reconcile([("x", "ok")], [clean, cut]).mismatches  # the clean session's row is missing
    assert reconcile([("c", "ok"), ("x", "ok"), ("x", "ok"), ("x", "ok")], [clean, cut]).mismatches  # > in flight
    assert reconcile([("c", "ok"), ("x", "ok"), ("zz", "ok")], [clean, cut]).phantom_rows == 1
    assert reconcile([("w", "ok"), ("c", "ok"), ("x", "ok")], [clean, cut], ignore=["w"]).mismatches == []


def test_fault_plan_is_seeded_and_covers_every_kind() -> None:
    plan = FaultPlan(60.0, seed=3, mean_gap_s=2.0)
    assert plan.events == FaultPlan(60.0, seed=3, mean_gap_s=2.0).events
    assert set(plan.counts()) == {"partition", "lossy", "cut"}
    assert all(a.end + 1.0 <= b.at for a, b in zip(plan.events, plan.events[1:], strict=False))  # never overlapping
    assert plan.starting(0.0, 60.0) == plan.events == sorted(plan.ending(0.0, 1e9), key=lambda e: e.at)
    first = plan.events[0]
    assert plan.starting(first.at, first.at + 1e-9) == [first] and plan.ending(first.at, first.end) == []


class _Proxy:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set(self, up: dict, down: dict) -> None:
        self.calls.append(("set", up, down))

    def outage(self, seconds: float, mode: str) -> None:
        self.calls.append(("outage", seconds, mode))


def test_faults_map_onto_the_proxy() -> None:
    proxy = _Proxy()
    lossy = FaultEvent(1.0, "lossy", 2.0, 0.02)
    apply_fault(proxy, lossy, True)
    apply_fault(proxy, lossy, False)
    apply_fault(proxy, FaultEvent(5.0, "partition", 0.5), True)
    apply_fault(proxy, FaultEvent(5.0, "partition", 0.5), False)  # an outage ends by itself
    apply_fault(proxy, FaultEvent(9.0, "cut", 0.2), True)
    assert proxy.calls[0][0] == "set" and proxy.calls[0][1]["delay_ms"] == pytest.approx(20.0)
    assert proxy.calls[0][1]["stall_rate_hz"] > 0 and proxy.calls[1] == ("set", {}, {})
    assert proxy.calls[2:] == [("outage", 0.5, "blackhole"), ("outage", 0.2, "reset")]


def test_slope() -> None:
    assert slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert slope([(0, 1.0)]) == 0.0 and slope([(1, 1.0), (1, 2.0)]) == 0.0


@pytest.mark.slow
def test_soak(tmp_path: Path) -> None:
    cfg = SoakConfig(duration_s=20.0, robots=6, rate_hz=12.0, seed=7, fault_gap_s=2.0)
    report = run_soak(cfg, log_path=tmp_path / "server.log")
    print(json.dumps(report.as_dict(), indent=1))  # the numbers, for `pytest -s`
    assert report.problems == []
    assert report.lost == 0 and report.duplicated == 0
    assert report.requests > 600 and report.chunks > 300 and report.refusals > 0
    # Every fault was injected: the scripted first actions, and every kind of network fault.
    assert set(cfg.first_actions) <= set(report.injected)
    if not report.notes:  # text streams beside the robots (when the server serves text)
        assert set(cfg.text_first_actions) <= set(report.injected)
        assert report.text_requests > 50 and report.tokens > 500 and report.outcomes.get("done", 0) > 50
    assert set(report.network_faults) == {"partition", "lossy", "cut"}
    assert report.proxy["resets"] >= 1 and report.proxy["connections"] >= 3
    assert {"1000", "1003", "1009", "1006"} <= set(report.close_codes)
    # The ledger agrees with the client: exactly for every session that ended with nothing in
    # flight; for the others, within the requests left in flight.
    assert report.ledger["mismatches"] == [] and report.ledger["phantom_rows"] == 0
    assert report.ledger["exact_sessions"] >= report.sessions // 2
    assert report.ledger["rows"] >= report.admitted
    # Flat: descriptors back to where they started, memory within a bound a per-request leak of
    # the 12 KiB observations (over 1000 requests) would exceed.
    assert report.fds_end == report.fds_start
    assert report.rss_mib_end - report.rss_mib_start < 12.0
    assert report.server_exit == 0
