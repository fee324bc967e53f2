"""``chunkline bench policies``: real LeRobot architectures served by chunkline.

For ACT (ResNet-18 backbone) and Diffusion Policy (DDPM at 10 and 100 denoising steps), each at a
small and a real size (random weights: speed does not depend on what the weights are), it measures
the service curve (median and p99 of a batch's time, batch sizes interleaved round by round so a
drift of the machine hits all sizes alike) through chunkline's own :class:`LeRobotPolicy` (one
pre-processing call, one forward pass, one post-processing call per batch), then derives from the
curve how many robots one lane serves within the deadline: one at a time (``floor(period / t1)``
robots, if ``t1`` meets the deadline) against batching (``B * floor(period / t(B))`` for the best ``B``
whose batch time meets the deadline). Batching pays where ``t(B) / t(1)`` grows slower than ``B``.

Needs lerobot (run it from ``.venv-lerobot``: ``.venv-lerobot/bin/chunkline bench policies``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "MODELS", "robots_served"]

#: name -> (builder name, builder arguments, camera (C, H, W)).
MODELS: dict[str, tuple[str, dict[str, Any], tuple[int, int, int]]] = {
    "act-small": ("act", {"chunk_size": 10, "dim_model": 64, "layers": 1}, (3, 96, 128)),
    "act-real": ("act", {"chunk_size": 100, "dim_model": 512, "layers": 4, "dim_feedforward": 3200}, (3, 480, 640)),
    "diffusion10-small": ("diffusion", {"steps": 10, "down_dims": (32, 64)}, (3, 96, 96)),
    "diffusion100-small": ("diffusion", {"steps": 100, "down_dims": (32, 64)}, (3, 96, 96)),
    "diffusion10-real": ("diffusion", {"steps": 10, "down_dims": (512, 1024, 2048), "step_embed_dim": 128}, (3, 96, 96)),
    "diffusion100-real": ("diffusion", {"steps": 100, "down_dims": (512, 1024, 2048), "step_embed_dim": 128}, (3, 96, 96)),
}


def robots_served(curve: dict[int, float], deadline_s: float, period_s: float) -> tuple[int, int, int]:
    """From a service curve: robots served one at a time, robots served batching, and the batch size.

    Each robot asks once per ``period_s`` and wants its chunk within ``deadline_s``; one lane runs
    one batch after another, so batches of ``B`` taking ``t(B) <= deadline`` serve
    ``B * floor(period / t(B))`` robots (``B = 1``: one at a time)."""
    def served(b: int) -> int:
        return b * int(period_s / curve[b] + 1e-9) if curve[b] <= deadline_s else 0  # 1e-9: 0.5 // 0.01 is 49.0 in floats

    best = max(curve, key=lambda b: (served(b), -b))
    return served(1), served(best), best if served(best) else 0


def _curve(policy: Any, sizes: list[int], rounds: int, budget_s: float, seed: int = 0) -> dict[int, list[float]]:
    from chunkline.bench.lerobot_models import robot_observation
    from chunkline.policies import stack_observations, validate_observation

    batches = {b: stack_observations(policy.spec, [validate_observation(policy.spec, robot_observation(seed + i, (480, 640)))
                                                  for i in range(b)]) for b in sizes}
    for b in sizes:  # one untimed pass per size: first-call allocations are not service time
        policy.infer_batch_with_state(batches[b], [policy.new_session_state() for _ in range(b)])
    times: dict[int, list[float]] = {b: [] for b in sizes}
    start = time.perf_counter()
    for _ in range(rounds):  # A B A B: every size once per round
        for b in sizes:
            states = [policy.new_session_state() for _ in range(b)]
            t = time.perf_counter()
            policy.infer_batch_with_state(batches[b], states)
            times[b].append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chunkline bench policies", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--sizes", default="1,2,4,8,16", help="batch sizes of the service curve")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the curve (each runs every size once)")
    p.add_argument("--budget-s", type=float, default=60.0, help="stop a model's rounds after this (at least one round runs)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--deadline-ms", type=float, default=100.0, help="a chunk's deadline")
    p.add_argument("--period-ms", type=float, default=500.0, help="how often each robot asks for a chunk")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    try:
        from chunkline.bench import lerobot_models
        from chunkline.policies.lerobot_policy import LeRobotPolicy
    except ImportError as exc:
        print(f"bench policies needs lerobot (run it from .venv-lerobot): {exc}")
        return 2
    import torch

    sizes = sorted({int(s) for s in args.sizes.split(",")})
    builders: dict[str, Callable[..., Path]] = {"act": lerobot_models.build_act, "diffusion": lerobot_models.build_diffusion}
    print(f"# chunkline bench policies: {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"deadline {args.deadline_ms:g} ms, one request per robot every {args.period_ms:g} ms")
    print(f"{'model':<20} {'params':>8} " + " ".join(f"{'b' + str(b) + ' ms':>10}" for b in sizes)
          + f" {'t8/t1':>6} {'p99 b1':>8} {'1-at-a-time':>11} {'batching':>9}")
    results = []
    with tempfile.TemporaryDirectory(prefix="chunkline-policies-") as tmp:
        for name in args.models.split(","):
            kind, kw, shape = MODELS[name]
            folder = builders[kind](Path(tmp) / name, image_shape=shape, **kw)
            policy = LeRobotPolicy(str(folder), device=args.device, fps=30)
            params = sum(t.numel() for t in policy.lerobot_policy.parameters())
            raw = _curve(policy, sizes, args.rounds, args.budget_s)
            curve = {b: float(np.median(v)) for b, v in raw.items()}
            single, batching, best = robots_served(curve, args.deadline_ms / 1000, args.period_ms / 1000)
            ratio = curve[8] / curve[1] if 8 in curve else float("nan")
            print(f"{name:<20} {params / 1e6:>7.1f}M " + " ".join(f"{curve[b] * 1000:>10.1f}" for b in sizes)
                  + f" {ratio:>6.2f} {np.percentile(raw[1], 99) * 1000:>8.1f} {single:>11d} {batching:>9d}", flush=True)
            results.append({"model": name, "params": params, "median_s": curve, "samples": {b: len(v) for b, v in raw.items()},
                            "robots_one_at_a_time": single, "robots_batching": batching, "batch_size": best})
            policy.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
