"""``chunkline bench fleet-contention``: a fleet of robots sharing one accelerator, scored by
what the fleet gets done (FleetVLA's metrics: :mod:`.metrics`).

A real server over loopback on a policy that takes the workload's batch latency, a real client
and :class:`~chunkline.broker.Broker` per robot (:mod:`.wallclock`), or the same sans-I/O cores on
an injected clock (``--mode des``, :mod:`.des`); A/B against ``--baseline``, alternating, medians
over ``--runs``. The headline uses FleetVLA's rows (from the tick after the observation) and
credits each robot the lesser of what its broker ran and what FleetVLA's executor would run from
the same chunks (:class:`.metrics.IndexedReplay`); ``/obs`` keeps chunkline's own rows (the first
due at the observation's tick). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkline.bench.help_text import plain_help
from chunkline.broker import BrokerConfig, MergeMode

from .metrics import FleetMetrics, fleet_metrics
from .workload import ROWS_FROM, SHIPPED, Robot, Workload, load_workload

__all__ = ["main", "defaults_for", "before_for", "meets"]

#: the issue's targets for the equal-weights Armory workload (FleetVLA's round robin)
TARGETS = {"useful_actions": (">=", 1497.0), "starved": ("<=", 0.251), "age_p95_s": ("<=", 0.60), "fairness": (">=", 0.98)}
#: the weighted workload's: the weight-5 robot's progress beyond Lookahead's, and its aggregate
WEIGHTED_TARGETS = {"w5_progress": (">=", 0.92), "useful_actions": (">=", 1294.0)}
#: the server's batch strategies (``batch_strategy`` in a policy's config); the DES also runs
#: ``fleet-now``, the fleet strategy without reservation (it never waits for expected requests)
STRATEGIES = ("admission", "fleet", "fleet-now")
#: the strategy the benchmark's server runs unless told otherwise
DEFAULT_STRATEGY = "admission"


def defaults_for(robot: Robot) -> BrokerConfig:
    """The shipped defaults at the robot's control period."""
    return BrokerConfig(control_period_s=robot.period)


def before_for(robot: Robot) -> BrokerConfig:
    """The broker without load-aware pacing and hold-and-resume (as it was)."""
    return BrokerConfig(control_period_s=robot.period, pace_under_load=False, hold_tolerance=None)


def replace_for(robot: Robot) -> BrokerConfig:
    """The shipped defaults with ``replace`` merging."""
    return BrokerConfig(control_period_s=robot.period, merge=MergeMode.REPLACE)


def refresh_for(robot: Robot) -> BrokerConfig:
    """The shipped defaults with ``refresh_queued`` on."""
    return BrokerConfig(control_period_s=robot.period, refresh_queued=True)


def no_refresh_for(robot: Robot) -> BrokerConfig:
    """The shipped defaults with ``refresh_queued`` off."""
    return BrokerConfig(control_period_s=robot.period, refresh_queued=False)


BASELINES: dict[str, Callable[[Robot], BrokerConfig]] = {"before": before_for, "replace": replace_for, "refresh": refresh_for,
                                                         "no-refresh": no_refresh_for}


def _target_value(m: FleetMetrics, key: str) -> float:
    return m.tiers.get(5.0, math.nan) if key == "w5_progress" else float(getattr(m, key))


def meets(key: str, op: str, value: float, goal: float, w: Workload) -> bool:
    """Whether ``value`` of ``key`` meets the target ``goal`` (``op``: ``>=`` or ``<=``) on ``w``.
    An age is the difference of two ticks' times, each as late as its robot's timer woke (live, and
    the DES's jitter): an age within a tenth of the shortest control period of a target is at it
    (the lateness :attr:`BrokerConfig.lead` treats as on the tick grid); the rest within float residue."""
    slack = 0.1 * min(r.period for r in w.robots) if key == "age_p95_s" else 1e-9
    return value >= goal - slack if op == ">=" else value <= goal + slack


