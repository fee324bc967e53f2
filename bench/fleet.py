"""Fleet capacity: how many robots one server serves within deadline, batching vs one at a time.

Robots each send at a fixed inference rate (default 10 Hz, evenly staggered, open loop) with a
deadline (default 100 ms); the robot count grows until the p99 observation-to-chunk latency
exceeds the deadline or more than 1% of requests miss it. Both configurations are measured in
one run, alternating A B A B at every robot count. Each step also reports the CPU a request
cost the server (all of it, and its event loop alone) and the generator.

``--baseline-src DIR`` (``git archive REV | tar -x -C DIR``) compares against that checkout
serving the same arguments instead: new / base ratios of server CPU per request and latency.

    chunkline bench fleet [--robots 4,8,16,...] [--server-args "--max-batch-size 16"]
                          [--baseline-args "--max-batch-size 1"] [--policy loadtest]
    chunkline bench fleet --baseline-src DIR   # this checkout against DIR's, same arguments
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.bench.help_text import plain_help

from .arrivals import ConstantArrivals, schedule
from .loadgen import LoadOptions, StepRunner
from .records import summarize
from .report import Column, ResultsDir, default_out, format_table
from .targets import RunningTarget, Target, add_target_arguments, alternation, start_targets, targets_from_args

__all__ = ["main", "served", "paired_ratios"]


def served(step: dict[str, Any], deadline_ms: float, max_miss: float = 0.01) -> bool:
    """Whether a step met the fleet objective: p99 within deadline and at most ``max_miss`` missed."""
    p99 = step["latency"]["p99"]
    missed = 1.0 - step["good"] / step["offered"] if step["offered"] else 1.0
    return p99 == p99 and p99 * 1000.0 <= deadline_ms and missed <= max_miss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench fleet", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(parser)
    # Defaults for servers this suite starts; a side given as --uri/--baseline-uri takes none.
    parser.set_defaults(server_args=None, baseline_args=None)
    parser.add_argument("--robots", default="4,8,12,16,24,32,48,64",
                        help="robot counts to try, ascending; a count given more than once is compared by its medians")
    parser.add_argument("--rate-hz", type=float, default=10.0, help="inferences per second per robot")
    parser.add_argument("--deadline-ms", type=float, default=100.0)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per step")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="seconds of the first robot count each server serves, in turn, before measuring (not "
                             "recorded): each then times its batch sizes in a quiet spell, as a server serving a while has")
    parser.add_argument("--workers", type=int, default=1, help="load-generator processes")
    parser.add_argument("--encode-each", action="store_true",
                        help="encode every request's observation anew, as a robot does (default: each robot's "
                             "observation is packed once and its bytes re-sent, sparing the shared CPU)")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="a checkout of another revision as the baseline, serving the same arguments "
                             "(or --baseline-args), alternated A B A B")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.server_args is None:
        args.server_args = "" if args.uri else "--max-batch-size 16"
    if args.baseline_src is not None:
        if args.baseline_uri:
            parser.error("--baseline-src and --baseline-uri: give one baseline")
        if args.baseline_args is None:
            args.baseline_args = args.server_args
        args.label, args.baseline_label = args.label or "new", args.baseline_label or f"base ({args.baseline_src})"
    elif args.baseline_args is None and not args.baseline_uri:
        args.baseline_args = "--max-batch-size 1"
    args.label, args.baseline_label = args.label or "batching", args.baseline_label or "one-at-a-time"
    counts = [int(x) for x in args.robots.split(",")]
    out = ResultsDir(args.out or default_out("fleet"), "fleet")
    steps: list[dict[str, Any]] = []
    options = LoadOptions(deadline_ms=args.deadline_ms, preencode=not args.encode_each)
    with contextlib.ExitStack() as stack:
        targets = targets_from_args(args)
        if args.baseline_src is not None:
            from .overhead import baseline_env

            farm = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "baseline"
            targets[1] = dataclasses.replace(targets[1], env=tuple(baseline_env(args.baseline_src, farm).items()))
        running = stack.enter_context(start_targets(targets))
        runner = stack.enter_context(StepRunner(options, workers=args.workers))
        _measure(args, counts, running, runner, steps, out)
    return _report(args, targets, steps, out)


def _measure(args: argparse.Namespace, counts: list[int], running: list[RunningTarget], runner: StepRunner,
             steps: list[dict[str, Any]], out: ResultsDir) -> None:
    """Every robot count, each configuration in turn (until two counts in a row failed it)."""
    failing: dict[str, int] = {t.label: 0 for t in running}
    if args.warmup > 0:
        for t in running:
            runner.run(t.uri, schedule(ConstantArrivals(counts[0] * args.rate_hz), args.warmup, counts[0],
                                       deadline_ms=args.deadline_ms), pid=t.pid)
    for n in counts:
        for _, label in alternation([t.label for t in running], 1):
            if failing[label] >= 2:
                continue  # two robot counts in a row failed: this configuration is saturated
            target = next(t for t in running if t.label == label)
            arrivals = schedule(ConstantArrivals(n * args.rate_hz), args.duration, n, deadline_ms=args.deadline_ms)
            result = runner.run(target.uri, arrivals, pid=target.pid)
            step = summarize(result.records, duration=args.duration, label=label, rate=n * args.rate_hz,
                             server_cpu_percent=result.usage.cpu_percent, server_rss_mb=result.usage.rss_mb).as_dict()
            step["robots"] = n
            step["served"] = served(step, args.deadline_ms)
            # CPU per request: what stays trustworthy when other jobs share the machine.
            step.update({f"{k}_cpu_per_request": v for k, v in result.cpu_per_request().items()})
            failing[label] = 0 if step["served"] else failing[label] + 1
            steps.append(step)
            out.write("step", step)
            print(f"  {label:>14}  robots {n:3d}  p99 {step['latency']['p99'] * 1000:7.1f} ms  "
                  f"good {step['good']}/{step['offered']}  batch {step['mean_batch_size']:.2f}  "
                  f"cpu/req server {step['server_ms_cpu_per_request']:.2f} ms  "
                  f"{'served' if step['served'] else 'NOT served'}", file=sys.stderr)


def paired_ratios(steps: list[dict[str, Any]], first: str, second: str) -> list[dict[str, float]]:
    """Per robot count both configurations ran: ``first`` / ``second`` of server CPU per request
    (all of it, and the event loop's), and of the latency's p50 and p99; a count given more than
    once (``--robots 4,4,4``) compares the medians over its repeats (``repeats``: the fewer)."""
    def figures(s: dict[str, Any]) -> tuple[float, float, float, float]:
        return (s["server_ms_cpu_per_request"], s["server_loop_ms_cpu_per_request"], s["latency"]["p50"], s["latency"]["p99"])

    by: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for s in steps:
        by.setdefault((s["label"], s["robots"]), []).append(figures(s))
    out = []
    for n in sorted({s["robots"] for s in steps}):
        a, b = by.get((first, n)), by.get((second, n))
        if not a or not b:
            continue
        ratio = [float(x / y) for x, y in zip(np.median(a, axis=0), np.median(b, axis=0), strict=True)]
        out.append({"robots": n, "repeats": min(len(a), len(b)), "server_cpu_per_request": ratio[0],
                    "loop_cpu_per_request": ratio[1], "p50": ratio[2], "p99": ratio[3]})
    return out


def _report(args: argparse.Namespace, targets: list[Target], steps: list[dict[str, Any]], out: ResultsDir) -> int:
    best = {t.label: max([s["robots"] for s in steps if s["label"] == t.label and s["served"]], default=0) for t in targets}
    columns = [
        Column("config", lambda s: s["label"], align="<"),
        Column("robots", lambda s: s["robots"]),
        Column("offered/s", lambda s: s["offered_rate"], ".0f"),
        Column("goodput/s", lambda s: s["goodput"], ".0f"),
        Column("p50 ms", lambda s: s["latency"]["p50"] * 1000, ".1f"),
        Column("p99 ms", lambda s: s["latency"]["p99"] * 1000, ".1f"),
        Column("missed %", lambda s: 100 * (1 - s["good"] / s["offered"]) if s["offered"] else 100.0, ".1f"),
        Column("batch", lambda s: s["mean_batch_size"], ".2f"),
        Column("server cpu %", lambda s: s["server_cpu_percent"], ".0f"),
        Column("srv cpu ms/req", lambda s: s["server_ms_cpu_per_request"], ".2f"),
        Column("loop ms/req", lambda s: s["server_loop_ms_cpu_per_request"], ".2f"),
        Column("gen ms/req", lambda s: s["generator_ms_cpu_per_request"], ".2f"),
        Column("served", lambda s: "yes" if s["served"] else "no", align="<"),
    ]
    print(format_table(sorted(steps, key=lambda s: (s["label"], s["robots"])), columns,
                       title=f"fleet capacity: {args.rate_hz:g} Hz per robot, deadline {args.deadline_ms:g} ms"))
    labels = [t.label for t in targets]
    summary: dict[str, Any] = {"served": best}
    if len(labels) == 2 and best[labels[1]]:
        summary["ratio"] = best[labels[0]] / best[labels[1]]
    print("robots served: " + ", ".join(f"{k} {v}" for k, v in best.items())
          + (f"  ({summary['ratio']:.2f}x)" if "ratio" in summary else ""))
    if len(labels) == 2:
        summary["paired"] = paired = paired_ratios(steps, labels[0], labels[1])
        for r in paired:
            print(f"{labels[0]} / {labels[1]} at {r['robots']} robots (median of {r['repeats']}): server cpu per request "
                  f"{r['server_cpu_per_request']:.2f} (loop {r['loop_cpu_per_request']:.2f}), p50 {r['p50']:.2f}, p99 {r['p99']:.2f}")
    out.write("summary", summary)
    try:
        from .plots import plot_goodput_vs_load, plot_latency_vs_load

        plot_latency_vs_load(steps, out.file("latency_vs_load.png"), deadline_ms=args.deadline_ms)
        plot_goodput_vs_load(steps, out.file("goodput_vs_load.png"))
    except ImportError:
        pass
    print(f"results in {out.path}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
