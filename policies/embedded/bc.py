"""``reach-bc``: a small behaviour-cloning policy for the reach task, trained on the scripted
expert's demonstrations (``bench/closedloop/train_bc.py``), served on torch, JAX or numpy with
the same weights and the same answers.

The network sees rotation-invariant features of the state (the target's bearing relative to
the shoulder, the elbow angle, the joint velocities, the target's radius and its radial and
angular speeds) and predicts the chunk as joint offsets from the observed position, so one set
of weights covers every shoulder angle. An MLP of two hidden layers (tanh), ~94k parameters,
~370 kB of float32.

The file (``reach_bc.npz``) is a plain ``.npz``: ``w0, b0, w1, b1, w2, b2`` (linear weights
``[in, out]``) plus ``__chunkline_bc__``, a uint8 array holding a UTF-8 JSON header (format,
version, horizon, action dimension, output scale, training summary). Read with
``allow_pickle=False``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.fingerprint import weights_digest

from ..base import Policy
from ..exceptions import PolicyLoadError, WeightsFormatError
from .tasks import TASK_DT, reach_spec

__all__ = [
    "BC_HEADER_KEY",
    "BC_FORMAT",
    "BC_FEATURES",
    "BCWeights",
    "bc_features",
    "bc_forward",
    "default_bc_path",
    "load_bc",
    "save_bc",
    "build_reach_bc",
]

BC_HEADER_KEY = "__chunkline_bc__"
BC_FORMAT = "chunkline.bc"
BC_VERSION = 1
BC_FEATURES = 10
_LAYERS = 3


@dataclasses.dataclass(frozen=True)
class BCWeights:
    """The behaviour-cloning policy's parameters and settings.

    Args:
        arrays: ``w0, b0, w1, b1, w2, b2`` float32 (linear weights ``[in, out]``).
        horizon: actions per chunk.
        action_dim: ``A`` (2 for reach).
        scale: the outputs' scale (radians per unit of the network's output).
        info: the training summary (samples, epochs, validation error...).
    """

    arrays: Mapping[str, np.ndarray]
    horizon: int
    action_dim: int
    scale: float
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        want = {f"{k}{i}" for i in range(_LAYERS) for k in "wb"}
        if set(self.arrays) != want:
            raise WeightsFormatError(f"BC weights must be exactly {sorted(want)}, got {sorted(self.arrays)}")
        if self.arrays["w0"].shape[0] != BC_FEATURES:
            raise WeightsFormatError(f"w0 must take {BC_FEATURES} features, has {self.arrays['w0'].shape[0]}")
        if self.arrays[f"w{_LAYERS - 1}"].shape[1] != self.horizon * self.action_dim:
            raise WeightsFormatError("the last layer's width must be horizon * action_dim")
        for i in range(_LAYERS):
            w, b = self.arrays[f"w{i}"], self.arrays[f"b{i}"]
            if w.ndim != 2 or b.shape != (w.shape[1],) or w.dtype != np.float32 or b.dtype != np.float32:
                raise WeightsFormatError(f"layer {i}: w [in, out] and b [out], float32")
            if i and w.shape[0] != self.arrays[f"w{i - 1}"].shape[1]:
                raise WeightsFormatError(f"layer {i} does not take layer {i - 1}'s output")

    @property
    def num_params(self) -> int:
        return sum(a.size for a in self.arrays.values())

    def digest(self) -> str:
        """A digest of the arrays and settings (for fingerprints)."""
        return f"bc:{self.horizon}x{self.action_dim}:{self.scale}:{weights_digest(self.arrays)}"


def bc_features(xp: Any, state: Any) -> Any:
    """The network's input ``[B, 10]`` from states ``[B, 8]`` (numpy or ``jax.numpy``).

    ``[sin b, cos b, sin q1, cos q1, qd0 / 5, qd1 / 5, 10 (r - 0.125), v_r, r w / 0.3, sign(w)]``
    with ``b`` the target's bearing relative to the shoulder angle, ``r`` its distance from the
    centre, ``v_r`` its radial speed and ``w`` its angular rate.

    Args:
        xp: the array module.
        state: the observations' ``state`` field.
    """
    s = state.astype(xp.float32)
    q0, q1, qd0, qd1 = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
    px, py, vx, vy = s[:, 4], s[:, 5], s[:, 6], s[:, 7]
    r = xp.sqrt(px * px + py * py) + 1e-6
    bearing = xp.arctan2(py, px) - q0
    vr = (px * vx + py * vy) / r
    vt = (px * vy - py * vx) / r  # r * w
    return xp.stack([xp.sin(bearing), xp.cos(bearing), xp.sin(q1), xp.cos(q1), qd0 / 5.0, qd1 / 5.0,
                     10.0 * (r - 0.125), vr, vt / 0.3, xp.sign(vt)], axis=1)


def bc_forward(xp: Any, weights: Mapping[str, Any], scale: float, horizon: int, action_dim: int, state: Any) -> Any:
    """The chunk ``[B, H, A]`` for states ``[B, 8]`` (numpy or ``jax.numpy``).

    Args:
        xp: the array module.
        weights: ``w0 .. b2``.
        scale: output scale.
        horizon: ``H``.
        action_dim: ``A``.
        state: the observations' ``state`` field.
    """
    x = bc_features(xp, state)
    for i in range(_LAYERS):
        x = x @ weights[f"w{i}"] + weights[f"b{i}"]
        if i < _LAYERS - 1:
            x = xp.tanh(x)
    q = state[:, :action_dim].astype(xp.float32)
    return q[:, None, :] + scale * x.reshape(-1, horizon, action_dim)


def default_bc_path() -> str:
    """Where the shipped ``reach_bc.npz`` lies (next to this module)."""
    return os.path.join(os.path.dirname(__file__), "reach_bc.npz")


def save_bc(weights: BCWeights, path: str | os.PathLike[str]) -> None:
    """Write ``weights`` as an ``.npz`` (see the module docstring)."""
    header = {"format": BC_FORMAT, "version": BC_VERSION, "task": "reach", "horizon": weights.horizon,
              "action_dim": weights.action_dim, "scale": weights.scale, "info": dict(weights.info)}
    blob = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    arrays: dict[str, np.ndarray] = {**{k: np.asarray(v, dtype=np.float32) for k, v in weights.arrays.items()}, BC_HEADER_KEY: blob}
    np.savez(path, allow_pickle=False, **arrays)


def load_bc(path: str | os.PathLike[str] | None = None) -> BCWeights:
    """Read a file written by :func:`save_bc` (default: the shipped one).

    Raises:
        WeightsFormatError: not such a file, or a malformed one.
    """
    path = default_bc_path() if path is None else path
    try:
        with np.load(path, allow_pickle=False) as data:
            files = {k: np.array(data[k]) for k in data.files}
    except (OSError, ValueError) as exc:
        raise WeightsFormatError(f"cannot read BC weights {path!s}: {exc}") from exc
    blob = files.pop(BC_HEADER_KEY, None)
    if blob is None or blob.dtype != np.uint8 or blob.size > 1 << 16:
        raise WeightsFormatError(f"{path!s} has no {BC_HEADER_KEY} header")
    try:
        header = json.loads(blob.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsFormatError(f"{path!s}: unreadable header: {exc}") from exc
    if header.get("format") != BC_FORMAT or header.get("version") != BC_VERSION:
        raise WeightsFormatError(f"{path!s} is not a {BC_FORMAT} v{BC_VERSION} file")
    scale = float(header["scale"])
    if not (math.isfinite(scale) and scale > 0):
        raise WeightsFormatError(f"{path!s}: bad output scale {scale}")
    for k, v in files.items():
        if v.dtype != np.float32 or not np.isfinite(v).all():
            raise WeightsFormatError(f"{path!s}: {k} must be finite float32")
        v.setflags(write=False)
    return BCWeights(files, int(header["horizon"]), int(header["action_dim"]), scale, header.get("info", {}))


def _torch_module(weights: BCWeights) -> Any:
    import torch
    from torch import nn

    class ReachBCModule(nn.Module):
        """The same network in torch (its own implementation of the features and layers)."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList()
            for i in range(_LAYERS):
                w = weights.arrays[f"w{i}"]
                layer = nn.Linear(w.shape[0], w.shape[1])
                with torch.no_grad():
                    layer.weight.copy_(torch.from_numpy(np.array(w.T)))  # torch stores [out, in]
                    layer.bias.copy_(torch.from_numpy(np.array(weights.arrays[f"b{i}"])))
                self.layers.append(layer)

        def forward(self, obs: Mapping[str, Any]) -> Any:
            s = obs["state"].to(self.layers[0].weight.dtype)
            q0, q1, qd0, qd1, px, py, vx, vy = s.unbind(dim=1)
            r = torch.sqrt(px * px + py * py) + 1e-6
            bearing = torch.atan2(py, px) - q0
            vr = (px * vx + py * vy) / r
            vt = (px * vy - py * vx) / r
            x = torch.stack([torch.sin(bearing), torch.cos(bearing), torch.sin(q1), torch.cos(q1), qd0 / 5.0,
                             qd1 / 5.0, 10.0 * (r - 0.125), vr, vt / 0.3, torch.sign(vt)], dim=1)
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < _LAYERS - 1:
                    x = torch.tanh(x)
            q = s[:, : weights.action_dim]
            return q[:, None, :] + weights.scale * x.reshape(-1, weights.horizon, weights.action_dim)

    return ReachBCModule()


