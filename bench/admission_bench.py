"""``python -m chunkline.bench.admission_bench``: what one admission costs as the queue grows.

One model's :class:`~chunkline.server.core.admission.AdmissionController` (batches of 8, one
tenant) is filled to each ``--depths`` with far deadlines; each round times ``--offers`` offers
(admitted, then cancelled) of a newcomer whose deadline is the latest queued (**in order**),
anywhere (**random**) or the earliest (**first**: it overtakes them all). Rounds alternate cells;
the table gives the median over rounds of p50 and p99. ``--baseline-src DIR`` runs each round
against the checkout in ``DIR`` too (a child process), for new / base ratios. ``--cycle`` times a
request's whole way through admission as the robot runner drives it (offer, next_batch,
complete_batch and the calls around them), in us and Python calls per request.

    chunkline bench admission [--depths 8 64 512 4096] [--rounds 3] [--baseline-src DIR]
    chunkline bench admission --cycle [--robots 1 4] [--batch 1 4] [--cycles 2000] [--rounds 3] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.bench.report import Column, format_table
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry

__all__ = ["main", "offer_cost", "cycle_cost"]

PLACES = ("in order", "random", "first")
#: queued deadlines lie in [FAR, FAR + 1) s: admission never refuses one for its budget
FAR = 1e5


def _controller(depth: int, tenants: int, seed: int) -> AdmissionController:
    reg = TenantRegistry({f"t{i}": TenantInfo(f"t{i}") for i in range(tenants)})
    config = AdmissionConfig(max_queue=depth + 1, max_batch_size=8)
    c = AdmissionController("m", QuotaManager(reg), config, ServiceTimeModel(initial={1: 0.004, 8: 0.01}))
    rng = random.Random(seed)
    for i in range(depth):
        r = Request(("q", i), f"s{i}", f"t{i % tenants}", "policy", PolicyCost(), FAR + rng.random())
        if not isinstance(c.offer(r, 0.0), Admitted):
            raise RuntimeError(f"filling the queue: request {i} was refused")
    return c


def offer_cost(c: AdmissionController, place: str, offers: int, seed: int) -> np.ndarray:
    """Nanoseconds per ``offer`` of ``offers`` newcomers at ``place`` (see the module docstring)."""
    rng = random.Random(seed)
    out = np.empty(offers, dtype=np.int64)
    clock = time.perf_counter_ns
    for k in range(offers):
        deadline = FAR + (1.5 if place == "in order" else -0.5 if place == "first" else rng.random())
        r = Request(("new", seed, k), "new", "t0", "policy", PolicyCost(), deadline)
        t = clock()
        verdict = c.offer(r, 0.0)
        out[k] = clock() - t
        if not isinstance(verdict, Admitted):
            raise RuntimeError(f"a newcomer was refused: {verdict}")
        c.cancel(r.id, 0.0)
    return out


#: a cycle's requests' budget: a robot's (admission never refuses one on an idle noop model)
BUDGET_S = 0.05
#: how long a cycle's batch runs, as the runner reports it to ``complete_batch``
SERVICE_S = 0.0005


def _cycle_controller(batch: int) -> AdmissionController:
    # The runner's defaults (server/robot/config.py): one lane, arrival-rate estimate on.
    reg = TenantRegistry({"t0": TenantInfo("t0")})
    config = AdmissionConfig(max_batch_size=max(batch, 1), workers=1)
    return AdmissionController("m", QuotaManager(reg), config, ServiceTimeModel(initial={1: SERVICE_S}))


def _compatible(first: Request, other: Request) -> bool:
    return True  # the runner compares the observations' shapes: all alike here


def _cycles(c: AdmissionController, robots: int, batch: int, cycles: int, seed: int) -> Iterator[int]:
    """Drive ``c`` through ``cycles`` cycles (see the module docstring), yielding the
    :func:`time.perf_counter_ns` each took."""
    clock = time.perf_counter_ns
    now = float(seed)
    for k in range(cycles):
        reqs = [Request(("r", seed, k, i), f"s{i}", "t0", "policy", PolicyCost(), now + BUDGET_S) for i in range(robots)]
        t = clock()
        for r in reqs:
            verdict = c.offer(r, now)
            c.take_dropped()
            _ = c.queued
            c.next_expiry()
            if not isinstance(verdict, Admitted):
                raise RuntimeError(f"a request was refused: {verdict}")
        while c.queued:
            picked = c.next_batch(now, batch, _compatible)
            c.take_dropped()
            _ = c.queued
            c.service.predict(len(picked))
            c.service.mean(len(picked))
            now += 0.001
            c.complete_batch(picked, now, SERVICE_S)
            c.next_expiry()
        now += 0.001
        yield clock() - t


def cycle_cost(robots: int, batch: int, cycles: int, seed: int) -> np.ndarray:
    """Nanoseconds per request of ``cycles`` cycles (see the module docstring)."""
    c = _cycle_controller(batch)
    for _ in _cycles(c, robots, batch, 50, seed):  # warm the service model and the caches
        pass
    return np.fromiter(_cycles(c, robots, batch, cycles, seed), dtype=np.int64, count=cycles) / robots


def cycle_calls(robots: int, batch: int, cycles: int = 200) -> float:
    """Python function calls per request over ``cycles`` cycles (``cProfile``'s count)."""
    c = _cycle_controller(batch)
    for _ in _cycles(c, robots, batch, 50, 0):
        pass
    profile = cProfile.Profile()
    profile.enable()
    for _ in _cycles(c, robots, batch, cycles, 1):
        pass
    profile.disable()
    # Counted: every call into the server's code and every call made from it (builtins, the
    # decision dataclasses); not the loop's own (building requests, reading the clock).
    server = str(Path(sys.modules[AdmissionController.__module__].__file__ or "").parents[2])

    def ours(key: tuple[str, int, str]) -> bool:
        return key[0].startswith(server)

    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    calls = 0
    for func, (_, _, _, _, callers) in stats.items():
        calls += sum(counts[1] for caller, counts in callers.items() if ours(func) or ours(caller))
    return calls / (robots * cycles)


Samples = dict[tuple[int, ...], list[dict[str, float]]]


def one_round(controllers: dict[int, AdmissionController], offers: int, r: int) -> list[dict[str, Any]]:
    """One round over every depth and place: p50 and p99 (us) of each cell."""
    out = []
    for d, c in controllers.items():
        for i, place in enumerate(PLACES):
            us = offer_cost(c, place, offers, r) / 1000.0
            out.append({"key": [d, i], "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))})
    return out


def one_cycle_round(args: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    """One round over every robots x batch cell: us per request (p50, p99) and calls per request."""
    out = []
    for robots in args.robots:
        for batch in args.batch:
            us = cycle_cost(robots, batch, args.cycles, r) / 1000.0
            out.append({"key": [robots, batch], "p50_us": float(np.percentile(us, 50)),
                        "p99_us": float(np.percentile(us, 99)), "calls": cycle_calls(robots, batch) if r == 0 else math.nan})
    return out


def _round(args: argparse.Namespace, r: int, controllers: dict[int, AdmissionController] | None) -> list[dict[str, Any]]:
    if args.cycle:
        return one_cycle_round(args, r)
    if controllers is None:
        controllers = {d: _controller(d, args.tenants, d) for d in args.depths}
    return one_round(controllers, args.offers, r)


def _child_round(src: Path, farm: str | None, args: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    """Round ``r`` of this file in a child whose ``chunkline`` is the checkout ``src`` (this
    tree's when ``farm`` is ``None``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--depths", *map(str, args.depths), "--offers", str(args.offers),
           "--tenants", str(args.tenants), "--robots", *map(str, args.robots), "--batch", *map(str, args.batch),
           "--cycles", str(args.cycles), *(["--cycle"] if args.cycle else []), "--one-round", str(r)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (farm, os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{src}: a round failed:\n{done.stderr.strip()[-2000:]}")
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def run(args: argparse.Namespace, baseline_farm: str | None = None) -> list[dict[str, Any]]:
    """Alternating rounds (this tree, then the baseline's where given); medians over rounds."""
    controllers = None if args.cycle or baseline_farm is not None else {d: _controller(d, args.tenants, d) for d in args.depths}
    samples: dict[str, Samples] = {"new": {}, "base": {}}
    for r in range(args.rounds):
        if baseline_farm is None:
            rounds = [("new", _round(args, r, controllers))]
        else:
            # Both sides in like child processes: the parent's heap (the baseline's set-up
            # imported much more) would make its collections dearer than the child's.
            here = Path(__file__).resolve().parents[1]
            rounds = [("new", _child_round(here, None, args, r)),
                      ("base", _child_round(args.baseline_src, baseline_farm, args, r))]
        for who, cells in rounds:
            for cell in cells:
                samples[who].setdefault(tuple(cell["key"]), []).append(cell)
    rows = []
    if args.cycle:
        keys = [((robots, batch), {"robots": robots, "batch": batch}) for robots in args.robots for batch in args.batch]
    else:
        keys = [((d, i), {"depth": d, "place": place}) for d in args.depths for i, place in enumerate(PLACES)]
    for key, row in keys:
        for who, prefix in (("new", ""), ("base", "base_")):
            got = samples[who].get(key)
            if got:
                for stat in ("p50_us", "p99_us", "calls"):
                    values = [c[stat] for c in got if stat in c and not math.isnan(c[stat])]
                    if values:
                        row[f"{prefix}{stat}"] = float(np.median(values))
        if "base_p50_us" in row:
            row["p50_ratio"] = row["p50_us"] / row["base_p50_us"]
        if "base_calls" in row:
            row["calls_ratio"] = row["calls"] / row["base_calls"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkline.bench.admission_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 64, 512, 4096], help="queue depths")
    parser.add_argument("--offers", type=int, default=2000, help="offers timed per depth, place and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--tenants", type=int, default=1, help="tenants the queued requests are spread over")
    parser.add_argument("--cycle", action="store_true", help="time the whole per-request cycle instead (see above)")
    parser.add_argument("--robots", type=int, nargs="+", default=[1, 4], help="--cycle: requests per cycle")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="--cycle: most requests per batch")
    parser.add_argument("--cycles", type=int, default=2000, help="--cycle: cycles timed per cell and round")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="another checkout of this repository, timed in alternating rounds in the same run")
    parser.add_argument("--one-round", type=int, default=None, help=argparse.SUPPRESS)  # a baseline child's round
    args = parser.parse_args(argv)
    if min(args.depths) < 1 or args.offers < 1 or args.rounds < 1 or args.tenants < 1:
        parser.error("--depths, --offers, --rounds and --tenants must be >= 1")
    if min(args.robots) < 1 or min(args.batch) < 1 or args.cycles < 1:
        parser.error("--robots, --batch and --cycles must be >= 1")
    if args.one_round is not None:
        print(json.dumps(_round(args, args.one_round, None)))
        return 0
    if args.cycle:
        columns = [Column("robots", "robots", "d"), Column("batch", "batch", "d"),
                   Column("us/req p50", "p50_us", ".2f"), Column("us/req p99", "p99_us", ".2f"),
                   Column("calls/req", "calls", ".1f")]
        title = (f"admission's whole cycle per request (offer .. complete_batch, as the robot runner calls it): "
                 f"{args.rounds} alternating rounds of {args.cycles} cycles, one tenant: medians over rounds")
    else:
        columns = [Column("depth", "depth", "d"), Column("newcomer", "place", align="<"),
                   Column("p50 us", "p50_us", ".1f"), Column("p99 us", "p99_us", ".1f")]
        title = (f"AdmissionController.offer: {args.rounds} alternating rounds of {args.offers} offers, "
                 f"{args.tenants} tenant(s), batches of 8: medians over rounds")
    with tempfile.TemporaryDirectory(prefix="chunkline-admission-") as tmp:
        farm = None
        if args.baseline_src is not None:
            from chunkline.bench.overhead import baseline_pythonpath

            farm = baseline_pythonpath(args.baseline_src, Path(tmp) / "farm")
            if args.cycle:
                columns += [Column("base p50", "base_p50_us", ".2f"), Column("base p99", "base_p99_us", ".2f"),
                            Column("base calls", "base_calls", ".1f"), Column("p50 new/base", "p50_ratio", ".2f"),
                            Column("calls new/base", "calls_ratio", ".2f")]
            else:
                columns += [Column("base p50 us", "base_p50_us", ".1f"), Column("base p99 us", "base_p99_us", ".1f"),
                            Column("p50 new/base", "p50_ratio", ".2f")]
        rows = run(args, farm)
    print(format_table(rows, columns, title=title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
