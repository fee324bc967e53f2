"""Usage per tenant over a period, read from a ledger file (WAL allows reading while a server writes)."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sqlite3
from pathlib import Path

from chunkline.server.core.ledger.errors import LedgerError

__all__ = ["TenantSummary", "summarize"]


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
