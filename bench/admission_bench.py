"""``python -m chunkline.bench.admission_bench``: what one admission costs as the queue grows.

One model's :class:`~chunkline.server.core.admission.AdmissionController` (batches of 8, deadline
queueing, one tenant by default) is filled to each ``--depths`` with requests whose deadlines lie
far ahead and spread at random; then each round times ``--offers`` calls of ``offer`` (each admitted
and cancelled again, so the depth holds) for a newcomer whose deadline is the latest queued
(**in order**: it overtakes nothing, the usual case), anywhere among them (**random**: it
overtakes half), or the earliest (**first**: it overtakes them all, as a robot with a short budget
does under a retry storm). Rounds alternate the depths and places, so a drift of a shared machine
hits every cell alike; the table gives the median over rounds of each round's p50 and p99.

It uses only the controller's public calls, so it times another checkout's controller too: put a
folder that maps ``chunkline`` to that checkout first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import random
import time
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


def run(depths: list[int], offers: int, rounds: int, tenants: int) -> list[dict[str, Any]]:
    controllers = {d: _controller(d, tenants, d) for d in depths}
    p50: dict[tuple[int, str], list[float]] = {}
    p99: dict[tuple[int, str], list[float]] = {}
    for r in range(rounds):
        for d in depths:
            for place in PLACES:
                us = offer_cost(controllers[d], place, offers, r) / 1000.0
                p50.setdefault((d, place), []).append(float(np.percentile(us, 50)))
                p99.setdefault((d, place), []).append(float(np.percentile(us, 99)))
    return [{"depth": d, "place": place, "p50_us": float(np.median(p50[(d, place)])), "p99_us": float(np.median(p99[(d, place)]))}
            for d in depths for place in PLACES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkline.bench.admission_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 64, 512, 4096], help="queue depths")
    parser.add_argument("--offers", type=int, default=2000, help="offers timed per depth, place and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--tenants", type=int, default=1, help="tenants the queued requests are spread over")
    args = parser.parse_args(argv)
    if min(args.depths) < 1 or args.offers < 1 or args.rounds < 1 or args.tenants < 1:
        parser.error("--depths, --offers, --rounds and --tenants must be >= 1")
    rows = run(args.depths, args.offers, args.rounds, args.tenants)
    print(format_table(rows, [
        Column("depth", "depth", "d"),
        Column("newcomer", "place", align="<"),
        Column("p50 us", "p50_us", ".1f"),
        Column("p99 us", "p99_us", ".1f"),
    ], title=f"AdmissionController.offer: {args.rounds} alternating rounds of {args.offers} offers, {args.tenants} tenant(s), "
             "batches of 8: medians over rounds"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
