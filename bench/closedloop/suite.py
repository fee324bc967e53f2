"""``chunkline bench closed-loop``: three strategies on MuJoCo tasks, against delay, jitter and
outages, in the discrete-event mode, checked at a few points in the real-time mode.

Every strategy runs the same seeds under each condition (one-way delay 0-200 ms, jitter, blackhole
and reset outages of 0.5 and 2 s): success and score, stale actions, time on the fallback, safety
interventions, limit violations, and recovery after an outage. A few conditions run in real time
(a ``chunkline serve`` process, a fault proxy, this process as the robot) beside the discrete-event
figures of the same episodes. Writes ``results.jsonl``, ``report.md`` and plots under ``--out``;
``--quick`` is a small version; ``--steps-sweep`` reports success against delay in control steps."""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.policies.registry import load_policy

from ..faultproxy import FaultProxy, Outage
from ..report import Column, Progress, ResultsDir, default_out, format_table
from .des import Conditions, LocalServer, run_des_episode
from .metrics import EpisodeResult
from .plots import plot_outage_timeline, plot_success_vs_delay
from .strategies import STRATEGIES
from .tasks import Task, TaskUnavailable, make_task

__all__ = ["main", "SweepPlan", "plan", "summarise", "outage_figures", "measure_infer_s"]

SUITE = "closed-loop"
#: (task, policy) pairs the full sweep covers.
RUNS: tuple[tuple[str, str], ...] = (("reach", "reach-expert"), ("track7", "track7-expert"), ("reach", "reach-bc"))


@dataclasses.dataclass
class SweepPlan:
    """What one run covers.

    Args:
        delays_ms: one-way delays.
        jitter_ms: jitters tried at ``jitter_at_ms`` of delay.
        jitter_at_ms: the delay of the jitter runs.
        outages: ``(seconds, mode)`` outages, each at ``outage_at_s`` with ``outage_delay_ms``.
        outage_at_s: when the outage starts.
        outage_delay_ms: the one-way delay during outage runs.
        seeds: episode seeds.
        episode_s: episode length (outage runs: ``outage_at_s + seconds + 4 s``).
        runs: the (task, policy) pairs.
        realtime: the real-time checks: (task, policy, delay_ms) points, ``realtime_seeds`` each.
        realtime_seeds: seeds of the real-time checks.
    """

    delays_ms: tuple[float, ...] = (0, 25, 50, 70, 100, 130, 150, 200)
    jitter_ms: tuple[float, ...] = (20, 50)
    jitter_at_ms: float = 100
    outages: tuple[tuple[float, str], ...] = ((0.5, "blackhole"), (2.0, "blackhole"), (0.5, "reset"), (2.0, "reset"))
    outage_at_s: float = 3.0
    outage_delay_ms: float = 50
    seeds: tuple[int, ...] = tuple(range(10))
    episode_s: float | None = None
    runs: tuple[tuple[str, str], ...] = RUNS
    realtime: tuple[tuple[str, str, float], ...] = (("reach", "reach-expert", 0), ("reach", "reach-expert", 100))
    realtime_seeds: tuple[int, ...] = (0, 1)


def plan(quick: bool) -> SweepPlan:
    """The default plan, or the ``--quick`` one."""
    if not quick:
        return SweepPlan()
    return SweepPlan(delays_ms=(0, 100, 150, 200), jitter_ms=(50,), outages=((2.0, "blackhole"), (2.0, "reset")),
                     seeds=(0, 1, 2), runs=(("reach", "reach-expert"), ("track7", "track7-expert")),
                     realtime=(("reach", "reach-expert", 100),), realtime_seeds=(0,))


def measure_infer_s(server: LocalServer, task: Task, n: int = 5) -> float:
    """The policy's median inference time on this machine (what the discrete-event server charges)."""
    task.reset(0)
    obs = task.observe()
    server.infer(obs)  # warm-up
    times = []
    for _ in range(n):
        t = time.perf_counter()
        server.infer(obs)
        times.append(time.perf_counter() - t)
    return float(statistics.median(times))


