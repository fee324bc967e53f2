"""Train ``reach-bc``, the behaviour-cloning policy for the reach task, on the scripted expert.

Demonstrations: :func:`~.train_common.collect_demos` (perturbed expert episodes, DART-style).
The learner is the MLP of
:mod:`chunkline.policies.embedded.bc`, trained with Adam on the mean squared error of the
chunk's joint offsets, in torch; the weights are saved as ``.npz`` (float32), loadable on
torch, JAX and numpy alike.

Run: ``python -m chunkline.bench.closedloop.train_bc [--episodes 120] [--epochs 60]
[--out policies/embedded/reach_bc.npz] [--eval | --eval-only] [--eval-seeds 5]`` (about a minute
on 2 CPU cores, plus the evaluation; the driver is :mod:`.train_common`).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from chunkline.policies.embedded.bc import BC_FEATURES, BCWeights, bc_features, build_reach_bc, default_bc_path, save_bc
from chunkline.policies.embedded.tasks import TASK_HORIZON

from . import train_common
from .train_common import collect_demos

__all__ = ["collect_demos", "train", "main", "TRAINER"]


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


def _fit(demos: train_common.Demos, args: argparse.Namespace) -> BCWeights:
    w = train(demos.states, demos.chunks, epochs=args.epochs, hidden=args.hidden, seed=args.seed)
    return BCWeights(w.arrays, w.horizon, w.action_dim, w.scale, {**w.info, "episodes": args.episodes, "horizon": TASK_HORIZON})


TRAINER = train_common.Trainer(
    prog="python -m chunkline.bench.closedloop.train_bc", description=(__doc__ or "").split("\n\n")[0],
    default_out=default_bc_path(), epochs=60, hidden=256, fit=_fit, save=save_bc,
    load=lambda path: build_reach_bc(backend="numpy", path=str(path)),
    summary=lambda w: f"{w.num_params} parameters, validation mean |error| {1000 * w.info['validation_mean_abs_error_rad']:.2f} mrad",
)


def main(argv: list[str] | None = None) -> int:
    """Collect, train, save, evaluate when asked (:func:`.train_common.main`)."""
    return train_common.main(TRAINER, argv)


if __name__ == "__main__":
    sys.exit(main())
