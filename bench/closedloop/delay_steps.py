"""``chunkline bench closed-loop --steps``: success against delay in control steps.

``d`` is the one-way delay in control periods (the link's delay each way is ``d * period``, the
round trip about ``2 d`` steps plus inference), swept over ``0, 2, ..., 20`` with the ``--rtc``
suite's link (jitter of 20% of the delay, 200 ms stalls at 0.3/s each way above 0), the
discrete-event runner, on ``reach`` and ``reach-jump``, every strategy on the same seeds. A
learned policy (``reach-flow``) runs through chunkline's ``rtc`` mode beside the scripted expert.

Per point: success with its 95% Wilson interval, mean error, stale actions, limit violations,
diverging episodes. One plot per task (success against ``d``, every strategy, intervals drawn),
one table, the targets of issue 36 checked. ``--docs PAGE`` rewrites the page's generated
section and puts the plots beside it. Episodes run in up to two worker processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ..report import ResultsDir, default_out, read_jsonl
from .rtc_suite import STRATEGY_NAMES, RtcPlan, broker_config_for, delay_conditions, summarise
from .steps_report import docs_section, plot_success_vs_steps, steps_table, steps_targets, update_page, wilson
from .tasks import TaskUnavailable, make_task

__all__ = ["StepsPlan", "Unit", "run_unit", "run", "main", "DEFAULT_STRATEGIES", "DEFAULT_MODE", "MAX_WORKERS"]

SUITE = "closed-loop-steps"
#: the strategies every task runs (names of :data:`.rtc_suite.STRATEGY_NAMES`).
DEFAULT_STRATEGIES = ("sync", "index", "index-filtered", "chunkline-replace", "chunkline-rtc")
#: chunkline's mode for a policy that inpaints the prefix (the experts and ``reach-flow``).
DEFAULT_MODE = "chunkline-rtc"
#: worker processes at most (the benchmark machine is shared).
MAX_WORKERS = 2


@dataclasses.dataclass
class StepsPlan:
    """What one run covers.

    Args:
        tasks: the tasks, each served by its scripted expert.
        steps: one-way delays in control periods.
        seeds: episode seeds (the same for every point).
        strategies: strategies for the expert, as named in :data:`.rtc_suite.STRATEGY_NAMES`.
        learned: a registered learned policy run through :data:`DEFAULT_MODE` (``None``: none).
        horizon_s: the experts' planning horizon (chunk duration).
        workers: worker processes (1 to :data:`MAX_WORKERS`).
    """

    tasks: tuple[str, ...] = ("reach", "reach-jump")
    steps: tuple[int, ...] = tuple(range(0, 21, 2))
    seeds: tuple[int, ...] = tuple(range(200))
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    learned: str | None = "reach-flow-jax"
    horizon_s: float = 1.0
    workers: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """One point's share of episodes, run in one process."""

    task: str
    policy: str
    strategy: str
    steps: int
    seeds: tuple[int, ...]
    horizon_s: float


#: per worker process: (task, policy, horizon) -> (task, server); built on first use.
_CACHE: dict[tuple[str, str, float], Any] = {}


def _server(task_name: str, policy: str, horizon_s: float) -> Any:
    from chunkline.policies.registry import load_policy

    from .des import LocalServer
    from .rtc_suite import expert_for

    key = (task_name, policy, horizon_s)
    if key not in _CACHE:
        pol = expert_for(task_name, horizon_s) if policy == "expert" else load_policy(policy)
        _CACHE[key] = (make_task(task_name, camera="synthetic"), LocalServer(pol))
    return _CACHE[key]


def run_unit(unit: Unit) -> list[dict[str, Any]]:
    """The episodes of one unit, as flat records (what :class:`~.metrics.EpisodeResult` holds)."""
    from .des import run_des_episode

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    task, server = _server(unit.task, unit.policy, unit.horizon_s)
    _, base, merge = next(s for s in STRATEGY_NAMES if s[0] == unit.strategy)
    cfg = broker_config_for(merge, task.period, server.spec.horizon) if merge else None
    cond = delay_conditions(RtcPlan(), 1000.0 * unit.steps * task.period)
    out = []
    for seed in unit.seeds:
        r = run_des_episode(task, base, server, cond, seed=seed, broker_config=cfg, infer_s=0.002)
        out.append({**r.as_dict(), "strategy": unit.strategy, "policy": unit.policy, "steps": unit.steps,
                    "tolerance_m": task.tolerance_m})
    return out


