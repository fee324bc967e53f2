"""``chunkline capacity`` (also ``chunkline bench capacity``): how many replicas a fleet needs,
and what each in-deadline chunk costs.

1. **Service curve**: the policy is loaded on this machine (or ``--device``) and timed at each
   batch size, the sizes measured in interleaved rounds so that machine noise spreads evenly.
2. **Plan**: a replica that batches dynamically stays busy and lets the batch grow with the
   load; a request may wait for the batch in progress and then for its own, so a batch size
   ``b`` is usable when ``2 * s(b) <= deadline``. The best usable size has the lowest
   per-request service time ``t = s(b) / b``, and the fleet needs at least
   ``ceil(peak_rate * t / utilisation_cap)`` replicas, with
   ``peak_rate = robots * rate_hz * peak_factor``.
3. **Check**: one replica is started and offered its share of the fleet's load (open loop,
   Poisson arrivals, the fleet's deadline) at the mean and at the peak. If at the peak fewer
   than ``--target-good`` of the requests come back within the deadline, or p99 exceeds it,
   the count grows by one (a smaller share each) and the check repeats.
4. **Cost**: every replica is paid for all the time, busy or idle, so the cost per qualified
   result (a chunk delivered within its deadline) is
   ``replicas * price_per_device_hour / (mean_rate * 3600 * qualified_fraction)``, where
   the qualified fraction is the share of good requests measured at the mean load.

    chunkline capacity --policy loadtest --robots 40 --rate-hz 2 --deadline-ms 200 \\
        --peak-factor 1.5 --utilisation-cap 0.8 --price-per-device-hour 2.5 --out results/capacity
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
    "check_passes",
    "add_capacity_parser",
    "build_parser",
    "main",
    "run",
]

#: a usable batch size satisfies ``LATENCY_FACTOR * s(b) <= deadline`` (wait for the batch in
#: progress, then one's own).
LATENCY_FACTOR = 2.0


class CapacityError(ValueError):
    """The fleet cannot be planned: bad parameters, or no batch size meets the deadline."""


@dataclasses.dataclass(frozen=True)
class ServicePoint:
    """Time to serve one batch of ``batch_size`` on this device.

    Args:
        batch_size: requests per forward pass.
        seconds: median time of one batch.
        p90: 90th percentile time of one batch.
        samples: batches timed.
    """

    batch_size: int
    seconds: float
    p90: float
    samples: int

    @property
    def per_request(self) -> float:
        """Service time per request at this batch size: ``seconds / batch_size``."""
        return self.seconds / self.batch_size

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "per_request": self.per_request}


@dataclasses.dataclass(frozen=True)
class Fleet:
    """The robots to serve.

    Args:
        robots: how many robots.
        rate_hz: inference requests per robot per second.
        deadline_ms: each request's deadline.
        peak_factor: peak load over mean load (>= 1).
        utilisation_cap: the busiest a replica may be planned at, in ``(0, 1]``.
    """

    robots: int
    rate_hz: float
    deadline_ms: float
    peak_factor: float = 1.5
    utilisation_cap: float = 0.8

    def __post_init__(self) -> None:
        if self.robots < 1:
            raise CapacityError(f"robots must be >= 1, got {self.robots}")
        for name in ("rate_hz", "deadline_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise CapacityError(f"{name} must be > 0, got {v}")
        if not (math.isfinite(self.peak_factor) and self.peak_factor >= 1):
            raise CapacityError(f"peak_factor must be >= 1, got {self.peak_factor}")
        if not 0 < self.utilisation_cap <= 1:
            raise CapacityError(f"utilisation_cap must be in (0, 1], got {self.utilisation_cap}")

    @property
    def mean_rate(self) -> float:
        """Requests per second, on average."""
        return self.robots * self.rate_hz

    @property
    def peak_rate(self) -> float:
        """Requests per second at the peak."""
        return self.mean_rate * self.peak_factor


@dataclasses.dataclass(frozen=True)
class Plan:
    """A replica count for a fleet and what it leaves spare.

    Args:
        fleet: the fleet.
        batch_size: the batch size the plan assumes at full load.
        batch_service_s: ``s(b)``, one batch's time.
        service_time_s: ``s(b) / b``, per request.
        lower_bound: ``ceil(peak_rate * service_time_s / utilisation_cap)``.
        replicas: the planned count (the lower bound, or more after a failed check).
    """

    fleet: Fleet
    batch_size: int
    batch_service_s: float
    service_time_s: float
    lower_bound: int
    replicas: int

    @property
    def replica_capacity(self) -> float:
        """Requests per second one replica serves at 100 % busy."""
        return 1.0 / self.service_time_s

    @property
    def utilisation_at_peak(self) -> float:
        return self.fleet.peak_rate * self.service_time_s / self.replicas

    @property
    def utilisation_at_mean(self) -> float:
        return self.fleet.mean_rate * self.service_time_s / self.replicas

    @property
    def headroom_at_peak(self) -> float:
        """Fraction of the fleet's capacity still free at the peak."""
        return 1.0 - self.utilisation_at_peak

    @property
    def share_mean(self) -> float:
        """Requests per second one replica receives at the mean."""
        return self.fleet.mean_rate / self.replicas

    @property
    def share_peak(self) -> float:
        return self.fleet.peak_rate / self.replicas

    def with_replicas(self, replicas: int) -> Plan:
        return dataclasses.replace(self, replicas=replicas)

    def as_dict(self) -> dict[str, Any]:
        return {
            "fleet": {**dataclasses.asdict(self.fleet), "mean_rate": self.fleet.mean_rate, "peak_rate": self.fleet.peak_rate},
            "batch_size": self.batch_size,
            "batch_service_s": self.batch_service_s,
            "service_time_s": self.service_time_s,
            "lower_bound": self.lower_bound,
            "replicas": self.replicas,
            "replica_capacity": self.replica_capacity,
            "utilisation_at_peak": self.utilisation_at_peak,
            "utilisation_at_mean": self.utilisation_at_mean,
            "headroom_at_peak": self.headroom_at_peak,
        }


