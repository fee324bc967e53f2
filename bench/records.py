"""Per-request records of a load step and their summary (pure: no clock, no I/O).

Definitions used by every report: **offered** (requests the schedule sent), **refused** (admission
errors, by reason), **admitted** (offered less refused and never sent; includes those later dropped,
failed or timed out), **good** (a chunk not marked late whose latency, from the *scheduled* send to
the reply, is within its deadline: the generator's own lateness is charged to the system, no
coordinated omission) and **goodput** (good per second; ``goodput_ratio`` = good / offered)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .stats import percentiles

__all__ = [
    "ADMISSION_REFUSALS",
    "CLIENT_FAILURES",
    "NOT_SENT",
    "OK",
    "RequestRecord",
    "StepSummary",
    "is_good",
    "summarize",
    "goodput",
]

#: the reply was a chunk.
OK = "ok"
#: error codes that mean the request was turned away before it was queued.
ADMISSION_REFUSALS: frozenset[str] = frozenset(
    {"overloaded", "quota_exceeded", "deadline_unmeetable", "not_ready", "shutting_down", "unauthenticated", "forbidden"}
)
#: outcomes decided on the client side (no answer from the server).
CLIENT_FAILURES: frozenset[str] = frozenset({"timeout", "connection_lost", "not_sent", "unsupported"})
#: outcomes of requests that never left the generator (``unsupported``: a request class the
#: client cannot send yet, e.g. ``text`` rows of a trace).
NOT_SENT: frozenset[str] = frozenset({"not_sent", "unsupported"})


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request.

    Args:
        scheduled: seconds from the step's start when the schedule said to send it.
        sent: seconds from the step's start when the generator actually sent it.
        robot: the robot session that sent it.
        outcome: ``ok``, a server error code (``overloaded``, ...), or a client-side
            outcome (``timeout``, ``connection_lost``, ``not_sent``).
        latency_s: scheduled send time to reply (or error) received, seconds; NaN if none.
        deadline_ms: the request's deadline (``None``: none was sent).
        late: the server marked the chunk late.
        server: the server's timing map (ms, plus ``batch_size``).
        client: the client's timing map (ms).
        handover_ms: time to hand the chunk to a broker timeline, if measured.
        tenant: the tenant it was sent for.
        cls: request class.
    """

    scheduled: float
    sent: float
    robot: int
    outcome: str
    latency_s: float = math.nan
    deadline_ms: float | None = None
    late: bool = False
    server: dict[str, float] = dataclasses.field(default_factory=dict)
    client: dict[str, float] = dataclasses.field(default_factory=dict)
    handover_ms: float | None = None
    tenant: str | None = None
    cls: str = "policy"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields}
        if kwargs.get("latency_s") is None:
            kwargs["latency_s"] = math.nan
        return cls(**kwargs)


def is_good(r: RequestRecord) -> bool:
    """A chunk, not marked late, within the request's deadline as the client saw it."""
    if r.outcome != OK or r.late or not math.isfinite(r.latency_s):
        return False
    return r.deadline_ms is None or r.latency_s * 1000.0 <= r.deadline_ms


def goodput(records: Sequence[RequestRecord], duration: float) -> float:
    """Good requests per second over ``duration`` seconds."""
    if duration <= 0:
        raise ValueError("duration must be > 0")
    return sum(1 for r in records if is_good(r)) / duration


