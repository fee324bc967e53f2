"""The embedded policies' forward passes, written once against the array API that numpy and
``jax.numpy`` share (``xp``), plus the host-side text features every backend uses.

The torch modules in :mod:`.torch_models` are a separate implementation of the same maths,
so comparing them with these functions checks both. Linear weights are ``[in, out]``.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .config import LOADTEST_MAX_STEP, ComputeConfig, EmbeddedConfig, LoadtestConfig
from .spec import camera_key

__all__ = [
    "LN_EPS",
    "prompt_features",
    "encode_inputs",
    "loadtest_forward",
    "compute_forward",
    "forward",
    "numpy_fn",
]

LN_EPS = 1e-5
_GELU_C = math.sqrt(2.0 / math.pi)


@functools.lru_cache(maxsize=4096)
def _word_bucket(word: str, dim: int) -> int:
    return zlib.crc32(word.encode("utf-8", "surrogatepass")) % dim


def prompt_features(prompts: Sequence[str] | None, batch: int, dim: int) -> np.ndarray:
    """A hashed bag of words per prompt, L2-normalised: ``[batch, dim]`` float32.

    A stand-in for a language encoder that costs microseconds and is identical in every
    backend (it runs on the host, before any framework sees the batch). Empty or absent
    prompts give zeros.

    Args:
        prompts: ``batch`` strings, or ``None`` when the batch has no prompt field.
        batch: ``B``.
        dim: number of hash buckets.
    """
    out = np.zeros((batch, dim), np.float32)
    if prompts is None:
        return out
    for i, text in enumerate(prompts):
        words = text.lower().split()
        for word in words:
            out[i, _word_bucket(word, dim)] += 1.0
        norm = float(np.sqrt(np.dot(out[i], out[i])))
        if norm:
            out[i] /= norm
    return out


def encode_inputs(config: EmbeddedConfig, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays :func:`forward` reads: the batch's array fields, and ``prompt`` replaced by
    its :func:`prompt_features`. The JAX backend's ``preprocess``.

    Args:
        config: the architecture (``prompt_dim``).
        obs: a stacked batch.
    """
    arrays = {k: v for k, v in obs.items() if isinstance(v, np.ndarray)}
    batch = len(next(iter(arrays.values())))
    prompts = obs.get("prompt")
    arrays["prompt"] = prompt_features(None if prompts is None else list(prompts), batch, config.prompt_dim)
    return arrays


def _layer_norm(xp: Any, x: Any, g: Any, b: Any) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / xp.sqrt(var + LN_EPS) * g + b


def _gelu(xp: Any, x: Any) -> Any:
    # the tanh approximation, which torch (approximate="tanh") and jax.nn.gelu also offer
    return 0.5 * x * (1.0 + xp.tanh(_GELU_C * (x + 0.044715 * (x * x * x))))


def _linear(x: Any, p: Mapping[str, Any], name: str) -> Any:
    # Fold leading dims into one so BLAS sees one GEMM, not one GEMV per row.
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1]) @ p[name + ".w"] + p[name + ".b"]
    return y.reshape(*lead, y.shape[-1])


def _images_as_float(xp: Any, img: Any, stride: int) -> Any:
    # Subsample before converting: 1/stride^2 of the pixels ever become floats.
    return img[:, ::stride, ::stride, :].astype(xp.float32) * (2.0 / 255.0) - 1.0


def loadtest_forward(xp: Any, config: LoadtestConfig, p: Mapping[str, Any], inputs: Mapping[str, Any]) -> Any:
    """The weight-bound MLP head (see :class:`~.config.LoadtestConfig`): ``[B, H, A]``.

    Args:
        xp: ``numpy`` or ``jax.numpy``.
        config: the architecture.
        p: parameters by name.
        inputs: the output of :func:`encode_inputs`.
    """
    state = inputs["state"]
    batch = state.shape[0]
    g, k = config.pool_grid, config.pool
    feats = []
    for cam in config.cameras:
        sub = _images_as_float(xp, inputs[camera_key(cam)], config.image_stride)
        feats.append(sub.reshape(batch, g, k, g, k, 3).mean(axis=(2, 4)).reshape(batch, g * g * 3))
    feats += [state.astype(xp.float32), inputs["prompt"]]
    x = _linear(xp.concatenate(feats, axis=1), p, "in")  # [B, W]
    x = x[:, None, :] + p["tok"][None, :, :]  # [B, T, W]
    for i in range(config.blocks):
        b = f"blocks.{i}."
        h = _layer_norm(xp, x, p[b + "ln.g"], p[b + "ln.b"])
        x = x + _linear(_gelu(xp, _linear(h, p, b + "fc1")), p, b + "fc2")
    x = _layer_norm(xp, x, p["out_ln.g"], p["out_ln.b"])
    y = _linear(x.reshape(batch, config.tokens * config.width), p, "head")
    steps = LOADTEST_MAX_STEP * xp.tanh(y).reshape(batch, config.horizon, config.action_dim)
    return _state_as_action(xp, state, config.action_dim)[:, None, :] + xp.cumsum(steps, axis=1)