def measure_service_curve(policy: Any, batch_sizes: Sequence[int], *, repeats: int = 5, warmup: int = 1,
                          seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                          progress: Progress | None = None) -> list[ServicePoint]:
    """Time ``policy.infer_batch`` at each batch size.

    Sizes are measured in ``repeats`` interleaved rounds (1, 2, 4, ..., 1, 2, 4, ...), not one
    after the other, so that a burst of machine noise does not fall on one size only.

    Args:
        policy: a loaded :class:`~chunkline.policies.base.Policy` (warmed up or not).
        batch_sizes: sizes to measure (>= 1).
        repeats: timed batches per size.
        warmup: untimed batches per size first (first-call compilation, allocator growth).
        seed: observation contents.
        clock: seconds.
        progress: advanced by one per timed batch.
    """
    from chunkline.policies.base import example_observation, stack_observations

    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise CapacityError("batch sizes must be >= 1")
    if repeats < 1:
        raise CapacityError("repeats must be >= 1")
    rng = np.random.default_rng(seed)
    spec = policy.spec
    one = [example_observation(spec, rng) for _ in range(max(sizes))]
    batches = {b: stack_observations(spec, one[:b]) for b in sizes}
    for b in sizes:
        for _ in range(warmup):
            policy.infer_batch(batches[b])
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(repeats):
        for b in sizes:
            t = clock()
            policy.infer_batch(batches[b])
            times[b].append(clock() - t)
            if progress is not None:
                progress.update(advance=1, extra=f"batch {b}")
    return [ServicePoint(batch_size=b, seconds=float(np.median(times[b])), p90=float(np.percentile(times[b], 90)),
                         samples=len(times[b])) for b in sizes]


