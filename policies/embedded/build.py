"""Build an embedded policy on a backend: torch, JAX or numpy, same weights, same answers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..base import Policy
from ..exceptions import PolicyLoadError
from .models import numpy_fn
from .weights import EmbeddedWeights

__all__ = ["BACKENDS", "build_embedded"]

BACKENDS: tuple[str, ...] = ("torch", "jax", "numpy")


def build_embedded(
    weights: EmbeddedWeights,
    *,
    backend: str,
    device: str = "cpu",
    name: str | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    precision: str = "float32",
) -> Policy:
    """Serve ``weights`` with the chosen backend (torch or jax imported here, on demand).

    Args:
        weights: architecture and parameters.
        backend: ``"torch"``, ``"jax"`` or ``"numpy"``.
        device: ``"cpu"``, ``"cuda:0"``, ... (numpy: ``"cpu"`` only).
        name: the policy's name; defaults to the weights' kind.
        batch_sizes: JAX only: the compiled batch sizes.
        precision: torch only: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Raises:
        PolicyLoadError: unknown backend, numpy on a non-CPU device, a backend not installed,
            or a device the backend does not have.
    """
    name = name or weights.kind
    config = weights.config
    spec = config.spec()
    settings: dict[str, Any] = {"embedded": weights.kind}
    if backend == "numpy":
        if device != "cpu":
            raise PolicyLoadError(f"the numpy backend runs on 'cpu' only, not {device!r}")
        from ..numpy_backend import NumpyPolicy

        return NumpyPolicy(name, numpy_fn(config, weights.arrays), spec, weights=weights.arrays, settings=settings)
    if backend == "torch":
        try:
            from ..torch_backend import TorchPolicy
            from .torch_models import build_module
        except ImportError as exc:
            raise PolicyLoadError(f"backend 'torch' is not installed: {exc}") from exc
        return TorchPolicy(name, build_module(config, weights.arrays), spec, device=device, precision=precision,
                           settings=settings)
    if backend == "jax":
        try:
            import jax.numpy as jnp

            from ..jax_backend import JaxPolicy
        except ImportError as exc:
            raise PolicyLoadError(f"backend 'jax' is not installed: {exc}") from exc
        from .models import encode_inputs, forward

        apply_fn = functools.partial(forward, jnp, config)
        return JaxPolicy(name, apply_fn, dict(weights.arrays), spec, batch_sizes=batch_sizes, device=device,
                         settings=settings, preprocess=functools.partial(encode_inputs, config))
    raise PolicyLoadError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
