"""``python -m chunkline.bench.admission_bench``: what one admission costs as the queue grows.

One model's :class:`~chunkline.server.core.admission.AdmissionController` (batches of 8, deadline
queueing, one tenant by default) is filled to each ``--depths`` with requests whose deadlines lie
far ahead and spread at random; then each round times ``--offers`` calls of ``offer`` (each admitted
and cancelled again, so the depth holds) for a newcomer whose deadline is the latest queued
(**in order**: it overtakes nothing, the usual case), anywhere among them (**random**: it
overtakes half), or the earliest (**first**: it overtakes them all, as a robot with a short budget
does under a retry storm). Rounds alternate the depths and places, so a drift of a shared machine
hits every cell alike; the table gives the median over rounds of each round's p50 and p99.

It uses only the controller's public calls, so it times another checkout's controller too:
``--baseline-src DIR`` runs each round of this file against the checkout in ``DIR`` as well (in
a child process whose ``chunkline`` is imported from ``DIR``), alternating with this tree's, and
the table gives both and their ratio.

    chunkline bench admission [--depths 8 64 512 4096] [--rounds 3] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.bench.report import Column, format_table
from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry

__all__ = ["main", "offer_cost"]

PLACES = ("in order", "random", "first")
#: queued deadlines lie in [FAR, FAR + 1) s: admission never refuses one for its budget
FAR = 1e5


def _controller(depth: int, tenants: int, seed: int) -> AdmissionController:
    reg = TenantRegistry({f"t{i}": TenantInfo(f"t{i}") for i in range(tenants)})
    config = AdmissionConfig(max_queue=depth + 1, max_batch_size=8, arrival_window_s=0.0)
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


Samples = dict[tuple[int, str], list[tuple[float, float]]]


def one_round(controllers: dict[int, AdmissionController], offers: int, r: int) -> list[dict[str, Any]]:
    """One round over every depth and place: p50 and p99 (us) of each cell."""
    out = []
    for d, c in controllers.items():
        for place in PLACES:
            us = offer_cost(c, place, offers, r) / 1000.0
            out.append({"depth": d, "place": place, "p50_us": float(np.percentile(us, 50)),
                        "p99_us": float(np.percentile(us, 99))})
    return out


def _baseline_round(src: Path, farm: str, args: argparse.Namespace, r: int) -> list[dict[str, Any]]:
    """Round ``r`` of this file in a child whose ``chunkline`` is the checkout ``src``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--depths", *map(str, args.depths), "--offers", str(args.offers),
           "--tenants", str(args.tenants), "--one-round", str(r)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (farm, os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"--baseline-src {src}: the baseline round failed:\n{done.stderr.strip()[-2000:]}")
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def run(args: argparse.Namespace, baseline_farm: str | None = None) -> list[dict[str, Any]]:
    """Alternating rounds (this tree, then the baseline's where given); medians over rounds."""
    controllers = {d: _controller(d, args.tenants, d) for d in args.depths}
    samples: dict[str, Samples] = {"new": {}, "base": {}}
    for r in range(args.rounds):
        rounds = [("new", one_round(controllers, args.offers, r))]
        if baseline_farm is not None:
            rounds.append(("base", _baseline_round(args.baseline_src, baseline_farm, args, r)))
        for who, cells in rounds:
            for cell in cells:
                samples[who].setdefault((cell["depth"], cell["place"]), []).append((cell["p50_us"], cell["p99_us"]))
    rows = []
    for d in args.depths:
        for place in PLACES:
            row: dict[str, Any] = {"depth": d, "place": place}
            for who, prefix in (("new", ""), ("base", "base_")):
                cell = samples[who].get((d, place))
                if cell:
                    row[f"{prefix}p50_us"] = float(np.median([c[0] for c in cell]))
                    row[f"{prefix}p99_us"] = float(np.median([c[1] for c in cell]))
            if "base_p50_us" in row:
                row["p50_ratio"] = row["p50_us"] / row["base_p50_us"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkline.bench.admission_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 64, 512, 4096], help="queue depths")
    parser.add_argument("--offers", type=int, default=2000, help="offers timed per depth, place and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--tenants", type=int, default=1, help="tenants the queued requests are spread over")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="another checkout of this repository, timed in alternating rounds in the same run")
    parser.add_argument("--one-round", type=int, default=None, help=argparse.SUPPRESS)  # a baseline child's round
    args = parser.parse_args(argv)
    if min(args.depths) < 1 or args.offers < 1 or args.rounds < 1 or args.tenants < 1:
        parser.error("--depths, --offers, --rounds and --tenants must be >= 1")
    if args.one_round is not None:
        controllers = {d: _controller(d, args.tenants, d) for d in args.depths}
        print(json.dumps(one_round(controllers, args.offers, args.one_round)))
        return 0
    columns = [Column("depth", "depth", "d"), Column("newcomer", "place", align="<"),
               Column("p50 us", "p50_us", ".1f"), Column("p99 us", "p99_us", ".1f")]
    with tempfile.TemporaryDirectory(prefix="chunkline-admission-") as tmp:
        farm = None
        if args.baseline_src is not None:
            from chunkline.bench.overhead import baseline_pythonpath

            farm = baseline_pythonpath(args.baseline_src, Path(tmp) / "farm")
            columns += [Column("base p50 us", "base_p50_us", ".1f"), Column("base p99 us", "base_p99_us", ".1f"),
                        Column("p50 new/base", "p50_ratio", ".2f")]
        rows = run(args, farm)
    print(format_table(rows, columns, title=(
        f"AdmissionController.offer: {args.rounds} alternating rounds of {args.offers} offers, {args.tenants} tenant(s), "
        "batches of 8: medians over rounds")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
