"""``reach-flow``: a flow-matching action policy for the reach task, with real-time-chunking
guidance, on torch (this module) and JAX (:mod:`.flow_jax`) with equal outputs.

A chunk is ``q + scale * B c``: ``B`` (:func:`chunk_basis`) holds ``K`` smooth orthonormal shapes.
The flow runs over the coefficients ``c`` from Gaussian noise to the demonstrations; the network
(reading :func:`flow_features`: the state, the target's acceleration, the frozen rows' end)
predicts the finished chunk (x1 prediction, trained by ``bench/closedloop/train_flow.py`` on the
expert's chunks continuing a prefix) and the sampler integrates ``(f - x) / (1 - tau)`` with
Euler steps. The noise is one fixed draw, so an answer depends on its observation and prefix
only, batched or alone, on either backend. With a prefix, every denoising step inpaints it in the
basis (the least-squares fit of ``w * prefix + (1 - w) * prediction`` under :func:`soft_mask`, a
short prefix continued by :func:`continue_prefix`) and adds the guidance of Black, Galliker and
Levine (2025) through the network's Jacobian, capped at ``max_guidance``; this implementation is
ours."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.fingerprint import weights_digest

from ..base import Policy, make_fingerprint
from ..exceptions import PolicyLoadError, WeightsFormatError
from ..prefix import PrefixBatch
from .bc import BC_FEATURES, bc_features
from .tasks import REACH_ACCEL_FIELD, reach_spec

__all__ = ["FLOW_HEADER_KEY", "FLOW_LAYERS", "FlowWeights", "FlowSettings", "FlowOps", "FlowPolicy", "chunk_basis",
           "default_flow_path", "save_flow", "load_flow", "soft_mask", "flow_input_width", "flow_inputs", "flow_features",
           "FLOW_EXTRA_FEATURES", "continue_prefix", "flow_net", "flow_sample", "tau_embedding", "guidance_weight"]

FLOW_HEADER_KEY = "__chunkline_flow__"
FLOW_FORMAT = "chunkline.flow"
FLOW_VERSION = 3
FLOW_LAYERS = 4
#: the chunk basis' default knot spacing (see :func:`chunk_basis`).
KNOT_POWER = 1.5
#: the time embedding: tau and sin/cos of tau at these frequencies (rad per unit tau).
_TAU_FREQS = (1.0, 2.0, 4.0, 8.0)


#: features besides :func:`~.bc.bc_features` (:func:`flow_features`).
FLOW_EXTRA_FEATURES = 11
#: the extra features' units: radial acceleration (m/s^2), velocity (rad per row) and
#: acceleration (rad per row^2) of the frozen rows' end.
_ACCEL_UNIT = 0.1
_ROW_VEL_UNIT = 0.1
_ROW_ACC_UNIT = 0.01


def flow_input_width(basis: int, action_dim: int) -> int:
    """The network's input width: the coefficients, the time embedding and the features."""
    return basis * action_dim + 1 + 2 * len(_TAU_FREQS) + BC_FEATURES + FLOW_EXTRA_FEATURES


