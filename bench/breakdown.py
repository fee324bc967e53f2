"""``chunkline bench breakdown``: where the time of one request goes, stage by stage.

Each side measures only its own durations (no clock synchronisation); the suite joins them per
request: client encode, send, server decode, admission, queue wait, batch wait, inference, server
encode, server other (the server's total less its stages), return, client decode and the hand-over
to a broker timeline. Without a shared clock the transport time (round trip less the server's) is
one number, split into ``send`` and ``return`` where the client's send call returned (``send`` is
capped at the transport time). Means add up across stages; percentiles do not, so the difference
between the total's p50 and the sum of the stages' p50s is shown as its own row. A run whose
generator fell behind (send lag p99 above ``--max-lag-ms``) is marked inconclusive."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.bench.help_text import plain_help

from .load import RUN_ERRORS, SweepSpec, run_sweep, step_table
from .loadgen import LoadOptions, StepRunner
from .records import OK, RequestRecord
from .report import Column, ResultsDir, default_out, format_table, read_jsonl
from .stats import percentiles
from .targets import TargetError, add_target_arguments, start_targets, targets_from_args

__all__ = ["STAGES", "stage_times", "summarize_stages", "median_remainder", "inconclusive_labels", "stage_table", "main",
           "build_parser"]

#: default --max-lag-ms: a generator this late (p99) is measuring itself.
MAX_LAG_MS = 5.0

#: stage name and its description, in path order.
STAGES: tuple[tuple[str, str], ...] = (
    ("client_encode", "client encode"),
    ("send", "send"),
    ("server_decode", "server decode"),
    ("admission", "auth / admission"),
    ("queue_wait", "queue wait"),
    ("batch_wait", "batch wait"),
    ("inference", "inference"),
    ("server_encode", "server encode"),
    ("server_other", "server other"),
    ("return", "return"),
    ("client_decode", "client decode"),
    ("handover", "broker hand-over"),
)

# Server timing keys that are separate stages, and their stage names. Optional ones are left
# out of a request's breakdown when the server does not report them.
_SERVER_STAGES = (
    ("decode_ms", "server_decode", True),
    ("admission_ms", "admission", False),
    ("queue_ms", "queue_wait", True),
    ("batch_wait_ms", "batch_wait", False),
    ("infer_ms", "inference", True),
    ("encode_ms", "server_encode", True),
)


def stage_times(server: Mapping[str, float], client: Mapping[str, float],
                handover_ms: float | None = None) -> dict[str, float]:
    """One request's stages in milliseconds, plus ``total`` (their sum).

    Args:
        server: the chunk's ``timing`` (server durations, ms).
        client: the reply's ``client_timing`` (client durations, ms).
        handover_ms: broker hand-over time, if measured.

    Raises:
        KeyError: a timing that every server and client reports is missing.
    """
    out: dict[str, float] = {"client_encode": float(client["encode_ms"])}
    server_parts = 0.0
    for key, stage, required in _SERVER_STAGES:
        if key in server:
            out[stage] = float(server[key])
            server_parts += out[stage]
        elif required:
            raise KeyError(key)
    server_ms = float(server["server_ms"])
    # What the server spent outside its named stages (validation, scheduling): shown, never hidden.
    out["server_other"] = server_ms - server_parts
    # Both sides' clocks only measure durations: the transport is the round trip less the
    # server's time, split at the client's send return (capped: see the module docstring).
    transport = float(client["round_trip_ms"]) - server_ms
    out["send"] = min(float(client["send_ms"]), max(transport, 0.0))
    out["return"] = transport - out["send"]
    out["client_decode"] = float(client["decode_ms"])
    if handover_ms is not None:
        out["handover"] = float(handover_ms)
    out["total"] = sum(out.values())
    order = {name: i for i, (name, _) in enumerate(STAGES)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def summarize_stages(rows: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per stage: ``p50``, ``p95``, ``p99``, ``mean`` (ms) and ``n`` over the requests that report it.

    Args:
        rows: :func:`stage_times` of each request.
    """
    names = [s for s, _ in STAGES] + ["total"]
    out: dict[str, dict[str, float]] = {}
    for name in names:
        values = [r[name] for r in rows if name in r and math.isfinite(r[name])]
        if not values:
            continue
        out[name] = {**percentiles(values), "mean": float(np.mean(values)), "n": float(len(values))}
    return out


def median_remainder(stats: Mapping[str, Mapping[str, float]]) -> float:
    """The total's p50 minus the sum of the stages' p50s (ms): what the medians leave unexplained.

    Not a stage of the path: medians do not add (each stage's median comes from a different
    request), so this is how far reading the stage medians as a sum would be off. Means add up.
    """
    return stats["total"]["p50"] - sum(v["p50"] for k, v in stats.items() if k != "total")


def inconclusive_labels(steps: Sequence[Any], max_lag_ms: float) -> dict[str, float]:
    """The configurations whose warm steps' generator lag p99 exceeded ``max_lag_ms``, with that lag (ms)."""
    out: dict[str, float] = {}
    for step in steps:
        lag = step.gen_lag.get("p99", math.nan) * 1000.0
        if step.phase == "warm" and lag > max_lag_ms:
            out[step.label] = max(lag, out.get(step.label, 0.0))
    return out


_REMAINDER = "p50_remainder"


