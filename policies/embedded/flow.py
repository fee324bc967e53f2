"""``reach-flow``: a flow-matching action policy for the reach task, with training-free
real-time-chunking guidance.

The network is a velocity field ``v(x, tau, c)`` over whole chunks: ``x`` the chunk as joint
offsets from the observed position divided by ``scale`` (``[H * A]``), ``tau`` in ``[0, 1]``
(0: noise, 1: data), ``c`` the reach features of :func:`~chunkline.policies.embedded.bc.bc_features`.
It is trained by flow matching (``x_tau = (1 - tau) x0 + tau x1``, target ``x1 - x0``) on the
scripted expert's demonstrations (``bench/closedloop/train_flow.py``). A chunk is drawn by
integrating from Gaussian noise with ``steps`` Euler steps; the noise comes from a fixed seed, so
a request's answer depends on its observation (and prefix) only, batched or alone.

Real-time chunking (after Black, Galliker and Levine, "Real-Time Execution of Action Chunking
Flow Policies", 2025; this implementation is ours): with a prefix, every denoising step is
steered so that the chunk the step points at (``x1_hat = x + (1 - tau) v``) matches the prefix
where it is given: weight 1 on the frozen rows (those that run before the answer arrives), a
weight decaying with distance over the rest of the previous plan (soft-masked overlap), 0 where
no prefix is given. The correction is the vector-Jacobian product of ``x1_hat`` with the
weighted error (by autograd), scaled by a guidance weight capped at ``max_guidance``. After each
step the sample is also pulled, by the same weights, towards the straight path from its noise to
the prefix: for a policy whose chunk hardly depends on its noise (a clone of a deterministic
expert, as here) the Jacobian is small and guidance alone moves little; with the pull the frozen
rows end on the prefix and the overlap blends into the new plan. Without a prefix the sampler
is plain flow matching.

The weights file is a plain ``.npz`` (``w0..w3, b0..b3``, linear weights ``[in, out]``) with a
uint8 JSON header under ``__chunkline_flow__`` (format, version, horizon, action dimension,
scale, steps, training summary); read with ``allow_pickle=False``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..base import Policy, make_fingerprint, weights_digest
from ..exceptions import PolicyLoadError, WeightsFormatError
from ..prefix import PrefixBatch
from .bc import BC_FEATURES, bc_features
from .tasks import reach_spec

__all__ = ["FLOW_HEADER_KEY", "FlowWeights", "FlowPolicy", "default_flow_path", "save_flow", "load_flow",
           "build_reach_flow", "soft_mask", "FLOW_LAYERS", "flow_input_width"]

FLOW_HEADER_KEY = "__chunkline_flow__"
FLOW_FORMAT = "chunkline.flow"
FLOW_VERSION = 1
FLOW_LAYERS = 4
#: the time embedding: tau and sin/cos of tau at these frequencies (rad per unit tau).
_TAU_FREQS = (1.0, 2.0, 4.0, 8.0)


def flow_input_width(horizon: int, action_dim: int) -> int:
    """The network's input width: the chunk, the time embedding and the features."""
    return horizon * action_dim + 1 + 2 * len(_TAU_FREQS) + BC_FEATURES


@dataclasses.dataclass(frozen=True)
class FlowWeights:
    """The flow policy's parameters and settings.

    Args:
        arrays: ``w0..w3, b0..b3`` float32.
        horizon: ``H``.
        action_dim: ``A``.
        scale: radians per unit of the chunk the network models.
        steps: Euler steps per sample.
        info: the training summary.
    """

    arrays: Mapping[str, np.ndarray]
    horizon: int
    action_dim: int
    scale: float
    steps: int = 10
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        want = {f"{k}{i}" for i in range(FLOW_LAYERS) for k in "wb"}
        if set(self.arrays) != want:
            raise WeightsFormatError(f"flow weights must be exactly {sorted(want)}, got {sorted(self.arrays)}")
        width = flow_input_width(self.horizon, self.action_dim)
        if self.arrays["w0"].shape[0] != width:
            raise WeightsFormatError(f"w0 must take {width} inputs, has {self.arrays['w0'].shape[0]}")
        if self.arrays[f"w{FLOW_LAYERS - 1}"].shape[1] != self.horizon * self.action_dim:
            raise WeightsFormatError("the last layer's width must be horizon * action_dim")
        for i in range(FLOW_LAYERS):
            w, b = self.arrays[f"w{i}"], self.arrays[f"b{i}"]
            if w.ndim != 2 or b.shape != (w.shape[1],) or not (np.isfinite(w).all() and np.isfinite(b).all()):
                raise WeightsFormatError(f"layer {i}: bad shapes or non-finite values")
            if i and w.shape[0] != self.arrays[f"w{i - 1}"].shape[1]:
                raise WeightsFormatError(f"layer {i} does not fit layer {i - 1}")
        if not (self.steps >= 1 and math.isfinite(self.scale) and self.scale > 0):
            raise WeightsFormatError("steps must be >= 1 and scale > 0")

    @property
    def num_params(self) -> int:
        return int(sum(a.size for a in self.arrays.values()))


