"""The ``noop`` policy: zeros, as fast as possible, for measuring server overhead."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..base import Policy, PolicySpec, make_fingerprint
from ..numpy_backend import batch_size_of
from .spec import aloha_spec

__all__ = ["NoopPolicy"]


class NoopPolicy(Policy):
    """Return ``zeros[B, H, A]`` without looking at the observation.

    Args:
        name: the policy's name.
        spec: defaults to the ALOHA-like embedded spec (50 x 14 at 50 Hz).
    """

    def __init__(self, name: str = "noop", spec: PolicySpec | None = None) -> None:
        self.name = name
        self.spec = spec or aloha_spec()
        self._fingerprint = make_fingerprint(
            weights="none", backend="noop", versions={}, precision="float32", device="cpu", spec=self.spec
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        # A fresh array each call (calloc'd, so nearly free): callers may write into the result.
        return np.zeros((batch_size_of(obs), self.spec.horizon, self.spec.action_dim), np.float32)
