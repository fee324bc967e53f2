"""Broker benchmark: the per-tick cost, and prefetch accuracy against a naive openpi-style broker.

1. Tick cost: ``Broker.tick(now)`` timed call by call over ``--ticks`` ticks of a 50 x 14 chunk
   stream at 50 Hz on a simulated clock (chunks arrive through the sans-I/O interface, so only the
   broker's work is timed); all ticks, act-only ticks, request ticks. Target: p99 <= 50 us.
   ``--compare VARIANT`` (a merge mode plus ``,field=value`` settings) alternates a second setting
   in the same run; ``--baseline-src DIR`` alternates another checkout's broker in fresh processes.
2. Prefetch accuracy: a discrete-event 50 Hz loop with 50 +- 20 ms round trips (and 5 % delayed by
   250 ms more): the fraction of ticks running a valid action against openpi-client's
   ``ActionChunkBroker`` semantics (blocks when its horizon is used up, replays from the first
   action), with stale and blocked ticks and the tracking error."""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode
from chunkline.broker.sim import ScriptedServer, simulate
from chunkline.safety import Limits, Mode, MotionState

from .report import Column, ResultsDir, format_table

__all__ = ["main", "tick_cost", "compare_tick_cost", "baseline_tick_cost", "parse_variant", "prefetch_accuracy", "naive_openpi",
           "latency_trace"]

DT = 0.02  # 50 Hz
A = 14
H = 50
ACTION_HORIZON = 25  # openpi's ALOHA real-robot setting: 25 of 50 steps per inference


def reference(t: float | np.ndarray) -> np.ndarray:
    """The trajectory the stand-in policy follows: 0.3 rad, 0.5 Hz sines, one phase per joint."""
    t = np.asarray(t, dtype=np.float64)
    return 0.3 * np.sin(2 * np.pi * 0.5 * t[..., None] + np.arange(A) * 0.4)


def policy_actions(obs_time: float) -> np.ndarray:
    """A chunk for an observation taken at ``obs_time``: the reference at each action's due time."""
    return reference(obs_time + np.arange(H) * DT).astype(np.float32)


def make_limits() -> Limits:
    return Limits(lower=np.full(A, -math.pi), upper=np.full(A, math.pi), max_velocity=np.full(A, 3.0),
                  max_acceleration=np.full(A, 30.0), dt=DT)


def make_broker(**config: Any) -> Broker:
    return Broker(BrokerConfig(control_period_s=DT, **config), initial_position=reference(0.0), limits=make_limits())


def latency_trace(n: int, seed: int, spikes: float = 0.0) -> np.ndarray:
    """Round trips in seconds: N(50 ms, 10 ms) clipped to [30, 70] ms, plus a 250 ms delay on a
    ``spikes`` fraction of requests."""
    rng = np.random.default_rng(seed)
    lat = np.clip(rng.normal(0.050, 0.010, n), 0.030, 0.070)
    if spikes:
        lat = lat + np.where(rng.random(n) < spikes, 0.250, 0.0)
    return lat


