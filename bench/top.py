"""``chunkline top``: a live terminal view of a running server, refreshed from its ``/metrics``.

Shows sessions per tenant, per-model queue depth, in-flight work, batch size and service time,
latency percentiles per stage (estimated from the Prometheus histograms over the last refresh
interval, and since start), refusals by reason and per-tenant usage. Built on ``rich``.
"""

from __future__ import annotations

import argparse
import math
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from chunkline.server.entrypoints.cli_errors import UsageError

__all__ = ["Snapshot", "parse_metrics", "histogram_quantile", "render", "add_top_parser", "main"]

STAGES = (
    ("decode", "chunkline_decode_seconds"),
    ("queue wait", "chunkline_queue_wait_seconds"),
    ("inference", "chunkline_inference_seconds"),
    ("encode", "chunkline_encode_seconds"),
    ("server e2e", "chunkline_server_latency_seconds"),
)


@dataclass
class Snapshot:
    """The figures ``top`` shows, read from one scrape."""

    taken: float
    # histogram name -> cumulative buckets [(le, count)], summed over label sets
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    sessions: dict[str, float] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    in_flight: dict[str, float] = field(default_factory=dict)
    batch: dict[str, tuple[float, float]] = field(default_factory=dict)  # model -> (sum, count)
    service: dict[tuple[str, str], float] = field(default_factory=dict)  # (model, batch size) -> seconds
    refusals: dict[str, float] = field(default_factory=dict)
    requests: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (tenant, model, outcome)
    ledger_healthy: float = math.nan


