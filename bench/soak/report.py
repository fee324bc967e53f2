"""What a soak run found, and the judgement of it."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from chunkline.bench.resources import ResourceSample
from chunkline.bench.stats import slope

from .books import ADMITTED_ERRORS, Reconciliation, SessionBook
from .config import SoakConfig

__all__ = ["SoakReport", "log_problems"]


@dataclasses.dataclass
class SoakReport:
    """What a soak run found (see the module docstring). ``problems`` empty means it passed.

    One field per key of the JSON report.
    """

    duration_s: float = 0.0
    robots: int = 0
    sessions: int = 0
    requests: int = 0
    answers: int = 0
    chunks: int = 0
    refusals: int = 0
    admitted: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    injected: dict[str, int] = dataclasses.field(default_factory=dict)
    network_faults: dict[str, int] = dataclasses.field(default_factory=dict)
    proxy: dict[str, int] = dataclasses.field(default_factory=dict)
    close_codes: dict[str, int] = dataclasses.field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    abandoned: int = 0
    collateral: int = 0
    connect_failures: int = 0
    ledger: dict[str, Any] = dataclasses.field(default_factory=dict)
    rss_mib_start: float = math.nan
    rss_mib_end: float = math.nan
    rss_slope_kib_per_min: float = math.nan
    rss_slope_late_kib_per_min: float = math.nan
    rss_mib_samples: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    rss_mib_by_kind_start: dict[str, float] = dataclasses.field(default_factory=dict)
    rss_mib_by_kind_end: dict[str, float] = dataclasses.field(default_factory=dict)
    heap_growth: list[str] = dataclasses.field(default_factory=list)
    fds_start: int = -1
    fds_end: int = -1
    fd_slope_per_min: float = math.nan
    server_exit: int | None = None
    warm_up_session: str = ""
    text_requests: int = 0
    tokens: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def add_resources(self, samples: list[ResourceSample], end: ResourceSample, cfg: SoakConfig) -> None:
        """The server's memory and descriptors: ``samples`` over the run, ``end`` once every session closed."""
        warm = [s for s in samples if s.t >= min(5.0, cfg.duration_s * 0.2)] or samples
        self.rss_mib_start = round(warm[0].rss_bytes / 2**20, 1)
        self.rss_mib_end = round(end.rss_bytes / 2**20, 1)
        self.rss_slope_kib_per_min = round(slope((s.t, s.rss_bytes / 1024) for s in warm) * 60, 1)
        late = [s for s in samples if s.t >= cfg.duration_s / 2] or samples
        self.rss_slope_late_kib_per_min = round(slope((s.t, s.rss_bytes / 1024) for s in late) * 60, 1)
        step = max(1, int(30.0 / cfg.sample_period_s))
        self.rss_mib_samples = [(round(s.t), round(s.rss_bytes / 2**20, 1)) for s in samples[::step]]
        self.fds_start, self.fds_end = samples[0].fds, end.fds
        self.fd_slope_per_min = round(slope((s.t, s.fds) for s in warm) * 60, 2)

    def add_books(self, books: list[SessionBook]) -> None:
        """Sum the sessions' books."""
        self.sessions = len(books)
        for book in books:
            self.text_requests += sum(n for k, n in book.kinds.items() if k == "generate" or k.startswith("text_"))
            self.tokens += book.tokens
            self.requests += book.sent
            self.answers += book.answers
            self.outcomes = dict(collections.Counter(self.outcomes) + book.outcomes)
            self.injected = dict(collections.Counter(self.injected) + book.kinds)
            self.lost += book.lost
            self.duplicated += book.duplicated
            self.abandoned += book.abandoned
            self.collateral += book.collateral
            code = str(book.close_code)
            self.close_codes[code] = self.close_codes.get(code, 0) + 1
            self.problems += [f"session {book.session}: {p}" for p in book.problems]
        self.chunks = self.outcomes.get("chunk", 0)
        self.admitted = sum(sum(b.admitted.values()) for b in books)
        self.refusals = self.answers - self.chunks - sum(
            sum(n for o, n in b.admitted.items() if o in ADMITTED_ERRORS) for b in books)

    def add_ledger(self, rec: Reconciliation) -> None:
        """The ledger's reconciliation with the books."""
        self.ledger = dataclasses.asdict(rec)
        self.problems += [f"ledger: {m}" for m in rec.mismatches]
        if rec.phantom_rows:
            self.problems.append(f"ledger: {rec.phantom_rows} rows of sessions nobody opened")

    def check_idle_gauges(self, metrics_text: str) -> None:
        """Once every session closed, nothing may be queued, running or connected (``metrics_text``:
        the server's ``/metrics``, empty if it could not be read)."""
        from chunkline.bench.top import parse_metrics

        snap = parse_metrics(metrics_text, 0.0)
        for name, values in (("chunkline_queue_depth", snap.queue), ("chunkline_in_flight", snap.in_flight),
                             ("chunkline_sessions", snap.sessions)):
            if sum(values.values()) != 0.0:
                self.problems.append(f"{name} is {sum(values.values())} after every session closed")

    def judge(self, cfg: SoakConfig, log: str) -> None:
        """Add to ``problems`` what the figures and the server's log show."""
        if self.lost:
            self.problems.append(f"{self.lost} requests lost")
        if self.duplicated:
            self.problems.append(f"{self.duplicated} answers duplicated")
        if self.server_exit != 0:
            self.problems.append(f"server exited with {self.server_exit} after SIGTERM")
        if cfg.duration_s >= cfg.min_duration_for_slopes_s and self.rss_slope_late_kib_per_min > cfg.max_rss_slope_kib_per_min:
            self.problems.append(f"memory still grows by {self.rss_slope_late_kib_per_min} KiB/min in the second half")
        if self.fds_end > self.fds_start >= 0:
            self.problems.append(f"file descriptors grew from {self.fds_start} to {self.fds_end}")
        self.problems += log_problems(log)


#: Log lines that a soak with faults produces on purpose.
_EXPECTED_ERRORS = ("has run past the hang timeout",)


def log_problems(log: str) -> list[str]:
    """Lines of the server's log that show a fault it did not handle."""
    problems = []
    for line in log.splitlines():
        if any(s in line for s in ("connection handler failed", "Task exception was never retrieved", "Exception in callback")):
            problems.append(f"server log: {line[:200]}")
        elif (" ERROR " in line or " CRITICAL " in line) and not any(s in line for s in _EXPECTED_ERRORS):
            problems.append(f"server log: {line[:200]}")
    return problems