def _pcts(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1000.0
    p = np.percentile(us, [50, 90, 99, 99.9]) if us.size else [math.nan] * 4
    return {"n": int(us.size), "p50_us": float(p[0]), "p90_us": float(p[1]), "p99_us": float(p[2]),
            "p999_us": float(p[3]), "max_us": float(us.max()) if us.size else math.nan}


def parse_variant(text: str) -> dict[str, Any]:
    """``"rtc,rtc_min_replan_s=0"`` -> ``{"merge": "rtc", "rtc_min_replan_s": 0}``, checked by
    building the :class:`BrokerConfig`.

    Raises:
        ValueError: an unknown merge mode or field, a value out of range, or no ``=``.
    """
    head, *rest = [part.strip() for part in text.split(",")]
    config: dict[str, Any] = {"merge": MergeMode(head).value}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected field=value, got {item!r}")
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    try:
        BrokerConfig(control_period_s=DT, **config)
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    return config


def tick_cost(ticks: int, seed: int = 0, progress: Callable[[str], None] | None = None,
              merge: str = "replace", config: Mapping[str, Any] | None = None, parts: bool = True) -> list[dict[str, Any]]:
    """Time ``Broker.tick`` over ``ticks`` ticks of a chunk stream (see the module docstring),
    with the broker's ``merge`` mode (``rtc`` re-plans once per execution horizon or round trip:
    more request ticks) and further ``config`` settings; ``parts``: also time the timeline lookup
    and the filter alone."""
    broker = make_broker(**{"merge": merge, **(config or {})})
    lat = latency_trace(1 + ticks // 2, seed)
    obs = {"state": np.zeros(A, np.float32)}
    per_tick = np.empty(ticks, dtype=np.int64)
    requested = np.zeros(ticks, dtype=bool)
    pending: list[tuple[float, int, ActionChunk]] = []  # every request in flight answers, in arrival order
    n_req = 0
    clock = time.perf_counter_ns
    for i in range(ticks):
        now = i * DT
        while pending and pending[0][0] <= now:
            arrived, _, chunk = heapq.heappop(pending)
            broker.on_chunk(chunk, arrived)
        t = clock()
        cmd = broker.tick(now, obs)
        per_tick[i] = clock() - t
        if cmd.request is not None:
            requested[i] = True
            broker.on_sent(cmd.request.request_id, now)
            arrival = now + float(lat[n_req % lat.size])
            n_req += 1
            chunk = ActionChunk(policy_actions(cmd.request.obs_time), cmd.request.obs_time, DT,
                                cmd.request.obs_time + H * DT, cmd.request.request_id, arrival)
            heapq.heappush(pending, (arrival, n_req, chunk))
        if progress is not None and i and i % 200_000 == 0:
            progress(f"tick cost: {i}/{ticks}")
    dog = broker.watchdog
    rows = [
        {"kind": "tick_cost", "what": "tick (all ticks)", **_pcts(per_tick)},
        {"kind": "tick_cost", "what": "tick (act only, no request)", **_pcts(per_tick[~requested])},
        {"kind": "tick_cost", "what": "tick (ticks issuing a request)", **_pcts(per_tick[requested])},
    ]
    rows[0]["policy_fraction"] = dog.counts.policy_ticks / ticks
    rows[0]["requests_per_s"] = int(requested.sum()) / (ticks * DT)
    if not parts:
        return rows
    # The two halves of act(now), alone: the lookup on a valid timeline, and the filter fed
    # its own last command as the state (as the watchdog does), with a passing action.
    k_ns = np.empty(200_000, dtype=np.int64)
    f_ns = np.empty(200_000, dtype=np.int64)
    timeline, filt = broker.timeline, dog.filter
    assert filt is not None
    now = (ticks - 1) * DT
    for j in range(k_ns.size):
        t = clock()
        timeline.lookup(now)
        k_ns[j] = clock() - t
    state = MotionState(dog.state.position, dog.state.velocity)
    v = np.full(A, 0.2)
    for j in range(f_ns.size):
        if j % 500 == 0:
            v = -v  # turn around now and then, within the acceleration limit
        target = state.position + v * DT
        target.flags.writeable = False
        t = clock()
        filtered, _ = filt.apply(target, state)
        f_ns[j] = clock() - t
        assert filtered is not None, "the filter refused a passing action"
        state = MotionState(filtered, filt.velocity)
    rows.append({"kind": "tick_cost", "what": "timeline lookup alone", **_pcts(k_ns)})
    rows.append({"kind": "tick_cost", "what": "safety filter alone", **_pcts(f_ns)})
    return rows


def compare_tick_cost(variants: Sequence[Mapping[str, Any]], ticks: int, rounds: int = 3, seed: int = 0,
                      progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Time each broker setting in ``variants`` (:func:`parse_variant`'s dicts) ``rounds`` times,
    alternating (A B A B: both see the same load on a shared machine); per variant and kind of
    tick, the median over rounds of each round's p50 and p99 (and the p99's range over rounds)."""
    runs: list[list[list[dict[str, Any]]]] = [[] for _ in variants]
    for r in range(rounds):
        for i, variant in enumerate(variants):
            if progress is not None:
                progress(f"tick cost: round {r + 1}/{rounds}, {_label(variant)}")
            runs[i].append(tick_cost(ticks, seed, None, config=variant, parts=False))
    out = []
    for variant, rows in zip(variants, runs, strict=True):
        for j, what in enumerate(row["what"] for row in rows[0]):
            p50 = [rnd[j]["p50_us"] for rnd in rows]
            p99 = [rnd[j]["p99_us"] for rnd in rows]
            out.append({"variant": _label(variant), "what": what, "rounds": rounds, "n": rows[0][j]["n"],
                        "p50_us": float(np.median(p50)), "p99_us": float(np.median(p99)),
                        "p99_min_us": float(np.min(p99)), "p99_max_us": float(np.max(p99)),
                        "requests_per_s": rows[0][0]["requests_per_s"]})
    return out


#: the folders installed as ``chunkline.<folder>`` (pyproject's package-dir)


def _checkout_rows(src: Path | None, variant: str, ticks: int, seed: int, work: Path) -> list[dict[str, Any]]:
    """One fresh process timing ``variant`` with the broker of checkout ``src`` (``None``: this
    one): a folder of links named as the installed packages, first on ``PYTHONPATH``, makes
    ``chunkline`` that checkout's (:func:`chunkline.bench.overhead.baseline_pythonpath`: a regular
    package, so that no other ``chunkline`` later on the path shadows a part of it)."""
    env = dict(os.environ)
    if src is not None:
        from .overhead import baseline_pythonpath  # the server-side benchmark's imports: only here

        farm = work / "farm"
        path = str(farm) if farm.exists() else baseline_pythonpath(src, farm)
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    out = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "chunkline.bench.broker_bench", "--ticks", str(ticks), "--sim-s", "0.5", "--seed", str(seed),
           "--merge", variant, "--out", str(out)]
    done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} ({src or 'this checkout'}) failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "tick_cost" and str(r.get("what", "")).startswith("tick (")]


def baseline_tick_cost(src: Path, variant: str, ticks: int, rounds: int = 3, seed: int = 0,
                       progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Time ``variant`` (``--merge``'s text) with checkout ``src``'s broker and with this one's,
    ``rounds`` times alternating, a fresh process per side and round; medians as in
    :func:`compare_tick_cost`."""
    if not all((src / name).is_dir() for name in ("broker", "bench", "safety")):
        raise ValueError(f"{src} is not a chunkline checkout (no broker/, bench/, safety/)")
    sides: list[tuple[str, Path | None]] = [(f"{src} (baseline)", src), ("this checkout", None)]
    runs: list[list[list[dict[str, Any]]]] = [[], []]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, (name, path) in enumerate(sides):
                if progress is not None:
                    progress(f"tick cost: round {r + 1}/{rounds}, {name}")
                runs[i].append(_checkout_rows(path, variant, ticks, seed, Path(tmp)))
    out = []
    for (name, _), rows in zip(sides, runs, strict=True):
        for j, first in enumerate(rows[0]):
            p50 = [rnd[j]["p50_us"] for rnd in rows]
            p99 = [rnd[j]["p99_us"] for rnd in rows]
            out.append({"variant": f"{variant}: {name}", "what": first["what"], "rounds": rounds, "n": first["n"],
                        "p50_us": float(np.median(p50)), "p99_us": float(np.median(p99)),
                        "p99_min_us": float(np.min(p99)), "p99_max_us": float(np.max(p99)),
                        "requests_per_s": rows[0][0].get("requests_per_s", rows[0][-1]["n"] / (ticks * DT))})
    return out


def _variant_arg(text: str) -> dict[str, Any]:
    try:
        return parse_variant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _label(variant: Mapping[str, Any]) -> str:
    return ",".join([str(variant["merge"])] + [f"{k}={v}" for k, v in variant.items() if k != "merge"])


def _tracking_error(times: np.ndarray, actions: np.ndarray) -> float:
    return float(np.mean(np.abs(actions - reference(times))))


def prefetch_accuracy(lat: np.ndarray, duration_s: float) -> dict[str, Any]:
    """This broker on a latency trace: fraction of ticks on a valid policy action."""
    broker = make_broker()
    server = ScriptedServer(policy=lambda obs, t, prefix: policy_actions(t), dt=DT, latency=lambda i, t: float(lat[i % lat.size]))
    res = simulate(broker, server, duration_s=duration_s)
    ages = res.ages[~np.isnan(res.ages)]
    start = res.modes.index(Mode.POLICY) if Mode.POLICY in res.modes else len(res.modes)
    steady = res.modes[start:]
    lim = make_limits()
    state = MotionState.at_rest(reference(0.0))
    in_limits = True
    for a in res.actions:
        in_limits = in_limits and lim.step_ok(state, a)
        state = state.advanced(a, DT)
    return {
        "ticks": len(res.modes),
        "valid_fraction": res.policy_fraction,
        "valid_fraction_after_first": sum(m is not Mode.FALLBACK for m in steady) / max(1, len(steady)),
        "fallback_ticks": res.fallback_ticks(),
        "stale_fraction": float(np.mean(ages > DT + 1e-9)) if ages.size else 0.0,
        "blocked_fraction": 0.0,
        "max_age_ms": float(ages.max() * 1000) if ages.size else math.nan,
        "requests": broker.stats.requests_sent,
        "latency_p95_ms": broker.latency.estimate * 1000,
        "tracking_error": _tracking_error(res.times, res.actions),
        "commands_in_limits": bool(in_limits),
    }


def naive_openpi(lat: np.ndarray, duration_s: float, action_horizon: int = ACTION_HORIZON) -> dict[str, Any]:
    """openpi-client 0.1.2's ``ActionChunkBroker`` semantics on the same trace (see the module docstring)."""
    n = int(round(duration_s / DT))
    times = np.arange(n) * DT
    actions = np.empty((n, A))
    status = np.empty(n, dtype="<U7")
    ages = np.full(n, math.nan)
    last = reference(0.0)
    chunk: np.ndarray | None = None
    t0 = 0.0
    step = 0
    busy_until = -1.0
    req = 0
    for i in range(n):
        now = times[i]
        if now < busy_until:
            status[i] = "blocked"  # the loop is stuck in infer(): the actuators keep the last command
            actions[i] = last
            continue
        if chunk is None:
            # Blocks here: the reply comes one round trip later, and the loop resumes at the
            # first tick after it with the chunk's *first* action (due at the observation time).
            t0 = now
            chunk = policy_actions(t0).astype(np.float64)
            busy_until = now + float(lat[req % lat.size])
            req += 1
            step = 0
            status[i] = "blocked"
            actions[i] = last
            continue
        age = now - (t0 + step * DT)
        last = chunk[step]
        actions[i] = last
        ages[i] = age
        status[i] = "stale" if age > DT + 1e-9 else "ontime"
        step += 1
        if step >= action_horizon:
            chunk = None
    return {
        "ticks": n,
        "valid_fraction": float(np.mean(status == "ontime")),
        "valid_fraction_after_first": float(np.mean(status[1:] == "ontime")),
        "fallback_ticks": 0,
        "stale_fraction": float(np.mean(status == "stale")),
        "blocked_fraction": float(np.mean(status == "blocked")),
        "max_age_ms": float(np.nanmax(ages) * 1000),
        "requests": req,
        "latency_p95_ms": float(np.percentile(lat[:req], 95) * 1000) if req else math.nan,
        "tracking_error": _tracking_error(times, actions),
        "commands_in_limits": None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkline.bench.broker_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ticks", type=int, default=1_000_000, help="ticks timed for the tick cost (default 1e6)")
    parser.add_argument("--sim-s", type=float, default=300.0, help="simulated seconds per latency trace (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--merge", type=_variant_arg, default="replace",
                        help="the broker's merge mode for the tick cost, optionally with ,field=value settings (default replace)")
    parser.add_argument("--compare", type=_variant_arg, default=None,
                        help="another setting (e.g. replace, or rtc,rtc_min_replan_s=0) timed in the same run, alternating rounds")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="another checkout (e.g. ../main) whose broker is timed with --merge against this one's, "
                             "alternating processes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --compare or --baseline-src: alternating rounds of --ticks each (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="also write results.jsonl to this folder")
    args = parser.parse_args(argv)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.perf_counter()
    if args.compare is not None and args.baseline_src is not None:
        parser.error("--compare and --baseline-src: one at a time")
    compared = args.compare is not None or args.baseline_src is not None
    if compared:
        if args.baseline_src is not None:
            cost = baseline_tick_cost(args.baseline_src, _label(args.merge), args.ticks, args.rounds, args.seed, progress)
        else:
            cost = compare_tick_cost([args.merge, args.compare], args.ticks, args.rounds, args.seed, progress)
        title = (f"Broker.tick cost, {args.rounds} alternating rounds of {args.ticks} ticks, 50x{A} chunks at 50 Hz, "
                 f"50 +- 20 ms round trips, safety filter on: medians over rounds (target p99 <= 50 us)")
        for row in cost:
            row["kind"] = "tick_compare"
    else:
        cost = tick_cost(args.ticks, args.seed, progress, config=args.merge)
        title = (f"Broker.tick cost: {args.ticks} ticks, 50x{A} chunks at 50 Hz, {_label(args.merge)}, safety filter on "
                 f"({cost[0]['requests_per_s']:.1f} requests/s; target p99 <= 50 us)")
    # One table for both: a comparison adds the setting and the spread over rounds, one run its tail.
    print(format_table(cost, [
        *([Column("setting", "variant", align="<")] if compared else []),
        Column("measured", "what", align="<"),
        Column("n/round" if compared else "n", "n", "d"),
        Column("p50 us", "p50_us", ".2f"),
        *([] if compared else [Column("p90 us", "p90_us", ".2f")]),
        Column("p99 us", "p99_us", ".2f"),
        *([Column("p99 range", lambda r: f"{r['p99_min_us']:.1f}-{r['p99_max_us']:.1f}", align=">"),
           Column("requests/s", "requests_per_s", ".1f")] if compared else
          [Column("p99.9 us", "p999_us", ".2f"), Column("max us", "max_us", ".0f")]),
    ], title=title))
    print()

    rows: list[dict[str, Any]] = []
    n_req = int(args.sim_s / (ACTION_HORIZON * DT) * 4) + 100
    for trace, spikes in (("50+-20 ms", 0.0), ("50+-20 ms, 5% +250 ms", 0.05)):
        lat = latency_trace(n_req, args.seed + 1, spikes)
        progress(f"prefetch: {trace}")
        rows.append({"kind": "prefetch", "trace": trace, "broker": "chunkline", **prefetch_accuracy(lat, args.sim_s)})
        rows.append({"kind": "prefetch", "trace": trace, "broker": "naive openpi-style", **naive_openpi(lat, args.sim_s)})
    print(format_table(rows, [
        Column("latency trace", "trace", align="<"),
        Column("broker", "broker", align="<"),
        Column("valid", "valid_fraction", ".4f"),
        Column("stale", "stale_fraction", ".4f"),
        Column("blocked", "blocked_fraction", ".4f"),
        Column("fallback", "fallback_ticks", "d"),
        Column("max age ms", "max_age_ms", ".1f"),
        Column("requests", "requests", "d"),
        Column("track err", "tracking_error", ".4f"),
    ], title=f"Prefetch accuracy: {args.sim_s:g} s simulated at 50 Hz, chunks 50x{A}, openpi executes {ACTION_HORIZON} per chunk"))
    print(f"\n(valid = fraction of ticks running a policy action due now; stale = an action due more than one "
          f"period ago; blocked = the loop waits in infer(); took {time.perf_counter() - started:.1f} s)")

    if args.out is not None:
        out = ResultsDir(args.out, "broker")
        for row in cost + rows:
            out.write(row.pop("kind"), row)
        print(out.listing())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