@dataclasses.dataclass
class StepSummary:
    """One load step, as the reports show it (latencies in seconds).

    One field per column of the load report.

    Args:
        label: which configuration (server) it ran against.
        phase: ``cold`` (first requests on a fresh server) or ``warm``.
        rate: the target offered rate (requests/s).
        duration: the step's length (s).
        offered, sent, admitted, completed, good: counts (see the module docstring).
        refused: admission refusals by reason.
        errors: every other non-``ok`` outcome by reason.
        offered_rate, goodput: per second.
        goodput_ratio: good / offered.
        latency: p50/p95/p99 of completed requests (client: from the scheduled send to the reply).
        server_latency: p50/p95/p99 of the server's end-to-end time (``server_ms``: frame
            arrival to reply written) of completed requests.
        refusal_latency: p50/p95/p99 of the time from sending a request to receiving its refusal.
        gen_lag: p50/p95/p99 of (sent - scheduled): how far the generator fell behind.
        mean_batch_size: mean ``batch_size`` the server reported (NaN if it reports none).
        server_cpu_percent, server_rss_mb: the server process's CPU (100 = one core) and peak memory.
        late: chunks the server marked late.
    """

    label: str
    phase: str
    rate: float
    duration: float
    offered: int
    sent: int
    admitted: int
    completed: int
    good: int
    refused: dict[str, int]
    errors: dict[str, int]
    offered_rate: float
    goodput: float
    goodput_ratio: float
    latency: dict[str, float]
    refusal_latency: dict[str, float]
    gen_lag: dict[str, float]
    mean_batch_size: float
    late: int
    server_latency: dict[str, float] = dataclasses.field(default_factory=dict)
    server_cpu_percent: float = math.nan
    server_rss_mb: float = math.nan
    repeats: int = 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


def summarize(records: Sequence[RequestRecord], *, duration: float, label: str = "", phase: str = "warm",
              rate: float = math.nan, server_cpu_percent: float = math.nan, server_rss_mb: float = math.nan,
              repeats: int = 1) -> StepSummary:
    """Summarise one step (or several repeats of it: pass their records together and the
    summed ``duration``).

    Args:
        records: every request the schedule offered in the step.
        duration: seconds of schedule covered (> 0).
        label: configuration name.
        phase: ``cold`` or ``warm``.
        rate: the target offered rate.
        server_cpu_percent, server_rss_mb: resource figures measured alongside.
        repeats: how many repeats ``records`` pools.
    """
    if duration <= 0:
        raise ValueError("duration must be > 0")
    outcomes = Counter(r.outcome for r in records)
    refused = {k: v for k, v in sorted(outcomes.items()) if k in ADMISSION_REFUSALS}
    errors = {k: v for k, v in sorted(outcomes.items()) if k != OK and k not in ADMISSION_REFUSALS}
    completed = [r for r in records if r.outcome == OK]
    good = sum(1 for r in completed if is_good(r))
    not_sent = sum(outcomes.get(k, 0) for k in NOT_SENT)
    offered = len(records)
    batch = [float(r.server["batch_size"]) for r in completed if "batch_size" in r.server]
    lags = [r.sent - r.scheduled for r in records if r.outcome not in NOT_SENT and math.isfinite(r.sent)]
    return StepSummary(
        label=label,
        phase=phase,
        rate=rate,
        duration=duration,
        offered=offered,
        sent=offered - not_sent,
        admitted=offered - not_sent - sum(refused.values()),
        completed=len(completed),
        good=good,
        refused=refused,
        errors=errors,
        offered_rate=offered / duration,
        goodput=good / duration,
        goodput_ratio=good / offered if offered else math.nan,
        latency=percentiles([r.latency_s for r in completed if math.isfinite(r.latency_s)]),
        server_latency=percentiles([float(r.server["server_ms"]) / 1000.0 for r in completed if "server_ms" in r.server]),
        # Time to a refusal counts from the actual send: it measures the server's answer, not the generator.
        refusal_latency=percentiles([r.latency_s - (r.sent - r.scheduled) for r in records
                                     if r.outcome in ADMISSION_REFUSALS and math.isfinite(r.latency_s)]),
        gen_lag=percentiles(lags),
        mean_batch_size=float(np.mean(batch)) if batch else math.nan,
        late=sum(1 for r in completed if r.late),
        server_cpu_percent=server_cpu_percent,
        server_rss_mb=server_rss_mb,
        repeats=repeats,
    )
