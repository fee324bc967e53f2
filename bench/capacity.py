"""``chunkline capacity`` (also ``chunkline bench capacity``): how many replicas a fleet needs, and
what each in-deadline chunk costs.

1. Service curve: the policy timed at each batch size, sizes interleaved round by round.
2. Plan: a size ``b`` is usable when ``2 * s(b) <= deadline`` (a request may wait for the batch in
   progress, then its own); the usable size with the lowest ``s(b) / b`` sets the lower bound
   ``ceil(peak_rate * t / utilisation_cap)`` replicas.
3. Check: one replica offered its share at the mean and the peak (open loop, Poisson); short of
   ``--target-good`` or a p99 past the deadline, one more replica and again.
4. Cost: ``replicas * price_per_device_hour / (mean_rate * 3600 * qualified_fraction)`` per chunk
   within deadline. Steps 1, 2 and 4 are :mod:`chunkline.bench.capacity_plan`; this is the check
   and the command."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chunkline.bench.help_text import plain_help

from .capacity_plan import (
    CapacityError,
    Fleet,
    Plan,
    ServicePoint,
    cost_per_qualified_result,
    curve_warnings,
    format_cost,
    measure_service_curve,
    plan_capacity,
    replicas_lower_bound,
)
from .load import RUN_ERRORS, SweepSpec, run_sweep, step_table
from .loadgen import LoadOptions, StepRunner
from .records import StepSummary
from .report import Column, Progress, ResultsDir, default_out, format_table
from .targets import Target, start_targets

__all__ = [
    "CapacityError",
    "ServicePoint",
    "Fleet",
    "Plan",
    "CheckResult",
    "measure_service_curve",
    "replicas_lower_bound",
    "plan_capacity",
    "cost_per_qualified_result",
    "curve_warnings",
    "format_cost",
    "check_passes",
    "add_capacity_parser",
    "build_parser",
    "main",
    "run",
]


@dataclasses.dataclass
class CheckResult:
    """One replica count checked by an open-loop sweep.

    Args:
        replicas: the count checked.
        mean: the step at the mean share.
        peak: the step at the peak share.
        passed: the peak step met the target.
        inconclusive: the load generator fell behind its schedule (this machine, not the server).
    """

    replicas: int
    mean: StepSummary
    peak: StepSummary
    passed: bool
    inconclusive: bool

    def as_dict(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "passed": self.passed, "inconclusive": self.inconclusive,
                "mean": self.mean.as_dict(), "peak": self.peak.as_dict()}


def check_passes(step: StepSummary, deadline_ms: float, target_good: float) -> bool:
    """At least ``target_good`` of the offered requests good, and p99 within the deadline."""
    return step.goodput_ratio >= target_good and step.latency["p99"] * 1000.0 <= deadline_ms


def _curve_table(curve: Sequence[ServicePoint], chosen: int | None) -> str:
    cols = [
        Column("batch", lambda p: p.batch_size),
        Column("batch ms (median)", lambda p: p.seconds * 1000, ".2f"),
        Column("batch ms (p90)", lambda p: p.p90 * 1000, ".2f"),
        Column("ms/request", lambda p: p.per_request * 1000, ".3f"),
        Column("req/s at 100%", lambda p: 1.0 / p.per_request, ".1f"),
        Column("plan", lambda p: "<- chosen" if p.batch_size == chosen else "", align="<"),
    ]
    return format_table(curve, cols, title="service curve")


def _plan_lines(plan: Plan) -> list[str]:
    f = plan.fleet
    return [
        f"fleet: {f.robots} robots x {f.rate_hz:g} Hz = {f.mean_rate:.1f} requests/s mean, "
        f"{f.peak_rate:.1f} at peak (x{f.peak_factor:g}); deadline {f.deadline_ms:g} ms; utilisation cap {f.utilisation_cap:.0%}",
        f"batch size {plan.batch_size}: {plan.batch_service_s * 1000:.2f} ms per batch, "
        f"{plan.service_time_s * 1000:.3f} ms per request, {plan.replica_capacity:.1f} requests/s per replica at 100%",
        f"lower bound: ceil({f.peak_rate:.1f} x {plan.service_time_s:.5f} / {f.utilisation_cap:g}) = {plan.lower_bound}",
        f"replicas: {plan.replicas}; utilisation {plan.utilisation_at_mean:.0%} at mean, {plan.utilisation_at_peak:.0%} at peak; "
        f"headroom at peak {plan.headroom_at_peak:.0%}",
    ]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("policy")
    g.add_argument("--policy", default="loadtest", help="policy reference (default loadtest)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--backend", default=None, choices=["torch", "jax", "numpy"],
                   help="implementation of an embedded policy (default: torch if installed)")
    g.add_argument("--batch-sizes", default="1,2,4,8,16", help="batch sizes to time (default 1,2,4,8,16)")
    g.add_argument("--repeats", type=int, default=9, help="timed batches per size (default 9)")
    f = parser.add_argument_group("fleet")
    f.add_argument("--robots", type=int, required=True, help="robots to serve")
    f.add_argument("--rate-hz", type=float, required=True, help="inference requests per robot per second")
    f.add_argument("--deadline-ms", type=float, required=True, help="each request's deadline")
    f.add_argument("--peak-factor", type=float, default=1.5, help="peak load over mean load (default 1.5)")
    f.add_argument("--utilisation-cap", type=float, default=0.8, help="busiest a replica may be planned at (default 0.8)")
    f.add_argument("--price-per-device-hour", type=float, default=None, help="price of one device-hour (cost per result)")
    c = parser.add_argument_group("check")
    c.add_argument("--no-check", dest="check", action="store_false", help="plan only; skip the open-loop check")
    c.add_argument("--check-duration", type=float, default=10.0, help="seconds per check step (default 10)")
    c.add_argument("--target-good", type=float, default=0.99, help="share of requests in deadline at the peak (default 0.99)")
    c.add_argument("--max-extra-replicas", type=int, default=2, help="how far above the lower bound to check (default 2)")
    c.add_argument("--server-args", default="", metavar="ARGS",
                   help="extra 'chunkline serve' arguments for the checked replica (e.g. its batching settings)")
    c.add_argument("--robots-per-replica", type=int, default=None,
                   help="sessions in the check (default: the fleet's robots divided among the replicas, at most 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the observations and arrivals (default 0)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/capacity)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline capacity", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return parser


def add_capacity_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``chunkline capacity`` (runs :func:`run` with the parsed arguments)."""
    parser = subparsers.add_parser("capacity", help="replicas needed for a fleet, and the cost per in-deadline chunk",
                                   description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CapacityError(f"--batch-sizes wants integers separated by commas, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise CapacityError("batch sizes must be >= 1")
    return sizes


def _check(plan: Plan, args: argparse.Namespace, out: ResultsDir) -> list[CheckResult]:
    """Start one replica and offer it its share at the mean and the peak, for growing counts."""
    import shlex

    fleet = plan.fleet
    serve = ["--policy", args.policy, "--device", args.device, *(["--backend", args.backend] if args.backend else []),
             *shlex.split(args.server_args)]
    results: list[CheckResult] = []
    options = LoadOptions(deadline_ms=fleet.deadline_ms, seed=args.seed)
    with start_targets([Target(label="replica", server_args=tuple(serve))]) as running, StepRunner(options) as runner:
        replicas = plan.replicas
        cold = 1.0
        while True:
            p = plan.with_replicas(replicas)
            sessions = args.robots_per_replica or max(1, min(64, math.ceil(fleet.robots / replicas)))
            spec = SweepSpec(rates=[p.share_mean, p.share_peak], arrival="poisson", duration=args.check_duration,
                             robots=sessions, deadline_ms=fleet.deadline_ms, cold_duration=cold, seed=args.seed)
            print(f"check: {replicas} replica(s): one replica at {p.share_mean:.1f} (mean) and "
                  f"{p.share_peak:.1f} (peak) requests/s, {sessions} sessions", flush=True)
            # One label per count, so the plots show each count's steps as its own line.
            replica = [dataclasses.replace(running[0], target=dataclasses.replace(running[0].target,
                                                                                   label=f"{replicas} replicas"))]
            steps = run_sweep(spec, replica, runner, out, log=lambda line: print(line, flush=True))
            cold = 0.0  # the server is warm from here on
            warm = [s for s in steps if s.phase == "warm"]
            mean, peak = warm[0], warm[1]
            passed = check_passes(peak, fleet.deadline_ms, args.target_good)
            # The generator shares this machine: if it fell behind its own schedule, a failure
            # says more about the machine than about the replica.
            lag = peak.gen_lag["p99"] * 1000.0
            inconclusive = not (lag <= 0.1 * fleet.deadline_ms)
            result = CheckResult(replicas=replicas, mean=mean, peak=peak, passed=passed, inconclusive=inconclusive)
            results.append(result)
            out.write("check", result.as_dict())
            if passed or replicas >= plan.lower_bound + args.max_extra_replicas:
                return results
            replicas += 1


def run(args: argparse.Namespace) -> int:
    """Run the planner with parsed arguments (``chunkline capacity``)."""
    try:
        fleet = Fleet(robots=args.robots, rate_hz=args.rate_hz, deadline_ms=args.deadline_ms,
                      peak_factor=args.peak_factor, utilisation_cap=args.utilisation_cap)
        sizes = _batch_sizes(args.batch_sizes)
        if not 0 < args.target_good <= 1:
            raise CapacityError("--target-good must be in (0, 1]")
    except CapacityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = ResultsDir(args.out or default_out("capacity"), "capacity")
    out.write("config", {k: v for k, v in vars(args).items() if k != "func"})

    from chunkline.policies.registry import load_policy

    print(f"measuring the service curve of {args.policy} on {args.device} ...", flush=True)
    policy = load_policy(args.policy, device=args.device, backend=args.backend)
    try:
        policy.warmup()
        curve = measure_service_curve(policy, sizes, repeats=args.repeats, seed=args.seed,
                                      progress=Progress(len(sizes) * args.repeats, "service curve"))
    finally:
        policy.close()
    for p in curve:
        out.write("service_point", p.as_dict())
    warnings = curve_warnings(curve)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    try:
        plan = plan_capacity(curve, fleet)
    except CapacityError as exc:
        print(_curve_table(curve, None))
        print(f"error: {exc}", file=sys.stderr)
        out.write("plan", {"error": str(exc)})
        return 1
    out.write("plan", {**plan.as_dict(), "verified": None})

    from . import plots

    plots.plot_service_curve([p.as_dict() for p in curve], out.file("service_curve.png"), chosen=plan.batch_size,
                             deadline_ms=fleet.deadline_ms)
    checks: list[CheckResult] = []
    if args.check:
        try:
            checks = _check(plan, args, out)
        except RUN_ERRORS as exc:
            print(f"error: the check could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        steps = [s.as_dict() for c in checks for s in (c.mean, c.peak)]
        plots.plot_latency_vs_load(steps, out.file("check_latency_vs_load.png"), deadline_ms=fleet.deadline_ms)
        plots.plot_goodput_vs_load(steps, out.file("check_goodput_vs_load.png"))
    final = plan.with_replicas(checks[-1].replicas) if checks else plan
    verified = checks[-1].passed if checks else None
    qualified = checks[-1].mean.goodput_ratio if checks else 1.0
    cost = (cost_per_qualified_result(final.replicas, args.price_per_device_hour, fleet.mean_rate, qualified)
            if args.price_per_device_hour is not None else None)
    summary = {**final.as_dict(), "verified": verified, "qualified_fraction": qualified,
               "qualified_fraction_measured": bool(checks), "price_per_device_hour": args.price_per_device_hour,
               "cost_per_qualified_result": cost,
               "curve_warnings": warnings,
               "inconclusive": bool(checks and checks[-1].inconclusive)}
    out.write("result", summary)

    lines = [f"# capacity plan: {args.policy} on {args.device}", "", "```", _curve_table(curve, plan.batch_size), "```", ""]
    lines += [f"- WARNING: {w}" for w in warnings]
    lines += [f"- {line}" for line in _plan_lines(final)]
    if checks:
        lines += ["", "## check (one replica, its share of the load, open loop, Poisson arrivals)", "", "```",
                  step_table([s for c in checks for s in (c.mean, c.peak)]), "```", ""]
        for c in checks:
            verdict = "passed" if c.passed else "failed"
            note = " (inconclusive: the load generator fell behind its schedule on this machine)" if c.inconclusive else ""
            lines.append(f"- {c.replicas} replica(s): {verdict} at the peak: {100 * c.peak.goodput_ratio:.1f}% good "
                         f"(target {100 * args.target_good:g}%), p99 {c.peak.latency['p99'] * 1000:.1f} ms{note}")
        if not checks[-1].passed:
            lines.append(f"- not verified within {args.max_extra_replicas} replicas above the lower bound: "
                         "measure on the target device, or relax the deadline or the cap")
    else:
        lines.append("- not checked (--no-check): the replica count is the lower bound only")
    if cost is not None:
        lines += ["", f"- cost per qualified result: {format_cost(cost)} within deadline, in the currency of "
                      f"--price-per-device-hour ({args.price_per_device_hour:g} per device-hour), "
                      f"{final.replicas} replica(s) paid around the clock (idle capacity included), "
                      f"{100 * qualified:.1f}% of requests qualified" + ("" if checks else " (assumed: not checked)")]
    report = "\n".join(lines) + "\n"
    out.write_text("report.md", report)
    print()
    print(report)
    print(out.listing())
    return 0 if (verified is None or verified) else 1


def main(argv: list[str] | None = None) -> int:
    """``chunkline bench capacity ...``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