def outage_figures(result: EpisodeResult, outage: Outage, tolerance_m: float, hold_s: float = 0.5) -> dict[str, float]:
    """Through an outage: ``recovered_s`` (from the link's return until the error stays within the
    task's tolerance for ``hold_s``; NaN if never), and for chunkline ``fallback_entry_s`` (from
    the moment the last valid action expired to the first fallback tick; NaN if it never fell
    back) and ``fallback_entry_ok`` (at or after that moment, within one control period).

    Args:
        result: an episode with a timeline.
        outage: the outage (episode times).
        tolerance_m: the task's tolerance.
        hold_s: how long the error must stay within it.
    """
    tl = result.timeline
    out = {"recovered_s": math.nan, "fallback_entry_s": math.nan, "fallback_entry_ok": math.nan}
    if tl is None:
        return out
    t, err, src, vu = tl["t"], tl["error"], tl["source"], tl["valid_until"]
    need = int(round(hold_s / result.period_s))
    ok = err < tolerance_m
    for i in np.flatnonzero(t >= outage.end - 1e-9):
        if i + need <= len(ok) and ok[i : i + need].all():
            out["recovered_s"] = float(t[i] - outage.end)
            break
    if result.strategy == "chunkline":
        fb = np.flatnonzero((src == "fallback") & (t >= outage.start - 1e-9))
        if fb.size:
            first = int(fb[0])
            dry = float(vu[first])  # the timeline's end as that tick saw it (no chunk came in between)
            out["fallback_entry_s"] = float(t[first] - dry)
            # The last valid action expires at `dry`; the first tick at or after it must fall back.
            out["fallback_entry_ok"] = float(-1e-9 <= t[first] - dry <= result.period_s + 1e-9)
    return out


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else math.nan