def flow_features(state: np.ndarray, accel: np.ndarray | None, actions: np.ndarray | None, delay: np.ndarray | None,
                  mask: np.ndarray | None) -> np.ndarray:
    """The network's features ``[B, BC_FEATURES + FLOW_EXTRA_FEATURES]`` float32 (host, numpy).

    :func:`~.bc.bc_features`, then the target's radial acceleration (0 where ``accel`` is absent
    or all zero: a batch's filler), then the frozen rows' end: a flag, ``delay / H``, its offset
    from the observed joints (rad), its velocity and acceleration per row (from the last two and
    three frozen rows), and the sine and cosine of the target's bearing from its shoulder angle
    (the plan continues from there: which way round to meet the target is decided there). An item
    is frozen as the experts read a prefix: ``delay >= 1`` and every row below it given;
    otherwise its last ten features are 0.

    Args:
        state: ``[B, 8]``.
        accel: ``[B, 2]`` target accelerations, or ``None``.
        actions / delay / mask: the prefixes on the chunk's grid ``[B, H, A]``, ``[B]``, ``[B, H]``
            (``None``: no prefix).
    """
    s = np.asarray(state, dtype=np.float64)
    b = s.shape[0]
    extra = np.zeros((b, FLOW_EXTRA_FEATURES), np.float64)
    if accel is not None:
        acc = np.asarray(accel, dtype=np.float64)
        p, v = s[:, 4:6], s[:, 6:8]
        r = np.hypot(p[:, 0], p[:, 1]) + 1e-6
        omega = (p[:, 0] * v[:, 1] - p[:, 1] * v[:, 0]) / (r * r)
        rdd = (p[:, 0] * acc[:, 0] + p[:, 1] * acc[:, 1]) / r + r * omega * omega
        reported = np.any(acc != 0.0, axis=1) & np.isfinite(acc).all(axis=1)
        extra[:, 0] = np.where(reported, rdd / _ACCEL_UNIT, 0.0)
    if actions is not None and delay is not None and mask is not None:
        h = mask.shape[1]
        d = np.asarray(delay, dtype=np.int64)
        rows = np.arange(h)[None, :]
        frozen = (d >= 1) & np.all(np.asarray(mask) | (rows >= d[:, None]), axis=1)
        items = np.arange(b)
        act = np.asarray(actions, dtype=np.float64)
        last = np.clip(d - 1, 0, h - 1)
        end = act[items, last]
        vel = np.where((d >= 2)[:, None], end - act[items, np.maximum(last - 1, 0)], 0.0)
        prev_vel = act[items, np.maximum(last - 1, 0)] - act[items, np.maximum(last - 2, 0)]
        acc_row = np.where((d >= 3)[:, None], vel - prev_vel, 0.0)
        a = act.shape[2]
        bearing = np.arctan2(s[:, 5], s[:, 4]) - end[:, 0]
        part = np.concatenate([np.ones((b, 1)), (d / h)[:, None], end - s[:, :a], vel / _ROW_VEL_UNIT,
                               acc_row / _ROW_ACC_UNIT, np.sin(bearing)[:, None], np.cos(bearing)[:, None]], axis=1)
        extra[:, 1:] = np.where(frozen[:, None], part, 0.0)
    return np.concatenate([np.asarray(bc_features(np, s.astype(np.float32)), dtype=np.float64), extra], axis=1).astype(np.float32)


@functools.lru_cache(maxsize=8)
def chunk_basis(horizon: int, size: int, knot_power: float = KNOT_POWER) -> np.ndarray:
    """``[horizon, size]`` float32, orthonormal columns spanning the clamped cubic B-splines with
    ``size`` control points over the chunk's rows, knots at ``u ** knot_power`` for ``u`` evenly
    spaced (read-only; the same array on every call).

    B-splines span smooth curves with local control; orthonormalising them (QR, signs fixed so
    the result is unique) makes the coefficients' Euclidean norm the chunk's, so isotropic noise
    on the coefficients is isotropic over the smooth chunks and least squares is a transpose.
    Knots denser at the start (``knot_power > 1``) follow the chunk's first rows (the ones that
    run, and where the expert's acceleration-limited shaping bends hardest) more closely: with
    16 shapes, the expert's chunks fit to 0.035 mrad on average at power 1.5 against 0.10 evenly.

    Raises:
        WeightsFormatError: ``size`` not in ``4..horizon``, or knots so dense the shapes are
            nearly dependent on the chunk's rows.
    """
    degree = 3
    if not degree + 1 <= size <= horizon:
        raise WeightsFormatError(f"basis size must be in {degree + 1}..{horizon}, got {size}")
    if not (math.isfinite(knot_power) and 0.5 <= knot_power <= 3.0):
        raise WeightsFormatError(f"knot power must be in 0.5..3, got {knot_power}")
    inner = np.linspace(0.0, 1.0, size - degree + 1) ** knot_power
    knots = np.concatenate([np.zeros(degree), inner, np.ones(degree)])
    t = np.linspace(0.0, 1.0, horizon)
    # Cox-de Boor, degree 0 up; the last knot span is closed so t = 1 has a basis function.
    n0 = len(knots) - 1
    b = np.zeros((horizon, n0))
    for i in range(n0):
        last = knots[i + 1] == 1.0 and knots[i] < 1.0
        b[:, i] = (t >= knots[i]) & ((t < knots[i + 1]) | (last & (t == 1.0)))
    for d in range(1, degree + 1):
        nxt = np.zeros((horizon, n0 - d))
        for i in range(n0 - d):
            left = knots[i + d] - knots[i]
            right = knots[i + d + 1] - knots[i + 1]
            if left > 0:
                nxt[:, i] += (t - knots[i]) / left * b[:, i]
            if right > 0:
                nxt[:, i] += (knots[i + d + 1] - t) / right * b[:, i + 1]
        b = nxt
    q, r = np.linalg.qr(b)
    if np.abs(np.diag(r)).min() < 1e-2:
        raise WeightsFormatError(f"{size} shapes with knot power {knot_power} are nearly dependent over {horizon} rows")
    q = q * np.sign(np.diag(r))[None, :]
    out = q.astype(np.float32)
    out.setflags(write=False)
    return out