def replicas_lower_bound(peak_rate: float, service_time_s: float, utilisation_cap: float) -> int:
    """``ceil(peak_rate * service_time_s / utilisation_cap)``, at least 1.

    Args:
        peak_rate: requests per second at the peak.
        service_time_s: seconds of one replica per request.
        utilisation_cap: the busiest a replica may be, in ``(0, 1]``.
    """
    if not (peak_rate >= 0 and service_time_s > 0 and 0 < utilisation_cap <= 1):
        raise CapacityError("need peak_rate >= 0, service_time_s > 0 and utilisation_cap in (0, 1]")
    load = peak_rate * service_time_s / utilisation_cap
    # Rounding noise (e.g. 2.0000000000000004) must not cost a whole replica.
    return max(1, math.ceil(load - 1e-9))


def plan_capacity(curve: Sequence[ServicePoint], fleet: Fleet) -> Plan:
    """The fewest replicas for ``fleet`` from a service curve (the lower bound; see the module
    docstring for the batch-size rule).

    Raises:
        CapacityError: an empty curve, or no batch size with ``2 * s(b) <= deadline``.
    """
    if not curve:
        raise CapacityError("the service curve is empty")
    deadline_s = fleet.deadline_ms / 1000.0
    usable = [p for p in curve if LATENCY_FACTOR * p.seconds <= deadline_s]
    if not usable:
        fastest = min(curve, key=lambda p: p.seconds)
        raise CapacityError(
            f"no batch size meets the deadline: the fastest batch (size {fastest.batch_size}) takes "
            f"{fastest.seconds * 1000:.1f} ms, and a request may wait for one batch before its own, so the deadline "
            f"must be at least {LATENCY_FACTOR * fastest.seconds * 1000:.1f} ms on this device")
    best = min(usable, key=lambda p: (p.per_request, p.batch_size))
    lb = replicas_lower_bound(fleet.peak_rate, best.per_request, fleet.utilisation_cap)
    return Plan(fleet=fleet, batch_size=best.batch_size, batch_service_s=best.seconds, service_time_s=best.per_request,
                lower_bound=lb, replicas=lb)


def cost_per_qualified_result(replicas: int, price_per_device_hour: float, mean_rate: float,
                              qualified_fraction: float) -> float:
    """Money per in-deadline result, idle capacity included.

    Args:
        replicas: devices paid for, all the time.
        price_per_device_hour: price of one device for an hour.
        mean_rate: requests per second the fleet sends on average.
        qualified_fraction: share of requests answered within their deadline (or objective).

    Returns:
        ``replicas * price / (mean_rate * 3600 * qualified_fraction)``; ``inf`` when nothing qualifies.
    """
    if replicas < 0 or price_per_device_hour < 0 or mean_rate < 0 or not 0 <= qualified_fraction <= 1:
        raise CapacityError("replicas, price and rate must be >= 0 and the qualified fraction in [0, 1]")
    per_hour = mean_rate * 3600.0 * qualified_fraction
    if per_hour == 0:
        return math.inf
    return replicas * price_per_device_hour / per_hour


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
    g.add_argument("--backend", default=None, choices=["torch", "jax", "numpy"])
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/capacity)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkline capacity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return parser


def add_capacity_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``chunkline capacity`` (runs :func:`run` with the parsed arguments)."""
    parser = subparsers.add_parser("capacity", help="replicas needed for a fleet, and the cost per in-deadline chunk",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
               "inconclusive": bool(checks and checks[-1].inconclusive)}
    out.write("result", summary)

    lines = [f"# capacity plan: {args.policy} on {args.device}", "", "```", _curve_table(curve, plan.batch_size), "```", ""]
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
        lines += ["", f"- cost per qualified result: {cost:.6g} per chunk within deadline "
                      f"({1000 * cost:.4g} per thousand) at {args.price_per_device_hour:g} per device-hour, "
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
