"""Train ``reach-flow``, the flow-matching policy for the reach task, on the scripted expert.

Demonstrations: :func:`~.train_common.collect_demos` and the requests chunkline's broker sends
under delay (:func:`~.train_common.collect_served`); the targets are the expert's chunks
continuing the frozen rows (plain where none are frozen), the inputs
:func:`~chunkline.policies.embedded.flow.flow_features` (training-time real-time chunking). Each
chunk becomes its coefficients in the chunk basis (joint offsets from the observed position,
least squares, over ``scale``: unit spread). Fitted by x1 prediction: for coefficients ``x1``,
noise ``x0`` and ``tau`` on the sampler's grid (``k / steps``), it learns ``x1`` from
``(1 - tau) x0 + tau x1`` with the policy's own forward pass; Adam, cosine schedule, torch, CPU;
saved as ``.npz`` (float32), read by the torch and JAX policies alike.

Run: ``python -m chunkline.bench.closedloop.train_flow [--episodes 240] [--served-episodes 960]
[--epochs 200] [--eval]`` (driver :mod:`.train_common`; the shipped weights: 4.5 minutes of
demonstrations, 8 of training on 2 cores shared with benchmarks, one torch thread).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from chunkline.policies.embedded.flow import (
    FLOW_LAYERS,
    FlowWeights,
    chunk_basis,
    default_flow_path,
    flow_features,
    flow_input_width,
    flow_net,
    save_flow,
    tau_embedding,
)
from chunkline.policies.embedded.flow_build import build_reach_flow
from chunkline.policies.embedded.tasks import REACH_ACCEL_FIELD, TASK_DT, TASK_HORIZON

from . import train_common

__all__ = ["train", "main", "TRAINER", "DEFAULT_BASIS"]

#: smooth shapes per chunk: the expert's 1 s chunks fit to ~0.04 mrad on average (printed by train).
DEFAULT_BASIS = 16


def train(demos: train_common.Demos, *, epochs: int = 200, hidden: int = 256, basis: int = DEFAULT_BASIS,
          steps: int = 10, seed: int = 0, log: bool = True) -> FlowWeights:
    """Fit the network (torch, CPU).

    Args:
        demos: the demonstrations (their ``rtc_chunks`` are the targets).
        epochs: passes over the data.
        hidden: width of the hidden layers.
        basis: smooth shapes per chunk.
        steps: Euler steps the sampler will use (stored with the weights; ``tau`` is drawn on its grid).
        seed: initialisation, noise and shuffling seed.
        log: print progress to stderr.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    states, chunks = demos.states, demos.rtc_chunks
    n, horizon, adim = chunks.shape
    b_mat = chunk_basis(horizon, basis)
    deltas = chunks - states[:, None, :adim]
    coeffs = np.einsum("hk,nha->nka", b_mat, deltas)
    fit_err = np.abs(np.einsum("hk,nka->nha", b_mat, coeffs) - deltas)
    scale = float(coeffs.std())
    if log:
        print(f"basis of {basis}: the chunks' fit error mean {1000 * fit_err.mean():.3f} mrad, max {1000 * fit_err.max():.2f} mrad",
              file=sys.stderr)
    feats = torch.from_numpy(flow_features(states, demos.accel, demos.prefix, demos.delay, demos.prefix_mask))
    x1 = torch.from_numpy((coeffs / scale).reshape(n, -1).astype(np.float32))
    sizes = [flow_input_width(basis, adim)] + [hidden] * (FLOW_LAYERS - 1) + [basis * adim]
    linears = [nn.Linear(sizes[i], sizes[i + 1]) for i in range(FLOW_LAYERS)]
    grid = torch.from_numpy(tau_embedding(np.arange(steps) / steps))  # [steps, E]

    def forward(x: torch.Tensor, k: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        params = {f"{p}{i}": t for i, lin in enumerate(linears) for p, t in (("w", lin.weight.T), ("b", lin.bias))}
        return flow_net(params, x, grid[k], c, nn.functional.silu)

    def noisy(target: torch.Tensor, k: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        tau = (k.to(torch.float32) / steps)[:, None]
        return (1.0 - tau) * torch.randn(target.shape, generator=gen) + tau * target

    perm = torch.from_numpy(np.random.default_rng(seed).permutation(n))
    n_val = max(1, n // 10)
    val, tr = perm[:n_val], perm[n_val:]
    opt = torch.optim.Adam([p for lin in linears for p in lin.parameters()], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    batch = 256
    loss_val = float("nan")
    for epoch in range(epochs):
        order = tr[torch.randperm(tr.numel())]
        for i in range(0, order.numel(), batch):
            idx = order[i : i + batch]
            k = torch.randint(0, steps, (idx.numel(),))
            loss = nn.functional.mse_loss(forward(noisy(x1[idx], k), k, feats[idx]), x1[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        if log and (epoch % 10 == 0 or epoch == epochs - 1):
            with torch.no_grad():
                g = torch.Generator().manual_seed(1)
                k = torch.randint(0, steps, (n_val,), generator=g)
                loss_val = nn.functional.mse_loss(forward(noisy(x1[val], k, g), k, feats[val]), x1[val]).item()
            print(f"epoch {epoch:3d}  validation x1 loss {loss_val:.5f}", file=sys.stderr)
    arrays = {}
    for i, layer in enumerate(linears):
        arrays[f"w{i}"] = layer.weight.detach().numpy().T.astype(np.float32).copy()
        arrays[f"b{i}"] = layer.bias.detach().numpy().astype(np.float32).copy()
    info = {"samples": int(n), "epochs": epochs, "hidden": hidden, "validation_x1_loss": loss_val,
            "basis_fit_mean_mrad": float(1000 * fit_err.mean())}
    return FlowWeights(arrays, horizon, adim, basis, scale, steps, info=info)


def compare_backends(path: Path, *, states: int = 64, rounds: int = 5, calls: int = 20) -> str:
    """Torch against JAX on the weights at ``path``: the largest difference between their chunks
    (plain, and with mixed prefixes: random lengths and frozen counts, none on some rows) over
    demonstration-like states, and the time per request at batch 1 with a prefix, measured
    alternately (torch, JAX, torch, ...; ``rounds`` x ``calls`` each), median and p99.
    """
    import torch

    from chunkline.policies.embedded.flow import FlowPolicy, load_flow
    from chunkline.policies.embedded.flow_jax import FlowJaxPolicy
    from chunkline.policies.prefix import ActionPrefix, stack_prefixes

    weights = load_flow(path)
    torch_policy, jax_policy = FlowPolicy(weights), FlowJaxPolicy(weights, batch_sizes=(1, states))
    demos = train_common.collect_demos(1, seed=7)
    pick = np.linspace(0, len(demos.states) - 1, states).astype(int)
    obs = {"state": demos.states[pick], REACH_ACCEL_FIELD: demos.accel[pick]}
    plain_t, plain_j = torch_policy.infer_batch(obs), jax_policy.infer_batch(obs)
    rng = np.random.default_rng(0)
    items: list[ActionPrefix | None] = []
    for i in range(states):
        rows = int(rng.integers(0, 40))
        items.append(None if rows == 0 else ActionPrefix.from_wire(
            plain_t[i, :rows] + rng.normal(0, 0.05, 2), t0=0.0, dt=TASK_DT, action_dim=2,
            horizon=weights.horizon, delay_steps=int(rng.integers(0, rows + 1))))
    prefix = stack_prefixes(items, horizon=weights.horizon, action_dim=2)
    guided_t, _ = torch_policy.infer_batch_with_prefix(obs, prefix, None)
    guided_j, _ = jax_policy.infer_batch_with_prefix(obs, prefix, None)
    one = {k: v[:1] for k, v in obs.items()}
    one_prefix = stack_prefixes([items[1] or items[2]], horizon=weights.horizon, action_dim=2)
    times: dict[str, list[float]] = {"torch": [], "jax": []}
    pols = {"torch": torch_policy, "jax": jax_policy}
    for pol in pols.values():
        pol.infer_batch_with_prefix(one, one_prefix, None)  # compile / allocate first
    for _ in range(rounds):  # bounded: rounds x calls per backend
        for name, pol in pols.items():
            for _ in range(calls):
                t = time.perf_counter()
                pol.infer_batch_with_prefix(one, one_prefix, None)
                times[name].append(time.perf_counter() - t)
    med = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    p99 = {k: 1000 * float(np.percentile(v, 99)) for k, v in times.items()}
    return (f"torch vs JAX over {states} states: max |diff| {np.abs(plain_t - plain_j).max():.1e} plain, "
            f"{np.abs(guided_t - guided_j).max():.1e} with mixed prefixes ({sum(p is not None for p in items)} rows with one)\n"
            f"per request (batch 1, with a prefix; torch on {torch.get_num_threads()} thread(s)), alternating, "
            f"{rounds} x {calls} each: torch median {med['torch']:.2f} ms p99 {p99['torch']:.2f} ms, "
            f"JAX median {med['jax']:.2f} ms p99 {p99['jax']:.2f} ms (torch / JAX {med['torch'] / med['jax']:.1f}x)")


def _fit(demos: train_common.Demos, args: argparse.Namespace) -> FlowWeights:
    w = train(demos, epochs=args.epochs, hidden=args.hidden, seed=args.seed)
    return dataclasses.replace(w, info={**w.info, "episodes": args.episodes, "jump_share": args.jump_share,
                                        "served_episodes": args.served_episodes, "horizon": TASK_HORIZON})


TRAINER = train_common.Trainer(
    prog="python -m chunkline.bench.closedloop.train_flow", description=(__doc__ or "").split("\n\n")[0],
    default_out=default_flow_path(), epochs=200, hidden=256, fit=_fit, save=save_flow,
    # JAX when evaluating: the same answers as torch within 1e-4, and several times faster per
    # request on a loaded CPU (one compiled function, no autograd bookkeeping).
    load=lambda path: build_reach_flow(backend="jax", path=str(path), name="reach-flow-jax"),
    summary=lambda w: f"{w.num_params} parameters, validation x1 loss {w.info['validation_x1_loss']:.5f}",
    check=compare_backends,
    # Half the episodes on reach-jump: without them the clone never saw the arm far from a
    # target that moved, and failed every jump at 0 ms.
    episodes=240, jump_share=0.5,
    # The requests the broker sends under delay (a prefix planned before the target jumped, a
    # stale observation): the perturbed episodes alone left the clone 20-35 mm off the expert
    # on the chunks asked in the second after a jump.
    served_episodes=960,
)


def main(argv: list[str] | None = None) -> int:
    """Collect, train, save, evaluate when asked (:func:`.train_common.main`)."""
    return train_common.main(TRAINER, argv)


if __name__ == "__main__":
    sys.exit(main())
