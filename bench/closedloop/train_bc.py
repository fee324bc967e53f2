"""Train ``reach-bc``, the behaviour-cloning policy for the reach task, on the scripted expert.

Demonstrations: episodes of the reach task (MuJoCo) driven by the expert with perturbations
that show the learner the states it will meet when served remotely (DART-style): chunks
executed late by a random lag (as a slow link would), commands held for a few ticks (as a
blocked loop would), and noise on the commands. At every third tick the state and the
expert's chunk for it are recorded. The learner is the MLP of
:mod:`chunkline.policies.embedded.bc`, trained with Adam on the mean squared error of the
chunk's joint offsets, in torch; the weights are saved as ``.npz`` (float32), loadable on
torch, JAX and numpy alike.

Run: ``python -m chunkline.bench.closedloop.train_bc [--episodes 120] [--epochs 60]
[--out policies/embedded/reach_bc.npz]`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from chunkline.policies.embedded.bc import BC_FEATURES, BCWeights, bc_features, default_bc_path, save_bc
from chunkline.policies.embedded.tasks import TASK_HORIZON, ReachPlanner

from .tasks import make_task

__all__ = ["collect_demos", "train", "main"]


def collect_demos(episodes: int, seed: int = 0, every: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """States ``[N, 8]`` and the expert's chunks ``[N, H, 2]`` from perturbed expert episodes.

    Args:
        episodes: episodes to run.
        seed: the first episode's seed (seeds count up; the benchmark uses seeds from 0, the
            demonstrations from 10000 on, so training never sees an evaluation episode).
        every: record every ``every``-th tick.
    """
    task = make_task("reach")
    planner = ReachPlanner()
    rng = np.random.default_rng(seed)
    states: list[np.ndarray] = []
    chunks: list[np.ndarray] = []
    for ep in range(episodes):
        task.reset(10_000 + seed + ep)
        chunk = None
        k = 0
        lag = 0
        hold = 0
        noise = float(rng.choice([0.0, 0.02, 0.05]))
        tick = 0
        while not task.done:  # bounded: one pass per control tick of the episode
            state = task.state()
            if tick % every == 0:
                states.append(state)
                chunks.append(planner.plan(state))
            if chunk is None or k >= 10 + lag:
                chunk = planner.plan(state) if tick % every else chunks[-1]
                lag = int(rng.integers(0, 16)) if rng.random() < 0.4 else 0
                k = 0
                hold = int(rng.integers(1, 8)) if rng.random() < 0.15 else 0
            if hold > 0:
                hold -= 1
                task.step(None)
            else:
                cmd = chunk[min(k, chunk.shape[0] - 1)] + noise * rng.standard_normal(2)
                k += 1
                task.step(cmd)
            tick += 1
    task.close()
    return np.stack(states).astype(np.float32), np.stack(chunks).astype(np.float32)


def train(states: np.ndarray, chunks: np.ndarray, *, epochs: int = 60, hidden: int = 256, seed: int = 0,
          log: bool = True) -> BCWeights:
    """Fit the MLP to the expert's chunks (torch, CPU).

    Args:
        states: ``[N, 8]``.
        chunks: ``[N, H, 2]``.
        epochs: passes over the data.
        hidden: width of the two hidden layers.
        seed: initialisation and shuffling seed.
        log: print progress to stderr.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    n, horizon, adim = chunks.shape
    deltas = chunks - states[:, None, :adim]
    scale = float(np.abs(deltas).std() * 2.0)
    x = torch.from_numpy(np.asarray(bc_features(np, states), dtype=np.float32))
    y = torch.from_numpy((deltas / scale).reshape(n, -1))
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(n))
    n_val = max(1, n // 10)
    val, tr = perm[:n_val], perm[n_val:]
    model = nn.Sequential(nn.Linear(BC_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                          nn.Linear(hidden, horizon * adim))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    batch = 256
    for epoch in range(epochs):
        order = tr[torch.randperm(tr.numel())]
        model.train()
        for i in range(0, order.numel(), batch):
            idx = order[i : i + batch]
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        if log and (epoch % 10 == 0 or epoch == epochs - 1):
            with torch.no_grad():
                err = (model(x[val]) - y[val]).abs().mean().item() * scale
            print(f"epoch {epoch:3d}  validation mean |error| {err * 1000:.2f} mrad", file=sys.stderr)
    with torch.no_grad():
        val_err = float((model(x[val]) - y[val]).abs().mean().item() * scale)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    arrays = {}
    for i, layer in enumerate(linears):
        arrays[f"w{i}"] = layer.weight.detach().numpy().T.astype(np.float32).copy()
        arrays[f"b{i}"] = layer.bias.detach().numpy().astype(np.float32).copy()
    info = {"samples": int(n), "epochs": epochs, "hidden": hidden, "validation_mean_abs_error_rad": val_err}
    return BCWeights(arrays, horizon, adim, scale, info)


def main(argv: list[str] | None = None) -> int:
    """Collect, train, save; prints a summary."""
    p = argparse.ArgumentParser(prog="python -m chunkline.bench.closedloop.train_bc", description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=120)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(default_bc_path()))
    args = p.parse_args(argv)
    t = time.perf_counter()
    states, chunks = collect_demos(args.episodes, args.seed)
    print(f"collected {len(states)} samples from {args.episodes} episodes in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    weights = train(states, chunks, epochs=args.epochs, hidden=args.hidden, seed=args.seed)
    weights = BCWeights(weights.arrays, weights.horizon, weights.action_dim, weights.scale,
                        {**weights.info, "episodes": args.episodes, "horizon": TASK_HORIZON})
    save_bc(weights, args.out)
    size = args.out.stat().st_size
    print(f"trained in {time.perf_counter() - t:.1f} s: {weights.num_params} parameters, {size / 1024:.0f} kB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
