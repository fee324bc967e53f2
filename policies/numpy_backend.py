"""A policy backed by a plain numpy callable (no accelerator, no heavy framework)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.fingerprint import weights_digest

from ._identity import callable_identity
from .base import ObservationError, Policy, PolicySpec, make_fingerprint
from .outputs import check_actions

__all__ = ["NumpyPolicy", "batch_size_of"]


def batch_size_of(obs: Mapping[str, Any]) -> int:
    """``B`` of a stacked batch: the length of its first field (array or list of strings).

    Args:
        obs: a batch as built by :func:`~chunkline.policies.base.stack_observations`.

    Raises:
        ObservationError: the batch has no fields, or its fields disagree on ``B``.
    """
    sizes = set(map(len, obs.values()))  # map: no Python frame per field (this runs per batch)
    if not sizes:
        raise ObservationError("a batch needs at least one field")
    if len(sizes) != 1:
        raise ObservationError(f"batch fields disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


class NumpyPolicy(Policy):
    """Serve ``fn(obs_batch) -> [B, H, A]`` written with numpy.

    Args:
        name: the policy's name.
        fn: called with the stacked batch (see :meth:`Policy.infer_batch`); must not write
            into its inputs, which may be read-only views of network buffers.
        spec: what the policy accepts and returns.
        weights: the arrays ``fn`` computes with, digested into the fingerprint. Without them
            the fingerprint names ``fn`` by module and qualified name.
        settings: anything else that changes behaviour, added to the fingerprint.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[Mapping[str, Any]], Any],
        spec: PolicySpec,
        *,
        weights: Mapping[str, np.ndarray] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.spec = spec
        self._fn = fn
        digest = weights_digest(weights) if weights is not None else "code:" + callable_identity(fn)
        self._fingerprint = make_fingerprint(
            weights=digest,
            backend="numpy",
            versions={"numpy": np.__version__},
            precision="float32",
            device="cpu",
            spec=spec,
            settings=dict(settings or {}),
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        return check_actions(self.spec, batch_size_of(obs), self._fn(obs))