def tau_embedding(tau: float | np.ndarray) -> np.ndarray:
    """``[N, 1 + 2F]`` float32: ``[tau, sin(w tau), cos(w tau) ...]`` per value of ``tau`` (a number
    gives one row), computed on the host in float64 so every backend sees the same embedding."""
    t = np.atleast_1d(np.asarray(tau, dtype=np.float64))[:, None]
    parts = [t] + [f(t * w) for w in _TAU_FREQS for f in (np.sin, np.cos)]
    return np.concatenate(parts, axis=1).astype(np.float32)


def guidance_weight(tau: float, max_guidance: float) -> float:
    """The paper's guidance weight at ``tau``: small while the sample is mostly noise, growing
    towards the data end (the ``1 / r^2`` of its Gaussian-posterior reading), capped."""
    r2 = (1.0 - tau) ** 2 / (tau**2 + (1.0 - tau) ** 2)
    return min(max_guidance, (1.0 - tau) / max(tau * r2, 1e-6))


@dataclasses.dataclass(frozen=True)
class FlowWeights:
    """The flow policy's parameters and settings.

    Args:
        arrays: ``w0..w3, b0..b3`` float32.
        horizon: ``H``.
        action_dim: ``A``.
        basis: ``K``, the smooth shapes per chunk (:func:`chunk_basis`).
        scale: radians per unit of the coefficients.
        steps: Euler steps per sample.
        knot_power: the basis' knot spacing (:func:`chunk_basis`).
        info: the training summary.
    """

    arrays: Mapping[str, np.ndarray]
    horizon: int
    action_dim: int
    basis: int
    scale: float
    steps: int = 10
    knot_power: float = KNOT_POWER
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        want = {f"{k}{i}" for i in range(FLOW_LAYERS) for k in "wb"}
        if set(self.arrays) != want:
            raise WeightsFormatError(f"flow weights must be exactly {sorted(want)}, got {sorted(self.arrays)}")
        chunk_basis(self.horizon, self.basis, self.knot_power)  # raises for a basis the horizon cannot hold
        width = flow_input_width(self.basis, self.action_dim)
        if self.arrays["w0"].shape[0] != width:
            raise WeightsFormatError(f"w0 must take {width} inputs, has {self.arrays['w0'].shape[0]}")
        if self.arrays[f"w{FLOW_LAYERS - 1}"].shape[1] != self.basis * self.action_dim:
            raise WeightsFormatError("the last layer's width must be basis * action_dim")
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

    @property
    def basis_matrix(self) -> np.ndarray:
        """``B``, ``[H, K]``."""
        return chunk_basis(self.horizon, self.basis, self.knot_power)

    def params(self) -> dict[str, np.ndarray]:
        """What :func:`flow_sample` reads: the layers and the basis, float32."""
        return {**{k: np.array(v, np.float32) for k, v in self.arrays.items()}, "basis": np.array(self.basis_matrix)}


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    """How a chunk is drawn (the same on every backend).

    Args:
        max_guidance: the cap on the vector-Jacobian guidance weight (0: inpainting only).
        decay_steps: how fast the soft mask decays past the frozen rows (rows).
        seed: the seed of the noise (one draw, the same for every request).
    """

    max_guidance: float = 1.0
    decay_steps: float = 8.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_guidance) and self.max_guidance >= 0):
            raise PolicyLoadError(f"max_guidance must be finite and >= 0, got {self.max_guidance}")
        if not (math.isfinite(self.decay_steps) and self.decay_steps > 0):
            raise PolicyLoadError(f"decay_steps must be finite and > 0, got {self.decay_steps}")

    def noise(self, weights: FlowWeights) -> np.ndarray:
        """The initial sample ``[K * A]`` float32 (numpy's generator: identical on every backend)."""
        return np.random.default_rng(self.seed).standard_normal(weights.basis * weights.action_dim).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class FlowOps:
    """The operations :func:`flow_sample` needs whose spelling differs between torch and
    ``jax.numpy`` (everything else is ``@``, ``*``, ``+``, ``reshape`` and ``mT``).

    Args:
        asarray: a host float32 array to the backend's array (on its device).
        silu: ``x * sigmoid(x)``.
        broadcast_rows: ``(v [n], b) -> [b, n]``.
        vjp: ``f, x -> (f(x), pullback)`` with ``pullback(cotangent) = cotangent^T df/dx``.
    """

    asarray: Callable[[np.ndarray], Any]
    silu: Callable[[Any], Any]
    broadcast_rows: Callable[[Any, int], Any]
    vjp: Callable[[Callable[[Any], Any], Any], tuple[Any, Callable[[Any], Any]]]