#: episodes per unit at most: every point gets this many before any gets more, so a run cut
#: short (``--report-only`` on its results) still covers every point.
PART = 50


def units(p: StepsPlan, split: int = 1) -> Iterator[Unit]:
    """Every point's episodes in at least ``split`` parts of at most :data:`PART`, the first part
    of every point before the second of any."""
    combos = [(t, "expert", s) for t in p.tasks for s in p.strategies]
    if p.learned:
        combos += [(t, p.learned, DEFAULT_MODE) for t in p.tasks]
    parts = max(split, -(-len(p.seeds) // PART))
    for i in range(parts):
        part = p.seeds[i::parts]
        if not part:
            continue
        for task, policy, strategy in combos:
            for d in p.steps:
                yield Unit(task, policy, strategy, d, tuple(part), p.horizon_s)


def _summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from .metrics import EpisodeResult

    fields = {f.name for f in dataclasses.fields(EpisodeResult)}
    results = [EpisodeResult(**{k: v for k, v in r.items() if k in fields}) for r in records]
    row = summarise(results, records[0]["tolerance_m"])
    wins = sum(r.success for r in results)
    lo, hi = wilson(wins, len(results))
    return {**row, "successes": wins, "success_lo": lo, "success_hi": hi}


def run(p: StepsPlan, out: ResultsDir | None = None, *, log: Any = None) -> list[dict[str, Any]]:
    """Run the plan: one summary row per (task, policy, strategy, d)."""
    workers = max(1, min(MAX_WORKERS, p.workers))
    todo = list(units(p, split=workers))
    by: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    if workers == 1:
        results: Iterator[list[dict[str, Any]]] = map(run_unit, todo)
        pool = None
    else:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
        results = pool.map(run_unit, todo)
    try:
        for i, recs in enumerate(results):
            u = todo[i]
            by.setdefault((u.task, u.policy, u.strategy, u.steps), []).extend(recs)
            if out is not None:
                for r in recs:
                    out.write("episode", r)
            if log is not None and (i + 1) % max(1, len(todo) // 20) == 0:
                print(f"{i + 1}/{len(todo)} units", file=log, flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    return summaries(by)


def summaries(by: dict[tuple[str, str, str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One summary row per point from its episode records."""
    rows = []
    for (task, policy, strategy, d), recs in by.items():
        period = recs[0]["period_s"]
        rows.append({"task": task, "policy": policy, "strategy": strategy, "steps": d,
                     "delay_ms": 1000.0 * d * period, **_summary(recs)})
    return rows


_NAN_FIELDS = ("score", "max_action_age_s", "reaction_s")


def _episodes(paths: Sequence[Path]) -> Iterator[dict[str, Any]]:
    """The episode records of runs' ``results.jsonl`` files; an episode (point and seed) in
    more than one counts once, as the last file has it."""
    seen: dict[tuple[str, str, str, int, int], dict[str, Any]] = {}
    for path in paths:
        for r in read_jsonl(path):
            if r.get("kind") == "episode":
                seen[(r["task"], r["policy"], r["strategy"], r["steps"], r["seed"])] = r
    return iter(seen.values())


def from_results(path: Path | Sequence[Path]) -> list[dict[str, Any]]:
    """The summary rows of the episodes runs wrote to ``results.jsonl`` (all of them, or as
    many as a run cut short had finished; several runs' files are joined)."""
    by: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for r in _episodes([path] if isinstance(path, Path) else path):
        # JSON has no NaN: the file holds null for "none" (no reaction, no action run).
        r.update({k: math.nan for k in _NAN_FIELDS if r.get(k) is None})
        by.setdefault((r["task"], r["policy"], r["strategy"], r["steps"]), []).append(r)
    return summaries(by)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns 0 (the targets are reported, not enforced)."""
    ap = argparse.ArgumentParser(prog="chunkline bench closed-loop --steps", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke test: 2 seeds, d = 0, 10, 20")
    ap.add_argument("--episodes", type=int, default=None, help="episodes per point (default 200)")
    ap.add_argument("--first-seed", type=int, default=0, help="the first seed: seeds first .. first+episodes-1")
    ap.add_argument("--steps", default=None, help="comma-separated delays in control steps (default 0,2,...,20)")
    ap.add_argument("--tasks", default=None, help="comma-separated tasks (default reach,reach-jump)")
    ap.add_argument("--strategies", default=None, help=f"comma-separated strategies (default {','.join(DEFAULT_STRATEGIES)}; "
                                                       "'none': the learned policy only)")
    ap.add_argument("--learned", default=None, help="the learned policy run through chunkline-rtc ('none': skip; "
                                                    "default reach-flow-jax)")
    ap.add_argument("--workers", type=int, default=1, help=f"worker processes, at most {MAX_WORKERS}")
    ap.add_argument("--out", type=Path, default=None, help=f"results folder (default results/{SUITE})")
    ap.add_argument("--docs", type=Path, default=None, help="a page whose generated section to rewrite (plots beside it)")
    ap.add_argument("--report-only", type=Path, nargs="+", default=None, metavar="RESULTS_JSONL",
                    help="run nothing: report on the episodes of earlier runs' results.jsonl (cut short too; several "
                         "are joined)")
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= MAX_WORKERS:
        ap.error(f"--workers must be 1..{MAX_WORKERS}")
    p = StepsPlan(workers=args.workers)
    n = args.episodes if args.episodes is not None else (2 if args.quick else 200)
    if n < 1:
        ap.error("--episodes must be >= 1")
    p.seeds = tuple(range(args.first_seed, args.first_seed + n))
    if args.quick:
        p.steps = (0, 10, 20)
    if args.steps:
        p.steps = tuple(int(x) for x in args.steps.split(","))
    if args.tasks:
        p.tasks = tuple(args.tasks.split(","))
    if args.strategies:
        p.strategies = () if args.strategies == "none" else tuple(args.strategies.split(","))
        unknown = set(p.strategies) - {s[0] for s in STRATEGY_NAMES}
        if unknown:
            ap.error(f"unknown strategies: {', '.join(sorted(unknown))}")
    if args.learned is not None:
        p.learned = None if args.learned == "none" else args.learned
    try:
        make_task("reach").close()
    except TaskUnavailable as exc:
        print(f"closed-loop: {exc}", file=sys.stderr)
        return 2
    started, cpu = time.monotonic(), time.process_time()
    if args.report_only is not None:
        rows = from_results(args.report_only)
        out = ResultsDir(args.out or default_out(SUITE) / "report", SUITE)
        p.tasks = tuple(dict.fromkeys(r["task"] for r in rows))
        seeds = sorted({r["seed"] for r in _episodes(args.report_only)})
        p.seeds = tuple(seeds)
    else:
        out = ResultsDir(args.out or default_out(SUITE), SUITE)
        rows = run(p, out, log=sys.stderr)
    wall = time.monotonic() - started
    for r in rows:
        out.write("summary", r)
    checks = steps_targets(rows)
    for c in checks:
        out.write("target", c)
    plots = [plot_success_vs_steps(rows, task, out.file(f"success_vs_steps_{task}.png")) for task in p.tasks]
    episodes = sum(r["episodes"] for r in rows)
    per = sorted({r["episodes"] for r in rows})
    count = f"{per[0]}" if len(per) == 1 else f"{per[0]}-{per[-1]}"
    head = (f"{count} episodes per point (seeds from {p.seeds[0]}-{p.seeds[-1]}), {episodes} in all, "
            + (f"reported from {len(args.report_only)} earlier run(s)" if args.report_only is not None else
               f"{wall:.0f} s wall on {max(1, min(MAX_WORKERS, p.workers))} worker(s)"
               + ("" if p.workers > 1 else f", {time.process_time() - cpu:.0f} s CPU")))
    table = steps_table(rows)
    lines = [head, "", table, ""] + [f"[{'PASS' if c['passed'] else 'FAIL'}] {c['check']}: {c['value']}" for c in checks]
    text = "\n".join(lines)
    out.write_text("report.md", text + "\n")
    if args.docs is not None:
        update_page(args.docs, docs_section(head, table, checks, [pl.name for pl in plots]), plots)
    print(text)
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())