def _state_as_action(xp: Any, state: Any, action_dim: int) -> Any:
    """The first ``action_dim`` entries of ``state`` (zero-padded), float32: where the path starts."""
    s = state.astype(xp.float32)
    if s.shape[1] >= action_dim:
        return s[:, :action_dim]
    return xp.concatenate([s, xp.zeros((s.shape[0], action_dim - s.shape[1]), dtype=xp.float32)], axis=1)


def _softmax(xp: Any, x: Any) -> Any:
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def compute_forward(xp: Any, config: ComputeConfig, p: Mapping[str, Any], inputs: Mapping[str, Any]) -> Any:
    """The compute-bound transformer (see :class:`~.config.ComputeConfig`): ``[B, H, A]``.

    Args:
        xp: ``numpy`` or ``jax.numpy``.
        config: the architecture.
        p: parameters by name.
        inputs: the output of :func:`encode_inputs`.
    """
    state = inputs["state"]
    batch = state.shape[0]
    g, k, d = config.patch_grid, config.patch, config.width
    heads, hd, a = config.heads, config.width // config.heads, config.action_dim
    tokens = []
    for cam in config.cameras:
        sub = _images_as_float(xp, inputs[camera_key(cam)], config.image_stride)
        patches = sub.reshape(batch, g, k, g, k, 3).transpose(0, 1, 3, 2, 4, 5).reshape(batch, g * g, k * k * 3)
        tokens.append(_linear(patches, p, "patch"))
    tokens.append(_linear(state.astype(xp.float32), p, "state")[:, None, :])
    tokens.append(_linear(inputs["prompt"], p, "prompt")[:, None, :])
    tokens.append(xp.broadcast_to(p["queries"][None], (batch, a, d)))
    x = xp.concatenate(tokens, axis=1) + p["pos"][None]  # [B, N, D]
    n = x.shape[1]
    scale = 1.0 / math.sqrt(hd)
    for i in range(config.layers):
        pre = f"layers.{i}."
        h = _layer_norm(xp, x, p[pre + "ln1.g"], p[pre + "ln1.b"])
        qkv = _linear(h, p, pre + "qkv").reshape(batch, n, 3, heads, hd).transpose(2, 0, 3, 1, 4)
        q, kk, v = qkv[0], qkv[1], qkv[2]  # [B, heads, N, hd]
        att = _softmax(xp, (q @ kk.transpose(0, 1, 3, 2)) * scale)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(batch, n, d)
        x = x + _linear(o, p, pre + "proj")
        h = _layer_norm(xp, x, p[pre + "ln2.g"], p[pre + "ln2.b"])
        x = x + _linear(_gelu(xp, _linear(h, p, pre + "fc1")), p, pre + "fc2")
    x = _layer_norm(xp, x[:, n - a :, :], p["out_ln.g"], p["out_ln.b"])  # the query tokens
    y = _linear(x, p, "head")  # [B, A, H]
    return xp.tanh(y).transpose(0, 2, 1)


def forward(xp: Any, config: EmbeddedConfig, p: Mapping[str, Any], inputs: Mapping[str, Any]) -> Any:
    """Dispatch to the forward pass of ``config``'s kind.

    Args:
        xp: ``numpy`` or ``jax.numpy``.
        config: the architecture.
        p: parameters by name.
        inputs: the output of :func:`encode_inputs`.
    """
    if isinstance(config, LoadtestConfig):
        return loadtest_forward(xp, config, p, inputs)
    return compute_forward(xp, config, p, inputs)


def numpy_fn(config: EmbeddedConfig, params: Mapping[str, np.ndarray]) -> Any:
    """A ``fn(obs_batch) -> [B, H, A]`` for :class:`~chunkline.policies.numpy_backend.NumpyPolicy`.

    Args:
        config: the architecture.
        params: parameters by name (read, never written).
    """

    def fn(obs: Mapping[str, Any]) -> np.ndarray:
        return np.asarray(forward(np, config, params, encode_inputs(config, obs)))

    fn.__qualname__ = f"numpy_fn[{config.kind}]"
    return fn