def continue_prefix(prefix: PrefixBatch) -> tuple[np.ndarray, np.ndarray]:
    """The prefix on the chunk's grid continued past its last given row at that row's velocity
    (from the last two given rows; 0 with one row), and the rows it now covers ``[B, H]`` (every
    row from the first given one on; none for an item without a prefix).

    A robot that asks when its plan is nearly spent sends little more than the frozen rows; what
    follows them is then the chunk's own, and without a continuation the policy's plan would
    start where the observation says, not where the frozen rows are heading: a jump in velocity
    at the switch. The continuation (weighted by :func:`soft_mask`, decaying) hands over from the
    frozen rows' motion to the new plan, as the experts do by planning from the last frozen row.
    """
    act, given = prefix.actions, prefix.mask
    b, h = given.shape
    has: np.ndarray = np.asarray(given.any(axis=1))
    last = np.where(has, h - 1 - np.argmax(given[:, ::-1], axis=1), 0)
    items = np.arange(b)
    end = act[items, last]
    before: np.ndarray = np.asarray(given[items, np.maximum(last - 1, 0)] & (last >= 1))
    vel = np.where(before[:, None], end - act[items, np.maximum(last - 1, 0)], 0.0)
    rows = np.arange(h)[None, :]
    after = (rows > last[:, None]) & has[:, None]
    ahead = end[:, None, :] + (rows - last[:, None])[:, :, None] * vel[:, None, :]
    actions = np.where(after[:, :, None], ahead, act).astype(np.float32)
    covered = given | after
    return actions, covered


def soft_mask(mask: np.ndarray, delay: np.ndarray, decay_steps: float) -> np.ndarray:
    """Guidance weights ``[B, H]``: 1 on the frozen rows (rows of ``mask`` below ``delay``), then
    ``exp(-(i - delay + 1) / decay_steps)`` over the rest of ``mask``'s rows, 0 elsewhere."""
    rows = np.arange(mask.shape[1])[None, :]
    d = delay[:, None]
    w = np.where(rows < d, 1.0, np.exp(-(rows - d + 1) / decay_steps))
    return (w * mask).astype(np.float32)