def default_flow_path() -> str:
    """Where the shipped weights are (``policies/embedded/reach_flow.npz``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "reach_flow.npz")


def save_flow(weights: FlowWeights, path: str | os.PathLike[str]) -> None:
    """Write ``weights`` as ``.npz`` (arrays float32, the header as uint8 JSON)."""
    header = {"format": FLOW_FORMAT, "version": FLOW_VERSION, "horizon": weights.horizon, "action_dim": weights.action_dim,
              "scale": weights.scale, "steps": weights.steps, "info": dict(weights.info)}
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in weights.arrays.items()}
    arrays[FLOW_HEADER_KEY] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def load_flow(path: str | os.PathLike[str] | None = None) -> FlowWeights:
    """Read weights written by :func:`save_flow`.

    Raises:
        PolicyLoadError: no file there. WeightsFormatError: not a flow weights file.
    """
    path = default_flow_path() if path is None else path
    if not os.path.isfile(path):
        raise PolicyLoadError(f"no flow weights at {path!s} (train them: python -m chunkline.bench.closedloop.train_flow)")
    try:
        with np.load(path, allow_pickle=False) as z:
            raw = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise WeightsFormatError(f"{path!s} is not a readable .npz: {exc}") from None
    blob = raw.pop(FLOW_HEADER_KEY, None)
    if blob is None or blob.dtype != np.uint8:
        raise WeightsFormatError(f"{path!s} has no {FLOW_HEADER_KEY} header")
    try:
        header = json.loads(bytes(blob).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsFormatError(f"{path!s}: the header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != FLOW_FORMAT or header.get("version") != FLOW_VERSION:
        raise WeightsFormatError(f"{path!s}: not a {FLOW_FORMAT} v{FLOW_VERSION} file")
    return FlowWeights({k: v.astype(np.float32) for k, v in raw.items()}, int(header["horizon"]), int(header["action_dim"]),
                       float(header["scale"]), int(header["steps"]), dict(header.get("info") or {}))


def soft_mask(mask: np.ndarray, delay: np.ndarray, decay_steps: float) -> np.ndarray:
    """Guidance weights ``[B, H]``: 1 on the frozen rows (given rows below ``delay``), then
    ``exp(-(i - delay + 1) / decay_steps)`` over the rest of the given rows, 0 where none is given."""
    rows = np.arange(mask.shape[1])[None, :]
    d = delay[:, None]
    w = np.where(rows < d, 1.0, np.exp(-(rows - d + 1) / decay_steps))
    return (w * mask).astype(np.float32)


class FlowPolicy(Policy):
    """The flow-matching reach policy on torch (CPU or CUDA).

    Args:
        weights: the parameters.
        device: ``"cpu"``, ``"cuda:0"``...
        max_guidance: the cap on the guidance weight.
        decay_steps: how fast the soft mask decays past the frozen rows (steps).
        seed: the seed of the initial noise (the same for every request).
    """

    accepts_prefix = True

    def __init__(self, weights: FlowWeights, *, device: str = "cpu", max_guidance: float = 5.0, decay_steps: float = 8.0,
                 seed: int = 0) -> None:
        import torch

        self._torch = torch
        self.name = "reach-flow"
        self.spec = reach_spec(horizon=weights.horizon)
        self.weights = weights
        self.device = torch.device(device)
        self.max_guidance = float(max_guidance)
        self.decay_steps = float(decay_steps)
        self._params = [(torch.as_tensor(weights.arrays[f"w{i}"], device=self.device),
                         torch.as_tensor(weights.arrays[f"b{i}"], device=self.device)) for i in range(FLOW_LAYERS)]
        n = weights.horizon * weights.action_dim
        gen = torch.Generator().manual_seed(seed)
        self._noise = torch.randn(n, generator=gen).to(self.device)
        self._fingerprint = make_fingerprint(
            weights=weights_digest(weights.arrays), backend="torch", versions={"torch": torch.__version__},
            precision="float32", device=str(self.device), spec=self.spec,
            settings={"steps": weights.steps, "scale": weights.scale, "max_guidance": self.max_guidance,
                      "decay_steps": self.decay_steps, "seed": seed, "sampler": "euler"},
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def velocity(self, x: Any, tau: Any, feats: Any) -> Any:
        """``v(x, tau, c)`` for a batch (torch tensors ``[B, H*A]``, ``[B, 1]``, ``[B, F]``)."""
        torch = self._torch
        emb = [tau] + [f(tau * w) for w in _TAU_FREQS for f in (torch.sin, torch.cos)]
        h = torch.cat([x, *emb, feats], dim=1)
        for i, (w, b) in enumerate(self._params):
            h = h @ w + b
            if i < FLOW_LAYERS - 1:
                h = torch.nn.functional.silu(h)
        return h

    def _sample(self, state: np.ndarray, target: np.ndarray | None, weight: np.ndarray | None) -> np.ndarray:
        torch = self._torch
        wts = self.weights
        b = state.shape[0]
        feats = torch.as_tensor(np.asarray(bc_features(np, state)), device=self.device)
        x = self._noise.expand(b, -1).clone()
        guided = False
        if target is not None and weight is not None and bool(weight.any()):
            guided = True
            y = torch.as_tensor(target, device=self.device)
            w = torch.as_tensor(np.repeat(weight, wts.action_dim, axis=1), device=self.device)
        steps = wts.steps
        for k in range(steps):
            tau_v = k / steps
            tau = torch.full((b, 1), tau_v, device=self.device)
            if not guided:
                with torch.no_grad():
                    v = self.velocity(x, tau, feats)
            else:
                xg = x.detach().requires_grad_(True)
                v = self.velocity(xg, tau, feats)
                x1_hat = xg + (1.0 - tau_v) * v
                err = w * (y - x1_hat)
                (grad,) = torch.autograd.grad(x1_hat, xg, grad_outputs=err)
                # Guidance weight: small while the sample is mostly noise, growing towards the
                # data end; the 1/r^2 form follows the Gaussian-posterior reading of the paper.
                r2 = (1.0 - tau_v) ** 2 / (tau_v ** 2 + (1.0 - tau_v) ** 2)
                beta = min(self.max_guidance, (1.0 - tau_v) / max(tau_v * r2, 1e-6))
                v = (v + beta * grad).detach()
            x = (x + v / steps).detach()
            if guided:
                # Then pull the sample towards where the prefix's own path stands at the new tau
                # (the straight path from this sample's noise to the prefix), by the mask's weight.
                # Vector-Jacobian guidance alone barely moves a policy whose chunk hardly depends on
                # its noise (a near-deterministic expert's clone); this makes the frozen rows the
                # prefix at tau = 1 and blends the overlap, while the network, seeing them at every
                # step, shapes the free rows to continue them.
                tau_next = (k + 1) / steps
                on_path = (1.0 - tau_next) * self._noise + tau_next * y
                x = x + w * (on_path - x)
        out = x.reshape(b, wts.horizon, wts.action_dim).cpu().numpy() * wts.scale
        return (state[:, None, : wts.action_dim] + out).astype(np.float32)

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        state = np.asarray(obs["state"], dtype=np.float32)
        return self._sample(state, None, None)

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Any) -> tuple[np.ndarray, Any]:
        state = np.asarray(obs["state"], dtype=np.float32)
        if not prefix.any:
            return self._sample(state, None, None), states
        q = state[:, None, : self.weights.action_dim]
        target = ((prefix.actions - q) / self.weights.scale).reshape(state.shape[0], -1).astype(np.float32)
        weight = soft_mask(prefix.mask, prefix.delay, self.decay_steps)
        return self._sample(state, target, weight), states


def build_reach_flow(*, device: str = "cpu", path: str | None = None) -> FlowPolicy:
    """The shipped ``reach-flow`` policy (torch)."""
    return FlowPolicy(load_flow(path), device=device)
