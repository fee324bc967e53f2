"""What one load step cost: the CPU each request took the server (all of it, and its event loop
alone) and the generator, and the time to a refusal, as the client saw it and as the server's
own ``/metrics`` histogram bounds it."""

from __future__ import annotations

import dataclasses
import http.client
import math
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from .loadgen import StepResult
from .records import ADMISSION_REFUSALS, NOT_SENT, OK, RequestRecord
from .report import Column, format_table
from .serverproc import http_get

__all__ = ["StepCost", "cost_table", "scrape_latency_buckets", "refusal_buckets", "bucket_quantile"]


_BUCKET_RE = re.compile(r"^chunkline_server_latency_seconds_bucket\{([^}]*)\}\s+(\S+)")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape_latency_buckets(uri: str, timeout: float = 2.0) -> dict[float, float] | None:
    """The server's ``chunkline_server_latency_seconds`` histogram for policy requests:
    cumulative count per bucket bound (seconds, ``inf`` last), summed over models.

    Read from ``/metrics`` on the server's own port, which a server without authentication
    serves (the benchmarks' own servers); ``None`` when it cannot be read, empty before the
    server has answered any request.

    Args:
        uri: the server's ``ws://`` or ``wss://`` URI.
        timeout: seconds for the HTTP request.
    """
    parts = urllib.parse.urlsplit(uri)
    if parts.hostname is None:
        return None
    try:
        status, body = http_get(parts.hostname, parts.port or (443 if parts.scheme == "wss" else 80), "/metrics",
                                timeout=timeout, tls=parts.scheme == "wss")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    buckets: dict[float, float] = {}
    for line in body.decode(errors="replace").splitlines():
        m = _BUCKET_RE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL_RE.findall(m.group(1)))
        if labels.get("class") != "policy" or "le" not in labels:
            continue
        try:
            bound, count = float(labels["le"]), float(m.group(2))
        except ValueError:
            continue
        buckets[bound] = buckets.get(bound, 0.0) + count
    return buckets  # empty until the server has answered a request


def refusal_buckets(before: dict[float, float] | None, after: dict[float, float] | None,
                    records: Sequence[RequestRecord]) -> dict[float, float] | None:
    """The server-side latency histogram of one step's admission refusals.

    The server records ``server_ms`` for every chunk (sent back to the client in its ``timing``)
    and every refusal (not sent back) in one histogram. Taking the step's chunks, whose values
    the client knows exactly, out of the histogram's growth over the step leaves the refusals.
    When what is left does not match the refusals the client received (say, chunks that
    arrived after the client had given up), the figure is withheld: ``None``.

    Args:
        before: the histogram scraped before the step.
        after: the histogram scraped after it.
        records: the step's requests.
    """
    if before is None or after is None:
        return None
    refused = sum(1 for r in records if r.outcome in ADMISSION_REFUSALS)
    chunks = sorted(r.server["server_ms"] / 1000.0 for r in records if r.outcome == OK and "server_ms" in r.server)
    left: dict[float, float] = {}
    for bound in sorted(after):
        chunks_in = sum(1 for v in chunks if v <= bound)
        left[bound] = after[bound] - before.get(bound, 0.0) - chunks_in
    total = left.get(math.inf, 0.0)
    if any(v < 0 for v in left.values()) or abs(total - refused) > max(2.0, 0.02 * refused):
        return None
    return left


def bucket_quantile(buckets: dict[float, float] | None, q: float) -> float:
    """The upper bound (seconds) of the bucket holding quantile ``q`` of a cumulative
    histogram: the quantile is at most this. NaN for an empty or missing histogram.

    Args:
        buckets: cumulative counts per bucket bound (seconds).
        q: the quantile, in (0, 1].
    """
    if not buckets:
        return math.nan
    total = buckets.get(math.inf, max(buckets.values()))
    if total <= 0:
        return math.nan
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return math.inf


