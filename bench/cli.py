"""``chunkline bench <suite> [...]``: every benchmark suite behind one command."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["SUITES", "add_bench_parser", "main"]

#: suite name -> (module with a ``main(argv) -> int``, one-line description)
SUITES: dict[str, tuple[str, str]] = {
    "overhead": ("chunkline.bench.overhead", "robot-path overhead vs a bare websockets echo, and codec vs memcpy"),
    "span-ab": ("chunkline.bench.span_ab", "a change to the request path A/B inside one server process: first read to reply write"),
    "retry": ("chunkline.bench.retry_storm", "retry storms: goodput when refused robots retry at once vs after retry_after_ms"),
    "admission": ("chunkline.bench.admission_bench", "the cost of one admission as the queue grows (queue depth x newcomer's place)"),
    "broker": ("chunkline.bench.broker_bench", "broker act(now) cost and prefetch accuracy under a latency trace"),
    "breakdown": ("chunkline.bench.breakdown", "latency of one request stage by stage, client and server joined"),
    "load": ("chunkline.bench.load", "open-loop sweep of offered load to saturation; A/B against a baseline server"),
    "capacity": ("chunkline.bench.capacity", "service curve, replicas for a fleet, cost per in-deadline chunk"),
    "fleet": ("chunkline.bench.fleet", "robots served within deadline: batching vs one at a time"),
    "fleet-contention": ("chunkline.bench.fleet_contention", "a fleet sharing one accelerator: useful actions, starvation, age, fairness"),
    "closed-loop": ("chunkline.bench.closedloop.suite", "MuJoCo tasks: sync vs index vs chunkline under delay, jitter, outages"),
    "planner": ("chunkline.bench.closedloop.planner_suite", "hierarchical MuJoCo task: blocking on each plan vs the plan broker"),
    "text": ("chunkline.bench.text_bench", "text load: continuous batching vs one at a time, TTFT/TPOT, goodput, gateway overhead"),
    "soak": ("chunkline.bench.soak", "robot sessions with faults for 10 min: lost/duplicated replies, ledger, memory and fd slopes"),
    "cluster": ("chunkline.bench.cluster_bench", "Ray fleet: replica vs standalone round trip, placement, recovery, 1 vs 2 replicas"),
    "policies": ("chunkline.bench.policies_bench", "LeRobot ACT and Diffusion: service curves, robots in deadline, batching vs not"),
    "startup": ("chunkline.bench.startup", "time to ready: every batch size timed first vs batch 1 first, the rest in the background"),
    "link": ("chunkline.bench.link.suite", "observation-to-action over shaped uplinks: raw vs jpeg vs adaptive, jpeg's action deviation"),
    "fuzz": ("chunkline.bench.fuzz", "coverage-guided (atheris) and live structure-aware fuzzing of the codec and protocol"),
}


def _run(args: argparse.Namespace) -> int:
    module = importlib.import_module(SUITES[args.suite][0])
    return int(module.main(args.suite_args) or 0)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    lines = "\n".join(f"  {name:<10} {desc}" for name, (_, desc) in SUITES.items())
    p = sub.add_parser("bench", help="run a benchmark suite", description=f"Benchmark suites:\n{lines}\n\n"
                       "Each suite takes --help. Comparisons run against their baseline in the same run.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES), help="which suite")
    p.add_argument("suite_args", nargs=argparse.REMAINDER, help="arguments for the suite")
    p.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return _run(args)