def _row(label: str, ms: list[FleetMetrics]) -> str:
    def med(f: Callable[[FleetMetrics], float]) -> float:
        return statistics.median(f(m) for m in ms)

    tiers = sorted(ms[0].tiers)
    tier = " ".join(f"w{w:g}:{100 * statistics.median(m.tiers[w] for m in ms):.1f}%" for w in tiers)
    return (f"{label:<14} {med(lambda m: m.useful_actions):>8.0f} {100 * med(lambda m: m.starved):>8.1f}% "
            f"{med(lambda m: m.age_p95_s):>8.2f} {med(lambda m: m.fairness):>8.3f} {med(lambda m: m.requests_per_robot_s):>8.2f} "
            f"{med(lambda m: m.refreshes_per_robot_s):>7.2f} {med(lambda m: m.rows_per_chunk):>8.2f} "
            f"{med(lambda m: m.refusals):>6.0f} {med(lambda m: m.queue_ms):>7.0f} "
            f"{med(lambda m: m.batch_mean):>6.2f} {med(lambda m: m.round_trip_ms):>7.0f} "
            f"{med(lambda m: m.ran):>6.0f} {med(lambda m: m.indexed):>7.0f} {med(lambda m: m.per_gpu_s):>6.1f}  {tier}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench fleet-contention", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="armory-l40s-equal", help=f"one of {', '.join(SHIPPED)}, or a JSON file")
    parser.add_argument("--runs", type=int, default=3, help="runs per side (medians reported)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per run (default: the workload's)")
    parser.add_argument("--baseline", choices=(*BASELINES, *STRATEGIES, "none"), default="before",
                        help="before: without pacing and hold-and-resume; replace: the defaults with replace merging; "
                             "refresh|no-refresh: the defaults with refresh_queued on|off; "
                             "admission|fleet: the defaults on that server strategy")
    parser.add_argument("--strategy", choices=STRATEGIES, default=DEFAULT_STRATEGY, help="the server's batch_strategy")
    parser.add_argument("--mode", choices=("wallclock", "des"), default="wallclock")
    parser.add_argument("--robots", type=int, default=None, help="DES: the workload's robots repeated to this many")
    parser.add_argument("--rows-from", choices=("both", *ROWS_FROM), default="both",
                        help="where a chunk's rows start: next-tick (FleetVLA's, the headline), obs-tick (chunkline's), both")
    parser.add_argument("--reply-overhead-ms", type=float, default=None,
                        help="DES: what a reply costs besides queueing, inference and the network "
                             "(default: the wall-clock mode's, measured; vary it to see a strategy's margin)")
    parser.add_argument("--uri", default=None, help="a running server with the workload's policy (default: start one)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args(argv)
    from .des import Jitter, run_des
    from .wallclock import run_wallclock

    w = load_workload(args.workload)
    if args.duration is not None:
        w = w.model_copy(update={"duration_s": args.duration})
    if args.robots is not None:
        robots = [r.model_copy(update={"name": f"{r.name}-{i}"}) for i in range(args.robots // len(w.robots) + 1)
                  for r in w.robots][: args.robots]
        w = w.model_copy(update={"robots": robots})
    des = args.mode == "des"
    if not des and "fleet-now" in (args.strategy, args.baseline):
        parser.error("fleet-now (the fleet strategy without reservation) runs in --mode des only")
    if args.reply_overhead_ms is not None and not (des and args.reply_overhead_ms >= 0):
        parser.error("--reply-overhead-ms is a DES setting (>= 0 ms); the wall clock has its own")
    overhead = {} if args.reply_overhead_ms is None else {"reply_overhead_s": args.reply_overhead_ms / 1000.0}
    brokers: list[tuple[str, Callable[[Robot], BrokerConfig], str]] = [("defaults", defaults_for, args.strategy)]
    if args.baseline in STRATEGIES:
        brokers = [(f"{args.strategy}", defaults_for, args.strategy), (args.baseline, defaults_for, args.baseline)]
    elif args.baseline != "none":
        brokers.append((args.baseline, BASELINES[args.baseline], args.strategy))
    conventions = ROWS_FROM if args.rows_from == "both" else (args.rows_from,)
    sides = [(label + ("" if rows_from == "next-tick" else "/obs"), config_for, strategy, rows_from)
             for rows_from in conventions for label, config_for, strategy in brokers]
    results: dict[str, list[FleetMetrics]] = {label: [] for label, _, _, _ in sides}
    for i in range(args.runs):
        for label, config_for, strategy, rows_from in sides:  # A B A B
            records = (run_des(w, config_for, strategy=strategy, rows_from=rows_from, jitter=Jitter(seed=i), **overhead) if des
                       else run_wallclock(w, config_for, args.uri, strategy=strategy, rows_from=rows_from))
            m = fleet_metrics(records, w.duration_s, indexed=rows_from == "next-tick")
            results[label].append(m)
            print(f"run {i + 1} {label}: {json.dumps(m.as_dict())}", flush=True)
    mode = args.mode if args.reply_overhead_ms is None else f"{args.mode}, reply overhead {args.reply_overhead_ms:g} ms"
    print(f"\n{w.name}: {len(w.robots)} robots, {w.duration_s:g} s, max batch {w.max_batch}; medians of {args.runs} runs "
          f"({mode}, server strategy {args.strategy})")
    print(f"{'broker':<14} {'useful':>8} {'starved':>9} {'age p95':>8} {'fairness':>8} {'req/r-s':>8} {'ref/r-s':>7} {'rows/ch':>8} "
          f"{'refus':>6} {'wait ms':>7} {'batch':>6} {'rtt ms':>7} {'ran':>6} {'indexed':>7} {'/GPU-s':>6}  progress per weight tier")
    for label, ms in results.items():
        print(_row(label, ms))
    targets = {"armory-l40s-equal": TARGETS, "armory-l40s": WEIGHTED_TARGETS}.get(w.name)
    if targets is not None and len(w.robots) == 10:
        ours = results[sides[0][0]]
        print(f"targets on {sides[0][0]} ({sides[0][3]} rows):")
        for key, (op, goal) in targets.items():
            value = statistics.median(_target_value(m, key) for m in ours)
            ticks = f" ({value / min(r.period for r in w.robots):.2f} periods)" if key == "age_p95_s" else ""
            held = sum(meets(key, op, _target_value(m, key), goal, w) for m in ours)
            print(f"[{'PASS' if meets(key, op, value, goal, w) else 'FAIL'}] {key} {value:.3f}{ticks} {op} {goal:g}"
                  f" (held on {held} of {len(ours)} runs)")
        every = sum(all(meets(k, op, _target_value(m, k), goal, w) for k, (op, goal) in targets.items()) for m in ours)
        print(f"all targets held on {every} of {len(ours)} runs")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {"workload": w.model_dump(), "results": {k: [m.as_dict() for m in v] for k, v in results.items()}}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    return 0