def stage_table(stats: Mapping[str, Mapping[str, Mapping[str, float]]], inconclusive: Mapping[str, float] | None = None) -> str:
    """Rows: stages, the total and the median remainder; columns: p50/p95/p99/mean (ms) for each
    configuration; a configuration in ``inconclusive`` is marked so in its headers."""
    inconclusive = inconclusive or {}
    labels = list(stats)
    names = [s for s, _ in STAGES if any(s in stats[lab] for lab in labels)] + ["total", _REMAINDER]
    desc = dict(STAGES) | {"total": "total (obs to broker)", _REMAINDER: "unexplained by the p50s (medians do not add)"}

    def cell(lab: str, q: str) -> Callable[[str], float]:
        def get(n: str) -> float:
            if n == _REMAINDER:
                return median_remainder(stats[lab]) if q == "p50" else math.nan
            return stats[lab][n][q]
        return get

    cols = [Column("stage", lambda n: desc[n], align="<")]
    for lab in labels:
        mark = " (inconclusive)" if lab in inconclusive else ""
        for q in ("p50", "p95", "p99", "mean"):
            cols.append(Column((q if len(labels) == 1 else f"{lab} {q}") + mark, cell(lab, q), ".3f"))
    notes = [f"INCONCLUSIVE {lab}: the load generator fell behind (send lag p99 {lag:.1f} ms): it measured itself too;"
             " lower --rate or --robots" for lab, lag in inconclusive.items()]
    notes.append("means add up to the total; percentiles do not (each comes from different requests), hence the remainder row")
    return format_table(names, cols, title="latency breakdown per stage (ms)") + "\n" + "\n".join(notes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline bench breakdown", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser, default_policy="loadtest")
    g = parser.add_argument_group("load")
    g.add_argument("--rate", type=float, default=10.0, help="requests/s, all robots together (default 10)")
    g.add_argument("--arrival", choices=("constant", "poisson", "gamma"), default="constant", help="arrival process (default constant)")
    g.add_argument("--duration", type=float, default=10.0, help="seconds measured per configuration and repeat")
    g.add_argument("--robots", type=int, default=1, help="robot sessions (default 1)")
    g.add_argument("--deadline-ms", type=float, default=1000.0, help="deadline (default 1000: nothing refused)")
    g.add_argument("--repeats", type=int, default=1, help="measurements per configuration, alternated A B A B")
    g.add_argument("--cold-duration", type=float, default=1.0, help="seconds of the cold step (reported apart)")
    g.add_argument("--seed", type=int, default=0, help="seed of the observations and arrivals (default 0)")
    g.add_argument("--max-lag-ms", type=float, default=MAX_LAG_MS,
                   help=f"mark a configuration inconclusive when the generator's send lag p99 exceeds this (default {MAX_LAG_MS:g})")
    g.add_argument("--out", type=Path, default=None, help="results folder (default results/breakdown)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = targets_from_args(args)
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not (args.rate > 0 and args.duration > 0 and args.robots >= 1 and args.repeats >= 1):
        print("error: --rate and --duration must be > 0, --robots and --repeats >= 1", file=sys.stderr)
        return 2
    spec = SweepSpec(rates=[args.rate], arrival=args.arrival, duration=args.duration, robots=args.robots,
                     deadline_ms=args.deadline_ms, repeats=args.repeats, cold_duration=args.cold_duration,
                     seed=args.seed)
    out = ResultsDir(args.out or default_out("breakdown"), "breakdown")
    out.write("config", {k: v for k, v in vars(args).items() if k != "api_key"})
    print(f"latency breakdown ({', '.join(t.label for t in targets)}): {args.rate:g} requests/s, "
          f"{args.robots} robot(s), {args.duration:g} s x {args.repeats}")
    options = LoadOptions(deadline_ms=args.deadline_ms, api_key=args.api_key, handover=True, seed=args.seed)
    try:
        with start_targets(targets) as running, StepRunner(options) as runner:
            steps = run_sweep(spec, running, runner, out, log=lambda line: print(line, flush=True))
    except RUN_ERRORS as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    cdf: dict[str, list[float]] = {}
    for d in read_jsonl(out.requests):
        r = RequestRecord.from_dict(d)
        if r.outcome != OK:
            continue
        try:
            st = stage_times(r.server, r.client, r.handover_ms)
        except KeyError:
            continue  # an older server without one of the timings: not joinable
        rows.setdefault((d["label"], d["phase"]), []).append(st)
        cdf.setdefault(f"{d['label']} {d['phase']}", []).append(st["total"] / 1000.0)
    stats = {label: summarize_stages(rows.get((label, "warm"), [])) for label in (t.label for t in targets)}
    cold = {label: summarize_stages(rows.get((label, "cold"), [])) for label in (t.label for t in targets)}
    inconclusive = inconclusive_labels(steps, args.max_lag_ms)
    for label in stats:
        out.write("stages", {"label": label, "phase": "warm", "stages": stats[label], "inconclusive": label in inconclusive,
                             "gen_lag_p99_ms": inconclusive.get(label)})
        if cold[label]:
            out.write("stages", {"label": label, "phase": "cold", "stages": cold[label]})

    from . import plots

    if any(stats.values()):
        plots.plot_stage_breakdown({k: v for k, v in stats.items() if v}, out.file("stage_breakdown.png"),
                                   order=[s for s, _ in STAGES])
    if cdf:
        plots.plot_latency_cdf(cdf, out.file("latency_cdf.png"), title="client-side: observation to broker (sum of stages)")
    print()
    print(step_table(steps, title="steps"))
    print()
    if any(stats.values()):
        print(stage_table({k: v for k, v in stats.items() if v}, inconclusive))
    else:
        print("no request completed: no breakdown")
    print(out.listing())
    return 0 if any(stats.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