def flow_inputs(weights: FlowWeights, state: np.ndarray, prefix: PrefixBatch | None, decay_steps: float,
                accel: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The sampler's host-side inputs for a batch: ``feats`` ``[B, F]`` (:func:`flow_features`), ``q`` ``[B, A]`` (the
    observed joints), ``target`` ``[B, H, A]`` (the prefix continued by :func:`continue_prefix`, as offsets
    from ``q`` over ``scale``; 0 where it covers nothing) and ``weight`` ``[B, H]``
    (:func:`soft_mask` over the rows it covers; all 0 without a prefix).

    Args:
        weights: the policy's weights (horizon, action dimension, scale).
        state: the observations' ``state`` field ``[B, 8]``.
        prefix: the batch's prefixes on the chunk's grid, or ``None``.
        decay_steps: the soft mask's decay.
        accel: the observations' ``target_accel`` ``[B, 2]``, or ``None``.
    """
    s = np.asarray(state, dtype=np.float32)
    b, h, a = s.shape[0], weights.horizon, weights.action_dim
    q = np.ascontiguousarray(s[:, :a])
    if prefix is None or not prefix.any:
        target = np.zeros((b, h, a), np.float32)
        weight = np.zeros((b, h), np.float32)
        feats = flow_features(s, accel, None, None, None)
    else:
        actions, covered = continue_prefix(prefix)
        target = np.where(covered[:, :, None], (actions - q[:, None, :]) / weights.scale, 0.0).astype(np.float32)
        weight = soft_mask(covered, prefix.delay, decay_steps)
        feats = flow_features(s, accel, prefix.actions, prefix.delay, prefix.mask)
    return {"feats": feats, "q": q, "target": target, "weight": weight}


def flow_net(params: Mapping[str, Any], x: Any, emb: Any, feats: Any, silu: Callable[[Any], Any]) -> Any:
    """``f(x, tau, c)``: the predicted finished coefficients ``[B, K * A]`` (any backend).

    Args:
        params: the layers.
        x: the sample ``[B, K * A]``.
        emb: :func:`tau_embedding` on the backend, ``[B, 1 + 2F]`` or ``[1, 1 + 2F]`` (one time
            for the whole batch, as when sampling).
        feats: the features ``[B, F]``.
        silu: the backend's SiLU.

    The first layer is applied by parts (coefficients, time, features) rather than to a
    concatenation, so a time shared by the batch costs one row.
    """
    n = x.shape[1]
    w0 = params["w0"]
    e = emb
    m = e.shape[1]
    h = x @ w0[:n] + feats @ w0[n + m:] + (e @ w0[n:n + m] + params["b0"])
    for i in range(1, FLOW_LAYERS):
        h = silu(h) @ params[f"w{i}"] + params[f"b{i}"]
    return h


def flow_sample(ops: FlowOps, params: Mapping[str, Any], inputs: Mapping[str, Any], noise: Any, *, steps: int,
                action_dim: int, scale: float, max_guidance: float, guided: bool) -> Any:
    """Draw a chunk ``[B, H, A]`` (backend arrays in, backend array out).

    Args:
        ops: the backend's operations.
        params: :meth:`FlowWeights.params` on the backend.
        inputs: :func:`flow_inputs` on the backend.
        noise: the initial sample ``[K * A]``.
        steps: Euler steps.
        action_dim: ``A``.
        scale: radians per unit of the coefficients.
        max_guidance: the vector-Jacobian guidance's cap (0: none; the product is skipped).
        guided: steer towards the prefix; ``False`` only when every row's weight is 0 (the
            result is then the same, computed without the steering's products).
    """
    basis = params["basis"]
    k_dim = basis.shape[1]
    feats, target, weight = inputs["feats"], inputs["target"], inputs["weight"]
    b = feats.shape[0]
    x = ops.broadcast_rows(noise, b)
    wcol = weight[:, :, None]

    def steer(x1: Any) -> Any:
        # B^T (w * (y - B x1)): the move of x1 to the least-squares fit of the blend
        # w * y + (1 - w) * B x1 (exactly 0 where w is 0).
        chunk = basis @ x1.reshape(b, k_dim, action_dim)
        return (basis.mT @ (wcol * (target - chunk))).reshape(b, k_dim * action_dim)

    for k in range(steps):  # unrolled under jax.jit: steps is a Python int
        tau = k / steps
        emb = ops.asarray(tau_embedding(tau))

        def net(xx: Any, emb: Any = emb) -> Any:
            return flow_net(params, xx, emb, feats, ops.silu)

        beta = guidance_weight(tau, max_guidance) if guided else 0.0
        if beta > 0.0:
            x1, pullback = ops.vjp(net, x)
        else:
            x1, pullback = net(x), None
        if guided:
            x1 = x1 + steer(x1)
        v = (x1 - x) / (1.0 - tau)
        if pullback is not None:
            v = v + beta * pullback(steer(x1))
        x = x + v / steps
    return inputs["q"][:, None, :] + scale * (basis @ x.reshape(b, k_dim, action_dim))


def default_flow_path() -> str:
    """Where the shipped weights are (``policies/embedded/reach_flow.npz``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "reach_flow.npz")


