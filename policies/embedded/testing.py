"""Policies for testing the server: slow, failing, and recording ones.

They serve the embedded ALOHA-like spec by default and return zeros like :class:`NoopPolicy`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..base import ArraySpec, Policy, PolicySpec, make_fingerprint
from ..exceptions import PolicyConfigError
from ..numpy_backend import batch_size_of
from ..prefix import PrefixBatch
from .noop import FailingPolicy, NoopPolicy, SleepPolicy

__all__ = ["SleepPolicy", "FailingPolicy", "CountingPolicy", "PrefixEchoPolicy"]


class CountingPolicy(Policy):
    """Records the size of every batch it is given (thread-safe), then delegates.

    Args:
        inner: the policy that computes the actions; a :class:`NoopPolicy` by default.
        name: the policy's name (defaults to the inner policy's).
    """

    def __init__(self, inner: Policy | None = None, *, name: str | None = None) -> None:
        self.inner = inner or NoopPolicy()
        self.name = name or self.inner.name
        self.spec = self.inner.spec
        self._lock = threading.Lock()
        self._sizes: list[int] = []

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    @property
    def batch_sizes(self) -> list[int]:
        """The sizes of the batches seen so far, in order (a copy); warmup is not counted."""
        with self._lock:
            return list(self._sizes)

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self._sizes)

    def reset(self) -> None:
        """Forget the batches seen so far."""
        with self._lock:
            self._sizes.clear()

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        size = batch_size_of(obs)
        with self._lock:
            self._sizes.append(size)
        return self.inner.infer_batch(obs)

    def warmup(self) -> None:
        self.inner.warmup()

    def close(self) -> None:
        self.inner.close()


class PrefixEchoPolicy(Policy):
    """Answers each request with the prefix it was given, on the chunk's grid: row ``i`` holds
    the prefix action due with chunk row ``i``, ``-1`` where the row has none, and the last
    column marks the frozen rows (``1``), the other given rows (``0``) and rows without one (``-1``). Proves that a robot's prefix
    reaches the policy, aligned, whatever the batch around it.

    Args:
        action_dim: ``A`` (at least 2: the last column is the frozen-row marker).
        horizon: ``H``.
        dt: the policy's ``dt``.
        action_offset: the chunk's start after ``obs_time``.
    """

    accepts_prefix = True

    def __init__(self, action_dim: int = 3, horizon: int = 8, dt: float = 0.02, action_offset: float = 0.0) -> None:
        if action_dim < 2:
            raise PolicyConfigError("action_dim must be >= 2")
        self.name = "prefix-echo"
        self.spec = PolicySpec({"state": ArraySpec((2,), "float32")}, action_dim, horizon, dt, action_offset)
        self._fingerprint = make_fingerprint(weights="none", backend="echo", versions={}, precision="float32",
                                             device="cpu", spec=self.spec)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        b = batch_size_of(obs)
        return np.full((b, self.spec.horizon, self.spec.action_dim), -1.0, np.float32)

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Any) -> tuple[np.ndarray, Any]:
        out = np.where(prefix.mask[:, :, None], prefix.actions, np.float32(-1.0)).astype(np.float32)
        rows = np.arange(self.spec.horizon)[None, :]
        out[:, :, -1] = np.where(prefix.mask, rows < prefix.delay[:, None], -1.0)
        return out, states