def parse_metrics(text: str, taken: float) -> Snapshot:
    """Read the Prometheus text format into a :class:`Snapshot`."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot(taken=taken)
    cumulative: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    batch_sum: dict[str, float] = defaultdict(float)
    batch_count: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name.endswith("_bucket") and "le" in labels:
                cumulative[name[: -len("_bucket")]][float(labels["le"])] += value
            elif name == "chunkline_sessions":
                snap.sessions[labels.get("tenant", "?")] = value
            elif name == "chunkline_queue_depth":
                snap.queue[labels.get("model", "?")] = value
            elif name == "chunkline_in_flight":
                snap.in_flight[labels.get("model", "?")] = value
            elif name == "chunkline_batch_size_sum":
                batch_sum[labels.get("model", "?")] += value
            elif name == "chunkline_batch_size_count":
                batch_count[labels.get("model", "?")] += value
            elif name == "chunkline_service_time_seconds":
                snap.service[(labels.get("model", "?"), labels.get("batch_size", "?"))] = value
            elif name == "chunkline_refusals_total":  # summed over class and model
                reason = labels.get("reason", "?")
                snap.refusals[reason] = snap.refusals.get(reason, 0.0) + value
            elif name == "chunkline_requests_total":
                snap.requests[(labels.get("tenant", "?"), labels.get("model", "?"), labels.get("outcome", "?"))] = value
            elif name == "chunkline_ledger_healthy":
                snap.ledger_healthy = value
    snap.buckets = {k: sorted(v.items()) for k, v in cumulative.items()}
    snap.batch = {m: (batch_sum[m], batch_count[m]) for m in batch_count}
    return snap


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style quantile from cumulative buckets (linear within a bucket); NaN if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width > 0 else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def _delta(now: list[tuple[float, float]], before: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    if not before:
        return now
    old = dict(before)
    return [(le, c - old.get(le, 0.0)) for le, c in now]


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.2f}"


def render(snap: Snapshot, previous: Snapshot | None, source: str):  # -> rich renderable
    """Build the screen for one refresh."""
    from rich.console import Group
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row(f"[b]chunkline top[/b]  {source}", time.strftime("%H:%M:%S"),
                 f"sessions {int(sum(snap.sessions.values()))}",
                 "ledger ok" if snap.ledger_healthy == 1 else "[red]ledger FAILED[/red]" if snap.ledger_healthy == 0 else "")

    models = Table(title="models", expand=False)
    for col in ("model", "queued", "in flight", "batches", "mean batch", "service b=1 ms"):
        models.add_column(col, justify="right" if col != "model" else "left")
    for m in sorted(set(snap.queue) | set(snap.batch)):
        s, c = snap.batch.get(m, (0.0, 0.0))
        models.add_row(m, f"{snap.queue.get(m, 0):.0f}", f"{snap.in_flight.get(m, 0):.0f}", f"{c:.0f}",
                       f"{s / c:.2f}" if c else "-", _ms(snap.service.get((m, "1"), math.nan)))

    # Prometheus histograms keep bucket counts, not samples: a percentile is interpolated inside
    # its bucket, so the table says "~" and its caption names the bucket bounds as the precision.
    stages = Table(title="latency per stage (ms, ~ estimated from histogram buckets)",
                   caption="~: interpolated within the histogram bucket holding the percentile (docs/operations.md)")
    for col in ("stage", "~p50 now", "~p99 now", "~p50 all", "~p99 all", "count"):
        stages.add_column(col, justify="right" if col != "stage" else "left")
    for label, name in STAGES:
        b = snap.buckets.get(name, [])
        window = _delta(b, previous.buckets.get(name) if previous else None)
        stages.add_row(label, _ms(histogram_quantile(0.5, window)), _ms(histogram_quantile(0.99, window)),
                       _ms(histogram_quantile(0.5, b)), _ms(histogram_quantile(0.99, b)), f"{b[-1][1]:.0f}" if b else "0")

    refusals = Table(title="refusals by reason")
    refusals.add_column("reason")
    refusals.add_column("total", justify="right")
    for reason, v in sorted(snap.refusals.items()):
        refusals.add_row(reason, f"{v:.0f}")

    tenants = Table(title="usage per tenant")
    for col in ("tenant", "sessions", "ok", "late", "refused/failed", "req/s"):
        tenants.add_column(col, justify="right" if col != "tenant" else "left")
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (tenant, _model, outcome), v in snap.requests.items():
        per[tenant][outcome] += v
    dt = (snap.taken - previous.taken) if previous else 0.0
    for tenant in sorted(set(per) | set(snap.sessions)):
        row = per[tenant]
        total = sum(row.values())
        before = sum(v for (t, _, _), v in (previous.requests.items() if previous else ()) if t == tenant)
        rate = (total - before) / dt if dt > 0 else math.nan
        tenants.add_row(tenant, f"{snap.sessions.get(tenant, 0):.0f}", f"{row.get('ok', 0):.0f}", f"{row.get('late', 0):.0f}",
                        f"{total - row.get('ok', 0) - row.get('late', 0):.0f}", "-" if math.isnan(rate) else f"{rate:.1f}")
    return Group(head, models, tenants, stages, refusals)


def _fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _fetch_or_explain(url: str, timeout: float) -> str:
    """:func:`_fetch`, its failures as a :class:`UsageError` that says what to check."""
    try:
        return _fetch(url, timeout)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise UsageError(f"{url} refused the request: HTTP {exc.code}",
                             "point --url at the metrics port (serve --metrics-port), which needs no key") from exc
        raise UsageError(f"{url} answered HTTP {exc.code}", "point --url at a server's /metrics") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UsageError(f"cannot read {url}: {getattr(reason, 'strerror', None) or reason}",
                         "is the server running with --metrics-port? check --url") from exc


def add_top_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="live terminal view of a running server (from its /metrics)",
                       description="Live view of a server: sessions, queues, batch sizes, latency per stage, refusals, tenants.")
    p.add_argument("--url", default="http://127.0.0.1:9100/metrics", help="the server's metrics URL (--metrics-port)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    previous: Snapshot | None = None
    if args.once:
        console.print(render(parse_metrics(_fetch_or_explain(args.url, 5.0), time.monotonic()), None, args.url))
        return 0
    with Live(console=console, refresh_per_second=4, screen=True, vertical_overflow="visible") as live:
        while True:
            try:
                snap = parse_metrics(_fetch(args.url, max(1.0, args.interval)), time.monotonic())
            except OSError as exc:
                live.update(f"[red]cannot read {args.url}: {exc}[/red]")
            else:
                live.update(render(snap, previous, args.url))
                previous = snap
            time.sleep(args.interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_top_parser(sub)
    args = parser.parse_args(["top", *(argv or [])])
    try:
        return run(args)
    except KeyboardInterrupt:
        return 0