def save_flow(weights: FlowWeights, path: str | os.PathLike[str]) -> None:
    """Write ``weights`` as ``.npz`` (arrays float32, the header as uint8 JSON)."""
    header = {"format": FLOW_FORMAT, "version": FLOW_VERSION, "horizon": weights.horizon, "action_dim": weights.action_dim,
              "basis": weights.basis, "knot_power": weights.knot_power, "scale": weights.scale, "steps": weights.steps,
              "info": dict(weights.info)}
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in weights.arrays.items()}
    arrays[FLOW_HEADER_KEY] = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def load_flow(path: str | os.PathLike[str] | None = None) -> FlowWeights:
    """Read weights written by :func:`save_flow`.

    Raises:
        PolicyLoadError: no file there. WeightsFormatError: not a flow weights file (or an older version).
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
    if blob is None or blob.dtype != np.uint8 or blob.size > 1 << 16:
        raise WeightsFormatError(f"{path!s} has no {FLOW_HEADER_KEY} header")
    try:
        header = json.loads(bytes(blob).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsFormatError(f"{path!s}: the header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != FLOW_FORMAT or header.get("version") != FLOW_VERSION:
        raise WeightsFormatError(f"{path!s}: not a {FLOW_FORMAT} v{FLOW_VERSION} file")
    try:
        return FlowWeights({k: v.astype(np.float32) for k, v in raw.items()}, int(header["horizon"]), int(header["action_dim"]),
                           int(header["basis"]), float(header["scale"]), int(header["steps"]), float(header["knot_power"]),
                           dict(header.get("info") or {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightsFormatError(f"{path!s}: bad header field: {exc}") from None


def _torch_ops(device: Any) -> FlowOps:
    import torch

    def asarray(a: np.ndarray) -> Any:
        return torch.as_tensor(a, device=device)

    def vjp(f: Callable[[Any], Any], x: Any) -> tuple[Any, Callable[[Any], Any]]:
        xg = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = f(xg)

        def pullback(cotangent: Any) -> Any:
            (grad,) = torch.autograd.grad(out, xg, grad_outputs=cotangent)
            return grad.detach()

        return out.detach(), pullback

    return FlowOps(asarray=asarray, silu=torch.nn.functional.silu, broadcast_rows=lambda v, b: v.expand(b, -1), vjp=vjp)


class FlowPolicy(Policy):
    """The flow-matching reach policy on torch (CPU or CUDA).

    Args:
        weights: the parameters.
        device: ``"cpu"``, ``"cuda:0"``...
        settings: guidance and noise (:class:`FlowSettings`).
        name: the policy's name.
    """

    accepts_prefix = True

    def __init__(self, weights: FlowWeights, *, device: str = "cpu", settings: FlowSettings | None = None,
                 name: str = "reach-flow") -> None:
        import torch

        self._torch = torch
        self.name = name
        self.spec = reach_spec(horizon=weights.horizon)
        self.weights = weights
        self.settings = settings or FlowSettings()
        self.device = torch.device(device)
        self._ops = _torch_ops(self.device)
        self._params = {k: torch.as_tensor(v, device=self.device) for k, v in weights.params().items()}
        self._noise = torch.as_tensor(self.settings.noise(weights), device=self.device)
        self._fingerprint = make_fingerprint(
            weights=weights_digest(weights.arrays), backend="torch", versions={"torch": torch.__version__},
            precision="float32", device=str(self.device), spec=self.spec,
            settings={"flow": flow_fingerprint_settings(weights, self.settings)},
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def _sample(self, state: np.ndarray, prefix: PrefixBatch | None, accel: np.ndarray | None) -> np.ndarray:
        torch = self._torch
        w = self.weights
        host = flow_inputs(w, state, prefix, self.settings.decay_steps, accel)
        inputs = {k: torch.as_tensor(v, device=self.device) for k, v in host.items()}
        with torch.no_grad():
            chunk = flow_sample(self._ops, self._params, inputs, self._noise, steps=w.steps, action_dim=w.action_dim,
                                scale=w.scale, max_guidance=self.settings.max_guidance, guided=bool(host["weight"].any()))
        return np.asarray(chunk.cpu().numpy(), dtype=np.float32)

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        return self._sample(np.asarray(obs["state"], dtype=np.float32), None, obs.get(REACH_ACCEL_FIELD))

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Any) -> tuple[np.ndarray, Any]:
        return self._sample(np.asarray(obs["state"], dtype=np.float32), prefix, obs.get(REACH_ACCEL_FIELD)), states


def flow_fingerprint_settings(weights: FlowWeights, settings: FlowSettings) -> dict[str, Any]:
    """What a flow policy's fingerprint records besides the weights (the same on both backends)."""
    return {"steps": weights.steps, "scale": weights.scale, "basis": weights.basis, "knot_power": weights.knot_power,
            "sampler": "euler-x1",
            **dataclasses.asdict(settings)}
