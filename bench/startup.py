"""``chunkline bench startup``: time to ready with every batch size timed first vs batch 1 first.

Each run starts the robot request class in-process on a fresh serving core, as ``chunkline serve``
does, with **all sizes first** (every size timed before ready) or **batch 1 first** (the default:
the other sizes timed in the background once ready). It reports seconds to ready and, for batch 1
first, until every size was timed; the settings alternate run by run, medians over ``--rounds``
after one untimed start. ``--model`` names a LeRobot architecture of ``chunkline bench policies``
(run from ``.venv-lerobot``); ``--policy REF`` times any reference."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main", "one_start"]


async def _start(config: Any, budget_s: float) -> tuple[float, float | None]:
    from chunkline.server.core.serving import ServingCore
    from chunkline.server.core.tenants import TenantRegistry
    from chunkline.server.robot.service import RobotActions

    core = ServingCore(TenantRegistry.anonymous(), authenticate=False)
    actions = RobotActions(core, [config])
    began = time.perf_counter()
    await actions.start()
    ready = time.perf_counter() - began
    runner = actions.default
    all_timed: float | None = ready if not config.background_timing else None
    try:
        while config.background_timing and time.perf_counter() - began < budget_s:
            if runner.sizes_timed_at is not None:
                all_timed = runner.sizes_timed_at - began
                break
            await asyncio.sleep(0.05)
    finally:
        await actions.stop()
    return ready, all_timed


def one_start(ref: str, args: dict[str, Any], max_batch_size: int, all_first: bool, budget_s: float = 600.0,
              device: str = "cpu") -> tuple[float, float | None]:
    """One start-up: seconds to ready and seconds until every size was timed (``None``: not
    within ``budget_s``)."""
    from chunkline.server.robot.config import PolicyConfig
    from chunkline.server.robot.sizing import size_ladder

    config = PolicyConfig(ref=ref, args=args, device=device, max_batch_size=max_batch_size,
                          warm_batch_sizes=size_ladder(max_batch_size) if all_first else (1,), background_timing=not all_first)
    return asyncio.run(_start(config, budget_s))


def _reference(args: argparse.Namespace, tmp: Path) -> tuple[str, dict[str, Any]]:
    from chunkline.server.robot.config import parse_policy_arg

    extra = dict(parse_policy_arg(a) for a in args.policy_arg)
    if args.policy:
        return args.policy, extra
    from chunkline.bench import lerobot_models
    from chunkline.bench.policies_bench import MODELS

    kind, kw, shape = MODELS[args.model]
    builders: dict[str, Callable[..., Path]] = {"act": lerobot_models.build_act, "diffusion": lerobot_models.build_diffusion}
    builder = builders[kind]
    folder = builder(tmp / args.model, image_shape=shape, **kw)
    return f"lerobot:{folder}", {"fps": 30, **extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chunkline bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="act-real", help="a LeRobot model of `chunkline bench policies` (needs lerobot)")
    p.add_argument("--policy", default=None, metavar="REF", help="time this reference instead of --model")
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE", help="argument of the policy")
    p.add_argument("--max-batch-size", type=int, default=8, help="the sizes timed: powers of two up to it")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each starts both settings once)")
    p.add_argument("--budget-s", type=float, default=600.0, help="stop waiting for the background timing after this")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if not args.policy:
        try:
            import lerobot  # noqa: F401
        except ImportError as exc:
            print(f"bench startup --model needs lerobot (run it from .venv-lerobot), or give --policy REF: {exc}")
            return 2
    runs: dict[str, list[tuple[float, float | None]]] = {"all sizes first": [], "batch 1 first": []}
    with tempfile.TemporaryDirectory(prefix="chunkline-startup-") as tmp:
        ref, policy_args = _reference(args, Path(tmp))
        name = args.policy or args.model
        print(f"# chunkline bench startup: {name} on {args.device}, batch sizes up to {args.max_batch_size}, "
              f"{args.rounds} rounds (A B A B)", flush=True)
        # One untimed start first: imports, the allocator and the page cache warm, for neither setting's benefit.
        one_start(ref, policy_args, 1, True, args.budget_s, args.device)
        for r in range(args.rounds):
            for setting in runs:
                ready, timed = one_start(ref, policy_args, args.max_batch_size, setting == "all sizes first", args.budget_s, args.device)
                runs[setting].append((ready, timed))
                shown = "-" if timed is None else f"{timed:.2f}"
                print(f"round {r + 1}: {setting:<16} ready {ready:7.2f} s, every size timed {shown} s", flush=True)
    medians: dict[str, dict[str, float | None]] = {}
    for setting, values in runs.items():
        finished = [t for _, t in values if t is not None]
        medians[setting] = {"ready_s": statistics.median(r for r, _ in values),
                            "all_timed_s": statistics.median(finished) if len(finished) == len(values) else None}
    a, b = medians["all sizes first"], medians["batch 1 first"]
    assert a["ready_s"] is not None and b["ready_s"] is not None
    print(f"{'setting':<16} {'ready s':>8} {'all sizes timed s':>18}")
    for setting, m in medians.items():
        shown = "-" if m["all_timed_s"] is None else f"{m['all_timed_s']:.2f}"
        print(f"{setting:<16} {m['ready_s']:>8.2f} {shown:>18}")
    print(f"time to ready, batch 1 first / all sizes first: {b['ready_s'] / a['ready_s']:.2f}x (medians)")
    if args.json:
        args.json.write_text(json.dumps({"policy": name, "max_batch_size": args.max_batch_size, "runs": runs, "medians": medians},
                                        indent=2))
    return 0