def build_reach_bc(*, backend: str = "numpy", device: str = "cpu", path: str | None = None,
                   name: str = "reach-bc") -> Policy:
    """The ``reach-bc`` policy on a backend.

    Args:
        backend: ``torch``, ``jax`` or ``numpy``.
        device: where to run (numpy: ``cpu`` only).
        path: a weights file (default: the shipped ``reach_bc.npz``).
        name: the policy's name.

    Raises:
        PolicyLoadError: unknown backend, a backend not installed, or a bad weights file.
    """
    weights = load_bc(path)
    spec = reach_spec(horizon=weights.horizon)
    if not math.isclose(spec.dt, TASK_DT):
        raise PolicyLoadError("the BC policy's dt differs from the task's")
    settings = {"bc": weights.digest()}
    fwd = functools.partial(bc_forward, scale=weights.scale, horizon=weights.horizon, action_dim=weights.action_dim)
    if backend == "numpy":
        if device != "cpu":
            raise PolicyLoadError(f"the numpy backend runs on 'cpu' only, not {device!r}")
        from ..numpy_backend import NumpyPolicy

        def fn(obs: Mapping[str, Any]) -> np.ndarray:
            return np.asarray(fwd(np, weights.arrays, state=np.asarray(obs["state"])))

        fn.__qualname__ = "reach_bc_numpy"
        return NumpyPolicy(name, fn, spec, weights=weights.arrays, settings=settings)
    if backend == "torch":
        try:
            from ..torch_backend import TorchPolicy
        except ImportError as exc:
            raise PolicyLoadError(f"backend 'torch' is not installed: {exc}") from exc
        return TorchPolicy(name, _torch_module(weights), spec, device=device, settings=settings)
    if backend == "jax":
        try:
            import jax.numpy as jnp

            from ..jax_backend import JaxPolicy
        except ImportError as exc:
            raise PolicyLoadError(f"backend 'jax' is not installed: {exc}") from exc

        def apply_fn(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> Any:
            return fwd(jnp, params, state=inputs["state"])

        return JaxPolicy(name, apply_fn, {k: np.asarray(v) for k, v in weights.arrays.items()}, spec,
                         batch_sizes=(1, 2, 4, 8), device=device, settings=settings,
                         preprocess=lambda obs: {"state": np.asarray(obs["state"])})
    raise PolicyLoadError(f"unknown backend {backend!r}; choose one of torch, jax, numpy")
