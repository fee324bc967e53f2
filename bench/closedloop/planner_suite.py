"""``chunkline bench planner``: the hierarchical MuJoCo task (``hierarchical.py``) with a remote
planner, blocking on each plan vs chunkline's plan broker, in one run.

Per condition (planner latency 0.2-1 s, 0.2-5 s, and 0.2-2 s with a 6 s outage, 10% wrong and 10%
invalid plans; the outage from 2 to 8 s) both strategies run the same seeds, alternating (A B A B). Reported: success rate,
median and p90 completion time (successful episodes), mean time spent holding while targets were
pending, limit violations (must be 0), plan requests per episode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.bench.closedloop.hierarchical import STRATEGIES, EpisodeFigures, PlannerConditions, run_episode
from chunkline.bench.closedloop.tasks import TaskUnavailable

__all__ = ["CONDITIONS", "summarise", "main"]

CONDITIONS = (
    PlannerConditions("latency 0.2-1 s", (0.2, 1.0)),
    PlannerConditions("latency 0.2-5 s", (0.2, 5.0)),
    PlannerConditions("0.2-2 s, outage 2-8 s, 10% wrong, 10% invalid", (0.2, 2.0), outage=(2.0, 8.0), wrong=0.1, invalid=0.1),
)


def summarise(episodes: list[EpisodeFigures]) -> dict[str, Any]:
    done = [e.completion_s for e in episodes if e.success]
    return {
        "episodes": len(episodes),
        "success_rate": sum(e.success for e in episodes) / len(episodes),
        "completion_median_s": statistics.median(done) if done else None,
        "completion_p90_s": float(np.percentile(done, 90)) if done else None,
        "holding_mean_s": statistics.fmean(e.holding_s for e in episodes),
        "limit_violations": sum(e.limit_violations for e in episodes),
        "requests_mean": statistics.fmean(e.plan_requests for e in episodes),
        "steps_skipped_mean": statistics.fmean(e.steps_skipped for e in episodes),
    }


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chunkline bench planner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="episodes per condition and strategy")
    ap.add_argument("--quick", action="store_true", help="3 seeds")
    ap.add_argument("--out", type=Path, default=Path("results") / "planner", help="where summary.json goes")
    args = ap.parse_args(argv)
    seeds = range(3 if args.quick else args.seeds)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    try:
        for cond in CONDITIONS:
            per: dict[str, list[EpisodeFigures]] = {s: [] for s in STRATEGIES}
            for seed in seeds:
                order = STRATEGIES if seed % 2 == 0 else STRATEGIES[::-1]  # A B, B A: neither always goes first
                for strategy in order:
                    per[strategy].append(run_episode(strategy, cond, seed))
            for strategy in STRATEGIES:
                rows.append({"condition": cond.name, "strategy": strategy, **summarise(per[strategy])})
    except TaskUnavailable as exc:
        print(f"planner: {exc}", file=sys.stderr)
        return 2
    print("| condition | strategy | success | completion median s | p90 s | holding mean s | limit violations | requests/ep |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['condition']} | {r['strategy']} | {100 * r['success_rate']:.0f}% | {_fmt(r['completion_median_s'])} | "
              f"{_fmt(r['completion_p90_s'])} | {r['holding_mean_s']:.2f} | {r['limit_violations']} | {r['requests_mean']:.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"seeds": len(seeds), "rows": rows}, indent=2))
    print(f"{len(seeds)} seeds per point, {time.monotonic() - started:.1f} s; {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
