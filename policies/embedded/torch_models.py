"""The embedded policies as ``torch.nn.Module`` s (importing this module imports torch).

An implementation independent of :mod:`.models` (torch layers, ``scaled_dot_product_attention``),
loading the same ``[in, out]`` weights; tests compare the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import WeightsFormatError
from .config import LOADTEST_MAX_STEP, ComputeConfig, EmbeddedConfig, LoadtestConfig
from .models import LN_EPS, prompt_features
from .spec import camera_key

__all__ = ["LoadtestModule", "ComputeModule", "build_module", "load_arrays"]


def _images_as_float(img: torch.Tensor, stride: int, dtype: torch.dtype) -> torch.Tensor:
    return img[:, ::stride, ::stride, :].to(dtype) * (2.0 / 255.0) - 1.0


def _prompt(obs: Mapping[str, Any], batch: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    prompts = obs.get("prompt")
    feats = prompt_features(None if prompts is None else list(prompts), batch, dim)
    return torch.from_numpy(feats).to(device=like.device, dtype=like.dtype)


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width, eps=LN_EPS)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))
        return out


class LoadtestModule(nn.Module):
    """The weight-bound MLP action head (:class:`~.config.LoadtestConfig`).

    Args:
        config: the architecture.
    """

    def __init__(self, config: LoadtestConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.inp = nn.Linear(config.features, w)
        self.tok = nn.Parameter(torch.zeros(config.tokens, w))
        self.blocks = nn.ModuleList(_Block(w, w * config.expansion) for _ in range(config.blocks))
        self.out_ln = nn.LayerNorm(w, eps=LN_EPS)
        self.head = nn.Linear(config.tokens * w, config.horizon * config.action_dim)

    def forward(self, obs: Mapping[str, Any]) -> torch.Tensor:
        cfg = self.config
        like = self.inp.weight
        state = obs["state"]
        batch, g, k = state.shape[0], cfg.pool_grid, cfg.pool
        feats = [
            _images_as_float(obs[camera_key(c)], cfg.image_stride, like.dtype)
            .reshape(batch, g, k, g, k, 3).mean(dim=(2, 4)).reshape(batch, g * g * 3)
            for c in cfg.cameras
        ]
        feats += [state.to(like.dtype), _prompt(obs, batch, cfg.prompt_dim, like)]
        x = self.inp(torch.cat(feats, dim=1)).unsqueeze(1) + self.tok  # [B, T, W]
        for block in self.blocks:
            x = block(x)
        y = self.head(self.out_ln(x).reshape(batch, cfg.tokens * cfg.width))
        # The path from the observed state, summed in float32 (as the numpy and JAX forms do).
        steps = LOADTEST_MAX_STEP * torch.tanh(y.float()).reshape(batch, cfg.horizon, cfg.action_dim)
        start = state.float()[:, : cfg.action_dim]
        if start.shape[1] < cfg.action_dim:
            start = F.pad(start, (0, cfg.action_dim - start.shape[1]))
        return start[:, None, :] + torch.cumsum(steps, dim=1)


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, eps=LN_EPS)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=LN_EPS)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, heads, N, hd]
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return out


class ComputeModule(nn.Module):
    """The compute-bound transformer (:class:`~.config.ComputeConfig`).

    Args:
        config: the architecture.
    """

    def __init__(self, config: ComputeConfig) -> None:
        super().__init__()
        self.config = config
        d = config.width
        self.patch = nn.Linear(config.patch * config.patch * 3, d)
        self.state = nn.Linear(config.state_dim, d)
        self.prompt = nn.Linear(config.prompt_dim, d)
        self.queries = nn.Parameter(torch.zeros(config.action_dim, d))
        self.pos = nn.Parameter(torch.zeros(config.seq_len, d))
        self.layers = nn.ModuleList(_Layer(d, config.heads, d * config.expansion) for _ in range(config.layers))
        self.out_ln = nn.LayerNorm(d, eps=LN_EPS)
        self.head = nn.Linear(d, config.horizon)

    def forward(self, obs: Mapping[str, Any]) -> torch.Tensor:
        cfg = self.config
        like = self.patch.weight
        state = obs["state"]
        batch, g, k, a = state.shape[0], cfg.patch_grid, cfg.patch, cfg.action_dim
        tokens = [
            self.patch(
                _images_as_float(obs[camera_key(c)], cfg.image_stride, like.dtype)
                .reshape(batch, g, k, g, k, 3).permute(0, 1, 3, 2, 4, 5).reshape(batch, g * g, k * k * 3)
            )
            for c in cfg.cameras
        ]
        tokens.append(self.state(state.to(like.dtype)).unsqueeze(1))
        tokens.append(self.prompt(_prompt(obs, batch, cfg.prompt_dim, like)).unsqueeze(1))
        tokens.append(self.queries.unsqueeze(0).expand(batch, -1, -1))
        x = torch.cat(tokens, dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        y = self.head(self.out_ln(x[:, -a:, :]))  # [B, A, H]
        return torch.tanh(y).transpose(1, 2)


_LEAVES = {"w": "weight", "g": "weight", "b": "bias"}  # linear weight, LayerNorm gain, any bias/shift


def _torch_name(name: str) -> str:
    """Our parameter name to the module's (``in.w`` -> ``inp.weight``; ``tok`` stays ``tok``)."""
    head, _, leaf = name.rpartition(".")
    if not head:
        return name
    if head == "in":  # ``in`` is a Python keyword, so the module calls that layer ``inp``
        head = "inp"
    return f"{head}.{_LEAVES[leaf]}"


def load_arrays(module: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy ``[in, out]`` arrays into the module's parameters (transposing linear weights).

    Args:
        module: a :class:`LoadtestModule` or :class:`ComputeModule`.
        arrays: parameters by our names.

    Raises:
        WeightsFormatError: a name the module does not have, or a parameter left unset.
    """
    params = dict(module.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, arr in arrays.items():
            target = _torch_name(name)
            if target not in params:
                raise WeightsFormatError(f"the module has no parameter for {name!r}")
            src = arr.T if name.endswith(".w") else arr  # torch Linear stores [out, in]
            # np.array copies: shared read-only arrays are never aliased (and torch never warns).
            params[target].copy_(torch.from_numpy(np.array(src)))
            seen.add(target)
    missing = set(params) - seen
    if missing:
        raise WeightsFormatError(f"parameters not set: {sorted(missing)}")


def build_module(config: EmbeddedConfig, arrays: Mapping[str, np.ndarray]) -> nn.Module:
    """The torch module for ``config`` with ``arrays`` loaded (on CPU, float32).

    Args:
        config: the architecture.
        arrays: parameters by our names.
    """
    module: nn.Module = LoadtestModule(config) if isinstance(config, LoadtestConfig) else ComputeModule(config)
    load_arrays(module, arrays)
    return module
