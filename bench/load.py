"""``chunkline bench load``: an open-loop sweep of offered load, from idle to saturation.

Requests arrive on a schedule (constant, Poisson, gamma bursts or a recorded trace) whatever the
replies do; each step reports offered, admitted, refused by reason, goodput within deadline,
latency p50/p95/p99, mean batch, server CPU and memory (the first requests as a separate *cold*
step). With ``--baseline-args`` or ``--baseline-uri`` a second server gets the same schedules in
alternation and the table ends with the ratios. A second table gives the CPU per request (server,
its event loop, the generator: trustworthy on a shared machine when wall-clock figures are not)
and the time to a refusal, client-side and server-side (:mod:`chunkline.bench.stepcost`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chunkline.bench.help_text import plain_help
from chunkline.client import ChunklineError

from .arrivals import ARRIVAL_KINDS, Arrival, ArrivalError, load_trace, make_process, schedule, trace_rate, trace_schedule
from .loadgen import LoadGenError, LoadOptions, StepResult, StepRunner
from .records import RequestRecord, StepSummary, summarize
from .report import Column, Progress, ResultsDir, default_out, format_table
from .stepcost import StepCost, bucket_quantile, cost_table, refusal_buckets, scrape_latency_buckets
from .targets import RunningTarget, TargetError, add_target_arguments, alternation, start_targets, targets_from_args

__all__ = ["RUN_ERRORS", "main", "build_parser", "parse_rates", "auto_rates_done", "sustained_rate", "step_table", "SweepSpec",
           "run_sweep", "StepCost", "cost_table", "scrape_latency_buckets", "refusal_buckets", "bucket_quantile"]

#: what stops a live run with a message instead of a traceback: no server, no connection, no model.
#: (``RuntimeError`` is what :class:`~chunkline.bench.serverproc.ServerProcess` raises.)
RUN_ERRORS: tuple[type[BaseException], ...] = (ChunklineError, LoadGenError, RuntimeError, OSError)

#: a step whose goodput ratio falls below this counts as saturated (``--rates auto`` stops after one).
SATURATED = 0.8
#: a step is *sustained* when at least this fraction of offered requests is good (and p99 is in deadline).
SUSTAINED = 0.99


def parse_rates(text: str) -> list[float] | None:
    """``"5,10,20"`` to ``[5.0, 10.0, 20.0]``; ``"auto"`` to ``None`` (doubling until saturation).

    Args:
        text: the ``--rates`` value.

    Raises:
        argparse.ArgumentTypeError: not positive finite numbers.
    """
    if text.strip() == "auto":
        return None
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers separated by commas, or 'auto': {text!r}") from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive: {text!r}")
    return rates


def auto_rates_done(last_steps: Sequence[StepSummary], rate: float, max_rate: float) -> bool:
    """Whether an automatic sweep stops: every configuration saturated at the last rate, or
    the next rate (double) would pass ``max_rate``.

    Args:
        last_steps: every configuration's step at ``rate``.
        rate: the rate just measured.
        max_rate: the highest rate the sweep may reach.
    """
    saturated = bool(last_steps) and all(s.goodput_ratio < SATURATED for s in last_steps)
    return saturated or rate * 2 > max_rate


def sustained_rate(steps: Sequence[StepSummary], deadline_ms: float | None) -> float:
    """The highest offered rate among warm steps that were sustained (>= 99 % good and p99
    within the deadline); 0 if none was.

    Args:
        steps: one configuration's steps.
        deadline_ms: the p99 limit (``None``: no limit).
    """
    best = 0.0
    for s in steps:
        if s.phase != "warm" or not s.goodput_ratio >= SUSTAINED:
            continue
        p99 = s.latency["p99"]
        if deadline_ms is not None and not p99 * 1000.0 <= deadline_ms:
            continue
        best = max(best, s.offered_rate)
    return best


def _reasons(d: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in d.items()) or "-"


def step_table(steps: Sequence[StepSummary], *, title: str | None = None) -> str:
    """The summary table of load steps (latencies in ms).

    Args:
        steps: the rows.
        title: a line above the table.
    """
    def ms(q: str) -> Callable[[StepSummary], float]:
        return lambda s: s.latency[q] * 1000.0

    cols = [
        Column("config", "label", align="<"),
        Column("phase", "phase", align="<"),
        Column("rate/s", lambda s: s.rate, ".1f"),
        Column("offered/s", lambda s: s.offered_rate, ".1f"),
        Column("sent", lambda s: s.sent),
        Column("admitted", lambda s: s.admitted),
        Column("refused", lambda s: _reasons(s.refused), align="<"),
        Column("errors", lambda s: _reasons(s.errors), align="<"),
        Column("goodput/s", lambda s: s.goodput, ".1f"),
        Column("good%", lambda s: 100.0 * s.goodput_ratio, ".1f"),
        Column("p50ms", ms("p50"), ".2f"),
        Column("p95ms", ms("p95"), ".2f"),
        Column("p99ms", ms("p99"), ".2f"),
        Column("srv p50ms", lambda s: s.server_latency.get("p50", math.nan) * 1000.0, ".2f"),
        Column("srv p99ms", lambda s: s.server_latency.get("p99", math.nan) * 1000.0, ".2f"),
        Column("batch", lambda s: s.mean_batch_size, ".2f"),
        Column("cpu%", lambda s: s.server_cpu_percent, ".0f"),
        Column("rssMB", lambda s: s.server_rss_mb, ".0f"),
        Column("lag99ms", lambda s: s.gen_lag["p99"] * 1000.0, ".2f"),
    ]
    return format_table(steps, cols, title=title)



@dataclasses.dataclass
class SweepSpec:
    """What one sweep sends.

    Args:
        rates: offered rates (requests/s, all robots together); ``None``: ``min_rate`` doubling
            up to ``max_rate``, until every configuration saturates.
        arrival: ``constant``, ``poisson``, ``gamma`` or ``trace``.
        duration: seconds per step (``None`` with a trace: the whole trace).
        robots: sessions sharing the load (``None`` with a trace: the trace's own).
        deadline_ms: each request's deadline.
        repeats: measurements of each step per configuration, alternated A B A B.
        cold_duration: seconds of the first (cold) step on each fresh server; 0 for none.
        cv: burstiness of ``gamma``.
        trace: the trace (``arrival == "trace"``).
        seed: base seed of the schedules.
        min_rate, max_rate: bounds of an automatic sweep.
    """

    rates: list[float] | None
    arrival: str = "poisson"
    duration: float | None = 5.0
    robots: int | None = 8
    deadline_ms: float | None = 100.0
    repeats: int = 1
    cold_duration: float = 2.0
    cv: float = 2.0
    trace: list[Arrival] | None = None
    seed: int = 0
    min_rate: float = 5.0
    max_rate: float = 640.0

    def schedule(self, rate: float, seed: int, duration: float | None = None) -> tuple[list[Arrival], float]:
        """The arrivals of one step at ``rate`` (a trace: time-scaled to it) and the seconds they cover."""
        duration = self.duration if duration is None else duration
        if self.arrival == "trace":
            if not self.trace:
                raise ArrivalError("--arrival trace needs a non-empty --trace file")
            arrivals = trace_schedule(self.trace, rate=rate, duration=duration, robots=self.robots,
                                      deadline_ms=self.deadline_ms)
            if duration is None:
                # The whole trace: its span plus one mean gap (n arrivals cover n gaps).
                duration = (arrivals[-1].t if arrivals else 0.0) + 1.0 / rate
            return arrivals, duration
        assert duration is not None
        return schedule(make_process(self.arrival, rate, cv=self.cv), duration, self.robots or 1, seed=seed,
                        deadline_ms=self.deadline_ms), duration


def _with_label(records: list[RequestRecord], label: str, phase: str, rate: float, rnd: int) -> list[dict[str, Any]]:
    return [{"label": label, "phase": phase, "rate": rate, "round": rnd, **r.as_dict()} for r in records]


def run_sweep(spec: SweepSpec, running: Sequence[RunningTarget], runner: StepRunner, out: ResultsDir, *,
              log: Callable[[str], None] = print, costs: list[StepCost] | None = None) -> list[StepSummary]:
    """Measure every configuration at every rate (alternating), write each step as it ends.

    Args:
        spec: what to send.
        running: the live servers, measured in this order within each round.
        runner: sends the steps.
        out: where step summaries and per-request records go.
        log: one line per finished step.
        costs: if given, receives each step's :class:`StepCost` (CPU per request, refusal latencies).

    Returns:
        The step summaries: cold steps first, then warm steps in rate order.
    """
    steps: list[StepSummary] = []
    pooled_costs: dict[tuple[str, str, float], StepCost] = {}

    def record(label: str, phase: str, rate: float, rnd: int, rs: list[RequestRecord]) -> None:
        out.write_requests(_with_label(rs, label, phase, rate, rnd))

    def measure(t: RunningTarget, phase: str, rate: float, arrivals: list[Arrival], progress: Progress) -> StepResult:
        before = scrape_latency_buckets(t.uri)
        res = runner.run(t.uri, arrivals, pid=t.pid, progress=progress)
        key = (t.label, phase, rate)
        cost = pooled_costs.get(key)
        if cost is None:
            cost = pooled_costs[key] = StepCost(t.label, phase, rate)
        cost.add(res, refusal_buckets(before, scrape_latency_buckets(t.uri) if before is not None else None, res.records))
        return res

    def finish(summary: StepSummary) -> None:
        steps.append(summary)
        out.write("step", summary.as_dict())
        cost = pooled_costs.get((summary.label, summary.phase, summary.rate))
        extra = ""
        if cost is not None:
            cost.client_refusal = summary.refusal_latency
            out.write("cost", cost.as_dict())
            if costs is not None:
                costs.append(cost)
            extra = (f"  cpu/req server {cost.per_request_ms(cost.server_cpu_s):.3f} ms"
                     f" generator {cost.per_request_ms(cost.generator_cpu_s):.3f} ms")
        log(f"  {summary.label:<16} {summary.phase:<4} {summary.rate:8.1f}/s  good {100 * summary.goodput_ratio:5.1f}%  "
            f"p99 {summary.latency['p99'] * 1000:8.2f} ms  refused {summary.refused_total}{extra}")

    first_rate = spec.rates[0] if spec.rates else spec.min_rate
    if spec.cold_duration > 0:
        for t in running:
            arrivals, covered = spec.schedule(first_rate, spec.seed, spec.cold_duration)
            res = measure(t, "cold", first_rate, arrivals, Progress(len(arrivals), f"{t.label} cold"))
            record(t.label, "cold", first_rate, 0, res.records)
            finish(summarize(res.records, duration=covered, label=t.label, phase="cold", rate=first_rate,
                             server_cpu_percent=res.usage.cpu_percent, server_rss_mb=res.usage.rss_mb))

    rate = first_rate
    index = 0
    while True:
        pooled: dict[str, list[RequestRecord]] = {t.label: [] for t in running}
        usage: dict[str, list[tuple[float, float]]] = {t.label: [] for t in running}
        covered = 0.0
        by_label = {t.label: t for t in running}
        for rnd, label in alternation([t.label for t in running], spec.repeats):
            # The same schedule for every configuration in a round: they face identical arrivals.
            arrivals, covered = spec.schedule(rate, spec.seed + 1000 * (rnd + 1) + index)
            t = by_label[label]
            name = f"{label} {rate:g}/s"
            res = measure(t, "warm", rate, arrivals, Progress(len(arrivals), f"{name} [{rnd + 1}/{spec.repeats}]"))
            record(label, "warm", rate, rnd, res.records)
            pooled[label] += res.records
            usage[label].append((res.usage.cpu_percent, res.usage.rss_mb))
        current = []
        for t in running:
            cpu = [u[0] for u in usage[t.label]]
            rss = [u[1] for u in usage[t.label]]
            summary = summarize(pooled[t.label], duration=covered * spec.repeats, label=t.label, phase="warm",
                                rate=rate,
                                server_cpu_percent=sum(cpu) / len(cpu), server_rss_mb=max(rss),
                                repeats=spec.repeats)
            finish(summary)
            current.append(summary)
        index += 1
        if spec.rates is not None:
            if index >= len(spec.rates):
                break
            rate = spec.rates[index]
        else:
            if auto_rates_done(current, rate, spec.max_rate):
                break
            rate *= 2
    return steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline bench load", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser, default_policy="loadtest")
    g = parser.add_argument_group("load")
    g.add_argument("--rates", type=parse_rates, default=argparse.SUPPRESS,
                   help="offered rates in requests/s (all robots together), e.g. 5,10,20; 'auto' doubles from "
                        "--min-rate until every configuration saturates (default: 'auto'; with a trace: as recorded)")
    g.add_argument("--min-rate", type=float, default=5.0, help="first rate of an automatic sweep")
    g.add_argument("--max-rate", type=float, default=640.0, help="last rate an automatic sweep may reach")
    g.add_argument("--arrival", choices=ARRIVAL_KINDS, default="poisson", help="arrival process (default poisson)")
    g.add_argument("--cv", type=float, default=2.0, help="gamma: coefficient of variation of inter-arrival times")
    g.add_argument("--trace", type=Path, default=None,
                   help="trace file (JSON lines or CSV: t, robot, tenant, class, shape, prompt_len, output_len, deadline_ms)")
    g.add_argument("--deadline-ms", type=float, default=100.0, help="each request's deadline (default 100)")
    g.add_argument("--duration", type=float, default=None, help="seconds per step (default 5; a trace: all of it)")
    g.add_argument("--robots", type=int, default=None, help="robot sessions sharing the load (default 8; a trace: its own)")
    g.add_argument("--repeats", type=int, default=1, help="measurements per step and configuration, alternated A B A B")
    g.add_argument("--cold-duration", type=float, default=2.0, help="seconds of the cold step on each fresh server (0: none)")
    g.add_argument("--workers", type=int, default=1, help="processes to spread the robot sessions over")
    g.add_argument("--timeout-margin", type=float, default=2.0, help="seconds past the deadline a client waits")
    g.add_argument("--tenant-key", action="append", default=[], metavar="TENANT=KEY", help="API key of a trace's tenant")
    g.add_argument("--model", default=None, help="model to ask for (default: the server's)")
    g.add_argument("--seed", type=int, default=0, help="seed of the observations and arrivals (default 0)")
    g.add_argument("--encode-each", action="store_true",
                   help="encode every request's observation anew, as a robot does (default: each robot's "
                        "observation is packed once and its bytes re-sent, sparing the shared CPU)")
    g.add_argument("--out", type=Path, default=None, help="results folder (default results/load)")
    return parser


def _spec_from_args(args: argparse.Namespace) -> SweepSpec:
    trace = None
    if args.arrival == "trace":
        if args.trace is None:
            raise ArrivalError("--arrival trace needs --trace FILE")
        trace = load_trace(args.trace)
    elif args.trace is not None:
        raise ArrivalError("--trace is only read with --arrival trace")
    is_trace = args.arrival == "trace"
    rates = getattr(args, "rates", None)
    if is_trace:
        recorded = trace_rate(trace or [])
        if not (math.isfinite(recorded) and recorded > 0):
            raise ArrivalError("the trace needs at least two arrivals at different times")
        if not hasattr(args, "rates"):
            rates = [recorded]  # replay as recorded
    for name in ("repeats", "workers"):
        if getattr(args, name) < 1:
            raise ArrivalError(f"--{name} must be >= 1")
    if args.robots is not None and args.robots < 1:
        raise ArrivalError("--robots must be >= 1")
    return SweepSpec(
        rates=rates,
        arrival=args.arrival,
        duration=args.duration if args.duration is not None else (None if is_trace else 5.0),
        robots=args.robots if args.robots is not None else (None if is_trace else 8),
        deadline_ms=args.deadline_ms,
        repeats=args.repeats,
        cold_duration=args.cold_duration,
        cv=args.cv,
        trace=trace,
        seed=args.seed,
        min_rate=args.min_rate,
        max_rate=args.max_rate,
    )


def write_plots(out: ResultsDir, steps: Sequence[StepSummary], requests: Sequence[dict[str, Any]],
                deadline_ms: float | None) -> None:
    """The load suite's PNGs: latency and goodput against load, resources, latency CDFs.

    Args:
        out: the results folder.
        steps: the sweep's step summaries.
        requests: the per-request rows (``requests.jsonl``).
        deadline_ms: drawn on the latency plots.
    """
    from . import plots

    rows = [s.as_dict() for s in steps if s.phase == "warm"]
    if rows:
        plots.plot_latency_vs_load(rows, out.file("latency_vs_load.png"), deadline_ms=deadline_ms)
        plots.plot_goodput_vs_load(rows, out.file("goodput_vs_load.png"))
        plots.plot_resources_vs_load(rows, out.file("resources_vs_load.png"))
    series: dict[str, list[float]] = {}
    warm_rates = sorted({s.rate for s in steps if s.phase == "warm"})
    # At most four rates per configuration keep the CDF readable: the lowest, the highest, two between.
    if len(warm_rates) > 4:
        warm_rates = [warm_rates[i] for i in sorted({0, len(warm_rates) // 3, 2 * len(warm_rates) // 3,
                                                      len(warm_rates) - 1})]
    for r in requests:
        if r["outcome"] != "ok" or r["latency_s"] is None:
            continue
        if r["phase"] == "cold":
            key = f"{r['label']} cold"
        elif r["rate"] in warm_rates:
            key = f"{r['label']} @{r['rate']:g}/s"
        else:
            continue
        series.setdefault(key, []).append(r["latency_s"])
    if series:
        plots.plot_latency_cdf(series, out.file("latency_cdf.png"), title="observation-to-chunk latency",
                               deadline_ms=deadline_ms)


def comparison_lines(steps: Sequence[StepSummary], labels: Sequence[str], deadline_ms: float | None) -> list[str]:
    """Ratios of the first configuration to the second, per rate and overall.

    Args:
        steps: both configurations' step summaries.
        labels: the configurations, measured one first.
        deadline_ms: for the sustained-rate comparison.
    """
    if len(labels) < 2:
        return []
    a, b = labels[0], labels[1]
    warm = {(s.label, s.rate): s for s in steps if s.phase == "warm"}
    lines = [f"comparison: {a} / {b}"]
    for rate in sorted({s.rate for s in steps if s.phase == "warm"}):
        sa, sb = warm.get((a, rate)), warm.get((b, rate))
        if sa is None or sb is None:
            continue
        g = sa.goodput / sb.goodput if sb.goodput > 0 else math.inf
        p = sa.latency["p99"] / sb.latency["p99"] if sb.latency["p99"] > 0 else math.nan
        lines.append(f"  {rate:8.1f}/s  goodput x{g:.2f}  p99 x{p:.2f}")
    ra = sustained_rate([s for s in steps if s.label == a], deadline_ms)
    rb = sustained_rate([s for s in steps if s.label == b], deadline_ms)
    ratio = f"x{ra / rb:.2f}" if rb > 0 else "n/a (baseline sustained no step)"
    lines.append(f"  highest sustained rate (>= {100 * SUSTAINED:g}% good, p99 within deadline): "
                 f"{a} {ra:.1f}/s, {b} {rb:.1f}/s: {ratio}")
    lines += overload_lines([s for s in steps if s.label == a and s.phase == "warm"], a)
    return lines


def overload_lines(steps: Sequence[StepSummary], label: str) -> list[str]:
    """The overload objective of one configuration: its peak goodput (its saturation) and, at
    the step nearest twice that rate, the goodput kept and the admitted requests' server p99."""
    if not steps:
        return []
    peak = max(steps, key=lambda s: s.goodput)
    if peak.goodput <= 0:
        return []
    over = min(steps, key=lambda s: abs(s.offered_rate - 2.0 * peak.goodput))
    return [f"  {label}: peak goodput {peak.goodput:.1f}/s (at {peak.offered_rate:.1f}/s offered); at "
            f"{over.offered_rate:.1f}/s offered ({over.offered_rate / peak.goodput:.1f}x saturation) it keeps "
            f"{over.goodput:.1f}/s = {100.0 * over.goodput / peak.goodput:.0f}% of peak, admitted server p99 "
            f"{1000.0 * over.server_latency.get('p99', math.nan):.1f} ms (client {1000.0 * over.latency['p99']:.1f} ms)"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = targets_from_args(args)
        spec = _spec_from_args(args)
    except (TargetError, ArrivalError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tenant_keys = {}
    for item in args.tenant_key:
        tenant, sep, key = item.partition("=")
        if not sep:
            print(f"error: --tenant-key wants TENANT=KEY, got {item!r}", file=sys.stderr)
            return 2
        tenant_keys[tenant] = key
    options = LoadOptions(deadline_ms=args.deadline_ms, timeout_margin_s=args.timeout_margin, api_key=args.api_key,
                          tenant_keys=tenant_keys, model=args.model, seed=args.seed, preencode=not args.encode_each)
    out = ResultsDir(args.out or default_out("load"), "load")
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "tenant_key")}
    config["rates"] = spec.rates
    out.write("config", {**config, "targets": [dataclasses.asdict(t) for t in targets]})
    what = ", ".join(t.label for t in targets)
    print(f"load sweep ({what}): {spec.arrival} arrivals, rates {spec.rates or 'auto'}, "
          f"{spec.duration or 'whole trace'} s per step x {spec.repeats}, deadline {spec.deadline_ms} ms")
    costs: list[StepCost] = []
    try:
        with start_targets(targets) as running, StepRunner(options, workers=args.workers) as runner:
            steps = run_sweep(spec, running, runner, out, log=lambda line: print(line, flush=True), costs=costs)
    except RUN_ERRORS as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    requests = _read_requests(out)
    write_plots(out, steps, requests, spec.deadline_ms)
    print()
    print(step_table(steps, title="load steps (latency from scheduled send to chunk received)"))
    print()
    print(cost_table(costs, title="CPU per request sent; time to a refusal, client (from the send) and server "
                                  "(arrival to error written, histogram bucket bound)"))
    for line in comparison_lines(steps, [t.label for t in targets], spec.deadline_ms):
        print(line)
    for label in [t.label for t in targets]:
        r = sustained_rate([s for s in steps if s.label == label], spec.deadline_ms)
        out.write("sustained", {"label": label, "rate": r, "deadline_ms": spec.deadline_ms})
    print(out.listing())
    return 0


def _read_requests(out: ResultsDir) -> list[dict[str, Any]]:
    from .report import read_jsonl

    return read_jsonl(out.requests) if out.requests.exists() else []


if __name__ == "__main__":
    sys.exit(main())
