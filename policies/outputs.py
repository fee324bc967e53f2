"""Checks applied to what every backend returns, before it leaves the policy layer."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import PolicySpec
from .exceptions import PolicyOutputError

__all__ = ["check_actions", "check_chunk"]


def _as_array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    # jax arrays and other array-likes expose __array__; lists and scalars are a bug upstream.
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        return np.asarray(value)
    raise PolicyOutputError(f"{what} must be an array, got {type(value).__name__}")


def _to_float32(arr: np.ndarray, what: str) -> np.ndarray:
    # bfloat16 (ml_dtypes) reports kind 'V'; accept it by name so JAX/torch half outputs pass.
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise PolicyOutputError(f"{what} has dtype {arr.dtype.name}, expected a float dtype")
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    return arr


def check_actions(spec: PolicySpec, batch_size: int, actions: Any) -> np.ndarray:
    """Validate a batched backend output and return it as float32 ``[B, H, A]``.

    Float outputs of another precision (float64, float16, bfloat16) are converted; any other
    dtype or any shape other than ``[batch_size, spec.horizon, spec.action_dim]`` is refused.
    Non-finite values pass: the robot-side safety filter handles them.

    Args:
        spec: the policy's spec (``horizon``, ``action_dim``).
        batch_size: ``B``, the number of observations in the batch.
        actions: what the backend returned.

    Raises:
        PolicyOutputError: wrong type, dtype or shape.
    """
    arr = _as_array(actions, "policy output")
    want = (batch_size, spec.horizon, spec.action_dim)
    if arr.shape != want:
        raise PolicyOutputError(f"policy output has shape {list(arr.shape)}, expected {list(want)}")
    return _to_float32(arr, "policy output")


def check_chunk(spec: PolicySpec, actions: Any) -> np.ndarray:
    """Validate one unbatched chunk ``[H, A]`` (openpi-style policies) and return it as float32.

    Args:
        spec: the policy's spec.
        actions: the chunk the policy returned.

    Raises:
        PolicyOutputError: wrong type, dtype or shape.
    """
    arr = _as_array(actions, "actions")
    want = (spec.horizon, spec.action_dim)
    if arr.shape != want:
        raise PolicyOutputError(f"actions have shape {list(arr.shape)}, expected {list(want)}")
    return _to_float32(arr, "actions")
