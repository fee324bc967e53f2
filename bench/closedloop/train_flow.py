"""Train ``reach-flow``, the flow-matching policy for the reach task, on the scripted expert.

The demonstrations are :func:`~.train_bc.collect_demos`'s (perturbed expert episodes, DART-style).
The velocity field of :mod:`chunkline.policies.embedded.flow` is fitted by flow matching: for a
demonstrated chunk ``x1`` (joint offsets from the observed position, over ``scale``), Gaussian
noise ``x0`` and ``tau ~ U(0, 1)``, it learns ``x1 - x0`` at ``x_tau = (1 - tau) x0 + tau x1``.
Adam, torch, CPU; the weights are saved as ``.npz`` (float32).

Run: ``python -m chunkline.bench.closedloop.train_flow [--episodes 120] [--epochs 80]
[--out policies/embedded/reach_flow.npz]`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from chunkline.policies.embedded.bc import bc_features
from chunkline.policies.embedded.flow import FLOW_LAYERS, FlowPolicy, FlowWeights, default_flow_path, flow_input_width, save_flow
from chunkline.policies.embedded.tasks import TASK_HORIZON

from .train_bc import collect_demos

__all__ = ["train", "main"]


def train(states: np.ndarray, chunks: np.ndarray, *, epochs: int = 80, hidden: int = 512, steps: int = 10, seed: int = 0,
          log: bool = True) -> FlowWeights:
    """Fit the velocity field (torch, CPU).

    Args:
        states: ``[N, 8]``.
        chunks: ``[N, H, 2]``.
        epochs: passes over the data.
        hidden: width of the hidden layers.
        steps: Euler steps the sampler will use (stored with the weights).
        seed: initialisation, noise and shuffling seed.
        log: print progress to stderr.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    n, horizon, adim = chunks.shape
    deltas = chunks - states[:, None, :adim]
    scale = float(np.abs(deltas).std() * 2.0)
    feats = torch.from_numpy(np.asarray(bc_features(np, states), dtype=np.float32))
    x1 = torch.from_numpy((deltas / scale).reshape(n, -1).astype(np.float32))
    width = flow_input_width(horizon, adim)
    layers: list[nn.Module] = []
    sizes = [width] + [hidden] * (FLOW_LAYERS - 1) + [horizon * adim]
    for i in range(FLOW_LAYERS):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < FLOW_LAYERS - 1:
            layers.append(nn.SiLU())
    model = nn.Sequential(*layers)
    # The policy's own forward pass (the same embedding), with the model's parameters.
    linears = [m for m in model if isinstance(m, nn.Linear)]
    probe = FlowPolicy(_export(linears, horizon, adim, scale, steps, {}), device="cpu")

    def forward(x: torch.Tensor, tau: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        probe._params = [(lin.weight.T, lin.bias) for lin in linears]
        return probe.velocity(x, tau, c)

    perm = torch.from_numpy(np.random.default_rng(seed).permutation(n))
    n_val = max(1, n // 10)
    val, tr = perm[:n_val], perm[n_val:]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    batch = 256
    loss_val = float("nan")
    for epoch in range(epochs):
        order = tr[torch.randperm(tr.numel())]
        for i in range(0, order.numel(), batch):
            idx = order[i : i + batch]
            target = x1[idx]
            noise = torch.randn_like(target)
            tau = torch.rand(idx.numel(), 1)
            xt = (1.0 - tau) * noise + tau * target
            loss = nn.functional.mse_loss(forward(xt, tau, feats[idx]), target - noise)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        if log and (epoch % 10 == 0 or epoch == epochs - 1):
            with torch.no_grad():
                g = torch.Generator().manual_seed(1)
                t = x1[val]
                z = torch.randn(t.shape, generator=g)
                tau = torch.rand(t.shape[0], 1, generator=g)
                loss_val = nn.functional.mse_loss(forward((1 - tau) * z + tau * t, tau, feats[val]), t - z).item()
            print(f"epoch {epoch:3d}  validation flow-matching loss {loss_val:.4f}", file=sys.stderr)
    info = {"samples": int(n), "epochs": epochs, "hidden": hidden, "validation_loss": loss_val}
    return _export(linears, horizon, adim, scale, steps, info)


def _export(linears: list, horizon: int, adim: int, scale: float, steps: int, info: dict) -> FlowWeights:
    arrays = {}
    for i, layer in enumerate(linears):
        arrays[f"w{i}"] = layer.weight.detach().numpy().T.astype(np.float32).copy()
        arrays[f"b{i}"] = layer.bias.detach().numpy().astype(np.float32).copy()
    return FlowWeights(arrays, horizon, adim, scale, steps, info)


def main(argv: list[str] | None = None) -> int:
    """Collect, train, save; prints a summary."""
    p = argparse.ArgumentParser(prog="python -m chunkline.bench.closedloop.train_flow", description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=120)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(default_flow_path()))
    args = p.parse_args(argv)
    t = time.perf_counter()
    states, chunks = collect_demos(args.episodes, args.seed)
    print(f"collected {len(states)} samples from {args.episodes} episodes in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    t = time.perf_counter()
    weights = train(states, chunks, epochs=args.epochs, hidden=args.hidden, seed=args.seed)
    weights = FlowWeights(weights.arrays, weights.horizon, weights.action_dim, weights.scale, weights.steps,
                          {**weights.info, "episodes": args.episodes, "horizon": TASK_HORIZON})
    save_flow(weights, args.out)
    size = args.out.stat().st_size
    print(f"trained in {time.perf_counter() - t:.1f} s: {weights.num_params} parameters, {size / 1024:.0f} kB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