@dataclasses.dataclass
class StepCost:
    """What one step's requests cost, pooled over its repeats.

    Args:
        label: the configuration.
        phase: ``cold`` or ``warm``.
        rate: the offered rate.
        sent: requests sent.
        server_cpu_s: CPU seconds of the server process (NaN: not measured).
        server_loop_cpu_s: of its event loop thread alone.
        generator_cpu_s: of the load generator.
        refused: admission refusals received.
        client_refusal: p50/p99 seconds from sending a request to receiving its refusal.
        server_refusal: cumulative histogram of the refusals' server-side latency (``None``:
            not available).
    """

    label: str
    phase: str
    rate: float
    sent: int = 0
    server_cpu_s: float = 0.0
    server_loop_cpu_s: float = 0.0
    generator_cpu_s: float = 0.0
    refused: int = 0
    client_refusal: dict[str, float] = dataclasses.field(default_factory=dict)
    server_refusal: dict[float, float] | None = dataclasses.field(default_factory=dict)

    def add(self, result: StepResult, refusals: dict[float, float] | None) -> None:
        """Pool one measurement of the step in."""
        self.sent += sum(1 for r in result.records if r.outcome not in NOT_SENT)
        cpu = result.server_cpu
        self.server_cpu_s += cpu.total if cpu is not None else math.nan
        self.server_loop_cpu_s += cpu.main if cpu is not None else math.nan
        self.generator_cpu_s += result.generator_cpu_s
        self.refused += sum(1 for r in result.records if r.outcome in ADMISSION_REFUSALS)
        if self.server_refusal is not None and refusals is not None:
            for bound, count in refusals.items():
                self.server_refusal[bound] = self.server_refusal.get(bound, 0.0) + count
        else:
            self.server_refusal = None

    def per_request_ms(self, cpu_s: float) -> float:
        return 1000.0 * cpu_s / self.sent if self.sent else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "phase": self.phase, "rate": self.rate, "sent": self.sent, "refused": self.refused,
            "server_cpu_ms_per_request": self.per_request_ms(self.server_cpu_s),
            "server_loop_cpu_ms_per_request": self.per_request_ms(self.server_loop_cpu_s),
            "generator_cpu_ms_per_request": self.per_request_ms(self.generator_cpu_s),
            "client_refusal_s": self.client_refusal,
            "server_refusal_s": {"p50_at_most": bucket_quantile(self.server_refusal, 0.5),
                                 "p99_at_most": bucket_quantile(self.server_refusal, 0.99)},
        }


def cost_table(costs: Sequence[StepCost], *, title: str | None = None) -> str:
    """CPU per request and time to a refusal, client- and server-side (milliseconds).

    Args:
        costs: the rows.
        title: a line above the table.
    """
    def ms(value: float) -> float:
        return value * 1000.0

    def at_most(value: float) -> str:
        return "n/a" if math.isnan(value) else "inf" if math.isinf(value) else f"<={value * 1000.0:g}"

    cols = [
        Column("config", "label", align="<"),
        Column("phase", "phase", align="<"),
        Column("rate/s", lambda c: c.rate, ".1f"),
        Column("sent", lambda c: c.sent),
        Column("srv cpu ms/req", lambda c: c.per_request_ms(c.server_cpu_s), ".3f"),
        Column("loop ms/req", lambda c: c.per_request_ms(c.server_loop_cpu_s), ".3f"),
        Column("gen ms/req", lambda c: c.per_request_ms(c.generator_cpu_s), ".3f"),
        Column("refused", lambda c: c.refused),
        Column("ref p50ms client", lambda c: ms(c.client_refusal.get("p50", math.nan)), ".2f"),
        Column("ref p99ms client", lambda c: ms(c.client_refusal.get("p99", math.nan)), ".2f"),
        Column("ref p50ms server", lambda c: at_most(bucket_quantile(c.server_refusal, 0.5))),
        Column("ref p99ms server", lambda c: at_most(bucket_quantile(c.server_refusal, 0.99))),
    ]
    return format_table(costs, cols, title=title)