def summarise(results: Sequence[EpisodeResult], extra: Mapping[int, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """Aggregate the episodes of one (task, policy, condition, strategy).

    Args:
        results: the episodes.
        extra: per-episode outage figures (by index into ``results``).
    """
    n = len(results)
    extra = extra or {}
    rec = [extra[i]["recovered_s"] for i in range(n) if i in extra]
    entry = [extra[i]["fallback_entry_s"] for i in range(n) if i in extra]
    entry_ok = [extra[i]["fallback_entry_ok"] for i in range(n) if i in extra]
    return {
        "episodes": n,
        "success_rate": sum(r.success for r in results) / max(1, n),
        "score_mean": _mean([r.score for r in results]),
        "stale_actions": sum(r.stale_actions for r in results),
        "stale_per_episode": sum(r.stale_actions for r in results) / max(1, n),
        "max_action_age_s": max((r.max_action_age_s for r in results if math.isfinite(r.max_action_age_s)), default=math.nan),
        "fallback_s_mean": _mean([r.fallback_s for r in results]),
        "hold_s_mean": _mean([r.hold_s for r in results]),
        "violation_ticks": sum(r.violation_ticks for r in results),
        "interventions_mean": _mean([r.interventions for r in results]),
        "requests_mean": _mean([r.requests for r in results]),
        "recovered_rate": (sum(math.isfinite(v) for v in rec) / len(rec)) if rec else math.nan,
        "recovered_s_mean": _mean(rec),
        "fallback_entry_s_max": max((v for v in entry if math.isfinite(v)), default=math.nan),
        "fallback_entry_ok": (all(v == 1.0 for v in entry_ok if math.isfinite(v)) if any(math.isfinite(v) for v in entry_ok) else None),
    }


def _conditions(p: SweepPlan) -> list[tuple[Conditions, str, float]]:
    """(conditions, kind, x) for the sweep: kind ``delay``, ``jitter`` or ``outage``."""
    out = [(Conditions(d / 1000.0, label=f"delay {d:g} ms"), "delay", d) for d in p.delays_ms]
    out += [(Conditions(p.jitter_at_ms / 1000.0, jitter_s=j / 1000.0, label=f"delay {p.jitter_at_ms:g} ms jitter {j:g} ms"),
             "jitter", j) for j in p.jitter_ms]
    for seconds, mode in p.outages:
        o = Outage(p.outage_at_s, seconds, mode)
        out.append((Conditions(p.outage_delay_ms / 1000.0, outages=(o,),
                               label=f"{mode} {seconds:g} s (delay {p.outage_delay_ms:g} ms)"), "outage", seconds))
    return out


def _run_des(p: SweepPlan, out: ResultsDir, progress: Progress) -> tuple[list[dict[str, Any]], dict[tuple[str, str], list[EpisodeResult]]]:
    rows: list[dict[str, Any]] = []
    timelines: dict[tuple[str, str], list[EpisodeResult]] = {}
    for task_name, policy_name in p.runs:
        base_task = make_task(task_name, episode_s=p.episode_s)
        server = LocalServer(load_policy(policy_name, backend="numpy" if policy_name.endswith("-bc") else None))
        infer_s = measure_infer_s(server, base_task)
        for cond, kind, x in _conditions(p):
            cond = dataclasses.replace(cond, infer_s=infer_s)
            episode_s = base_task.episode_s
            if kind == "outage":
                o = cond.outages[0]
                episode_s = max(episode_s, o.end + 4.0)
            task = make_task(task_name, episode_s=episode_s)
            for strategy in STRATEGIES:
                results = []
                extra: dict[int, dict[str, float]] = {}
                for i, seed in enumerate(p.seeds):
                    r = run_des_episode(task, strategy, server, cond, seed=seed, keep_timeline=kind == "outage")
                    if kind == "outage":
                        extra[i] = outage_figures(r, cond.outages[0], task.tolerance_m)
                        r.details.update(extra[i])
                        if i == 0 and cond.outages[0].duration >= 2.0 and cond.outages[0].mode == "blackhole":
                            timelines.setdefault((task_name, policy_name), []).append(r)
                    out.write("episode", {"policy": policy_name, "condition": cond.name, **r.as_dict()})
                    results.append(r)
                    progress.update(advance=1, extra=f"{task_name}/{policy_name} {cond.name} {strategy}")
                row = {"task": task_name, "policy": policy_name, "condition": cond.name, "kind": kind, "x": x,
                       "delay_ms": cond.delay_s * 1000.0, "jitter_ms": cond.jitter_s * 1000.0, "strategy": strategy,
                       "mode": "des", "infer_ms": infer_s * 1000.0, **summarise(results, extra)}
                out.write("summary", row)
                rows.append(row)
            task.close()
        base_task.close()
    return rows, timelines


def _run_realtime(p: SweepPlan, des_rows: list[dict[str, Any]], out: ResultsDir, progress: Progress) -> list[dict[str, Any]]:
    from ..serverproc import ServerProcess
    from .realtime import run_realtime_episode

    rows: list[dict[str, Any]] = []
    by_policy: dict[tuple[str, str], list[float]] = {}
    for task_name, policy_name, delay in p.realtime:
        by_policy.setdefault((task_name, policy_name), []).append(delay)
    for (task_name, policy_name), delays in by_policy.items():
        task = make_task(task_name, episode_s=p.episode_s)
        local = LocalServer(load_policy(policy_name, backend="numpy" if policy_name.endswith("-bc") else None))
        infer_s = measure_infer_s(local, task)
        with ServerProcess(["--policy", policy_name]) as server, FaultProxy(server.port, max_seconds=1800) as proxy:
            for delay in delays:
                cond = Conditions(delay / 1000.0, label=f"delay {delay:g} ms")
                for strategy in STRATEGIES:
                    rt = [run_realtime_episode(task, strategy, proxy, cond, seed=s) for s in p.realtime_seeds]
                    des = [run_des_episode(task, strategy, local, dataclasses.replace(cond, infer_s=infer_s), seed=s)
                           for s in p.realtime_seeds]
                    for r in rt:
                        out.write("episode", {"policy": policy_name, "condition": cond.name, **r.as_dict()})
                    srt, sdes = summarise(rt), summarise(des)
                    row = {"task": task_name, "policy": policy_name, "condition": cond.name, "delay_ms": delay,
                           "strategy": strategy, "seeds": list(p.realtime_seeds),
                           "rt_success_rate": srt["success_rate"], "des_success_rate": sdes["success_rate"],
                           "rt_score_mean": srt["score_mean"], "des_score_mean": sdes["score_mean"],
                           "rt_stale_per_episode": srt["stale_per_episode"], "des_stale_per_episode": sdes["stale_per_episode"],
                           "rt_violation_ticks": srt["violation_ticks"], "des_violation_ticks": sdes["violation_ticks"],
                           "rt_jitter_p99_ms": 1000 * max(r.details["jitter"]["p99_s"] for r in rt)}
                    row["agree"] = (row["rt_success_rate"] == row["des_success_rate"]
                                    and (row["rt_stale_per_episode"] == 0) == (row["des_stale_per_episode"] == 0))
                    out.write("agreement", row)
                    rows.append(row)
                    progress.update(advance=len(p.realtime_seeds), extra=f"real time {task_name} {cond.name} {strategy}")
        task.close()
    return rows


def _row_at(rows: Sequence[Mapping[str, Any]], kind: str, x: float, strategy: str) -> Mapping[str, Any] | None:
    """The row of one condition (``kind`` at ``x``) and strategy, if measured."""
    return next((r for r in rows if r["kind"] == kind and r["x"] == x and r["strategy"] == strategy), None)


def acceptance(rows: Sequence[Mapping[str, Any]], p: SweepPlan) -> list[dict[str, Any]]:
    """The benchmark's targets, checked on the discrete-event rows of each (task, policy)."""
    checks = []
    for task_name, policy_name in p.runs:
        mine = [r for r in rows if r["task"] == task_name and r["policy"] == policy_name]
        zero = _row_at(mine, "delay", 0, "chunkline")
        for d in (70, 100, 130):
            c = _row_at(mine, "delay", d, "chunkline")
            if c is None or zero is None:
                continue
            others = [_row_at(mine, "delay", d, s) for s in ("sync", "index")]
            keeps = c["success_rate"] >= 0.95 * zero["success_rate"]
            above = all(o is None or c["success_rate"] >= o["success_rate"] for o in others)
            value = (f"{100 * c['success_rate']:.0f}% vs {100 * zero['success_rate']:.0f}% at 0 ms; "
                     + ", ".join(f"{o['strategy']} {100 * o['success_rate']:.0f}%" for o in others if o))
            checks.append({"task": task_name, "policy": policy_name, "check": f"{d:g} ms: >= 95% of zero-delay success, >= others",
                           "passed": bool(keeps and above), "value": value})
        stale = sum(r["stale_actions"] for r in mine if r["strategy"] == "chunkline")
        checks.append({"task": task_name, "policy": policy_name, "check": "chunkline: zero stale actions, every condition",
                       "passed": stale == 0, "value": f"{stale} stale"})
        for r in mine:
            if r["kind"] == "outage" and r["strategy"] == "chunkline" and r["x"] >= 2.0:
                ok = r["violation_ticks"] == 0 and r["recovered_rate"] == 1.0 and bool(r["fallback_entry_ok"])
                value = (f"violations {r['violation_ticks']}, resumed {100 * r['recovered_rate']:.0f}% "
                         f"(mean {r['recovered_s_mean']:.2f} s), fallback entry max {1000 * r['fallback_entry_s_max']:.1f} ms")
                checks.append({"task": task_name, "policy": policy_name,
                               "check": f"{r['condition']}: no violation, resumed, fallback in time", "passed": ok, "value": value})
    return checks


def _report(p: SweepPlan, rows: list[dict[str, Any]], rt_rows: list[dict[str, Any]], checks: list[dict[str, Any]],
            camera: str, elapsed: float) -> str:
    lines = ["# Closed-loop benchmark", "",
             f"Discrete-event sweep: {len(p.seeds)} episodes per point; camera frames: {camera} (224x224x3 uint8). "
             f"Run took {elapsed:.0f} s. Strategies: sync (openpi), index (LeRobot async), chunkline (broker).", ""]
    cols = [Column("condition", "condition", align="<"), Column("strategy", "strategy", align="<"),
            Column("success", lambda r: 100 * r["success_rate"], ".0f"), Column("score mm", lambda r: 1000 * r["score_mean"], ".1f"),
            Column("stale/ep", "stale_per_episode", ".1f"), Column("fallback s", "fallback_s_mean", ".2f"),
            Column("hold s", "hold_s_mean", ".2f"), Column("violations", "violation_ticks", "d"),
            Column("interventions", "interventions_mean", ".0f"),
            Column("resumed", lambda r: None if math.isnan(r["recovered_rate"]) else 100 * r["recovered_rate"], ".0f"),
            Column("resume s", "recovered_s_mean", ".2f")]
    for task_name, policy_name in p.runs:
        mine = [r for r in rows if r["task"] == task_name and r["policy"] == policy_name]
        if mine:
            lines += [f"## {task_name} / {policy_name} (inference {mine[0]['infer_ms']:.1f} ms)", "", "```",
                      format_table(mine, cols), "```", ""]
    lines += ["## Targets", ""]
    lines += [f"- [{'x' if c['passed'] else ' '}] {c['task']}/{c['policy']}: {c['check']}: {c['value']}" for c in checks]
    if rt_rows:
        lines += ["", "## Real time against discrete-event (same seeds)", "", "```",
                  format_table(rt_rows, [Column("task", "task", align="<"), Column("condition", "condition", align="<"),
                                         Column("strategy", "strategy", align="<"),
                                         Column("RT success", lambda r: 100 * r["rt_success_rate"], ".0f"),
                                         Column("DES success", lambda r: 100 * r["des_success_rate"], ".0f"),
                                         Column("RT mm", lambda r: 1000 * r["rt_score_mean"], ".1f"),
                                         Column("DES mm", lambda r: 1000 * r["des_score_mean"], ".1f"),
                                         Column("RT stale", "rt_stale_per_episode", ".1f"),
                                         Column("DES stale", "des_stale_per_episode", ".1f"),
                                         Column("RT viol", "rt_violation_ticks", "d"), Column("DES viol", "des_violation_ticks", "d"),
                                         Column("agree", lambda r: "yes" if r["agree"] else "no", align="<")]), "```", "",
                  f"Agreement (same success rate, and stale actions zero in both or in neither): "
                  f"{sum(r['agree'] for r in rt_rows)}/{len(rt_rows)} points. (At 0 ms the synchronous and index "
                  "strategies run their first action exactly one period after its due time: at the tolerance on the "
                  "simulated clock, just past it with real tick jitter; so they count stale actions in real time only.)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the suite; returns 0 (the targets are reported, not enforced). ``--rtc`` runs the
    extended sweep of :mod:`.rtc_suite` instead (every merge mode, 0-400 ms, the jumping target);
    ``--steps-sweep`` the sweep in control steps of :mod:`.delay_steps`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--rtc" in argv:
        from .rtc_suite import main as rtc_main

        return rtc_main([a for a in argv if a != "--rtc"])
    if "--steps-sweep" in argv:
        from .delay_steps import main as steps_main

        return steps_main([a for a in argv if a != "--steps-sweep"])
    ap = argparse.ArgumentParser(prog=f"chunkline bench {SUITE}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small version (about a minute)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default results/closed-loop)")
    ap.add_argument("--seeds", type=int, default=None, help="episodes per point")
    ap.add_argument("--no-realtime", action="store_true", help="skip the real-time checks")
    ap.add_argument("--tasks", default=None, help="comma-separated tasks (reach, track7)")
    # Handled above (another suite each); listed so that --help names them.
    ap.add_argument("--rtc", action="store_true",
                    help="instead: every way of consuming chunks (sync, index, the broker's replace, blend, ensemble, "
                         "rtc) at 0-400 ms one-way delay with jitter and spikes, and a target that jumps; "
                         "its own options: --rtc --help")
    ap.add_argument("--steps-sweep", action="store_true",
                    help="instead: success against delay in control steps (d = 0..20); its own options: --steps-sweep --help")
    args = ap.parse_args(argv)
    p = plan(args.quick)
    if args.seeds is not None:
        p.seeds = tuple(range(args.seeds))
    if args.tasks:
        keep = set(args.tasks.split(","))
        p.runs = tuple(r for r in p.runs if r[0] in keep)
        p.realtime = tuple(r for r in p.realtime if r[0] in keep)
    if args.no_realtime:
        p.realtime = ()
    try:
        make_task("reach").close()
    except TaskUnavailable as exc:
        print(f"closed-loop: {exc}", file=sys.stderr)
        return 2
    out = ResultsDir(args.out or default_out(SUITE), SUITE)
    total = len(p.runs) * len(_conditions(p)) * len(STRATEGIES) * len(p.seeds) + len(p.realtime) * len(STRATEGIES) * len(p.realtime_seeds)
    progress = Progress(total, "closed-loop")
    started = time.monotonic()
    rows, timelines = _run_des(p, out, progress)
    rt_rows = _run_realtime(p, rows, out, progress) if p.realtime else []
    progress.close()
    checks = acceptance(rows, p)
    for c in checks:
        out.write("acceptance", c)
    for task_name, policy_name in p.runs:
        mine = [r for r in rows if r["task"] == task_name and r["policy"] == policy_name and r["kind"] == "delay"]
        if mine:
            plot_success_vs_delay(mine, out.file(f"success_vs_delay_{task_name}_{policy_name}.png"),
                                  title=f"{task_name} / {policy_name}: success, error and stale actions vs one-way delay")
        tls = timelines.get((task_name, policy_name))
        if tls:
            o = next(c for c, kind, _ in _conditions(p) if kind == "outage" and c.outages[0].duration >= 2.0).outages[0]
            plot_outage_timeline(tls, (o.start, o.end), out.file(f"outage_timeline_{task_name}_{policy_name}.png"),
                                 title=f"{task_name} / {policy_name}: one episode through a {o.duration:g} s {o.mode}",
                                 tolerance_m=make_task(task_name).tolerance_m)
    report = _report(p, rows, rt_rows, checks, "synthetic", time.monotonic() - started)
    out.write_text("report.md", report)
    cols = [Column("task", "task", align="<"), Column("policy", "policy", align="<"), Column("condition", "condition", align="<"),
            Column("strategy", "strategy", align="<"), Column("success %", lambda r: 100 * r["success_rate"], ".0f"),
            Column("score mm", lambda r: 1000 * r["score_mean"], ".1f"), Column("stale/ep", "stale_per_episode", ".1f"),
            Column("violations", "violation_ticks", "d")]
    print(format_table(rows, cols, title="closed loop (discrete-event)"))
    for c in checks:
        print(f"[{'PASS' if c['passed'] else 'FAIL'}] {c['task']}/{c['policy']}: {c['check']}: {c['value']}")
    if rt_rows:
        print(f"real time vs discrete-event: {sum(r['agree'] for r in rt_rows)}/{len(rt_rows)} points agree")
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
