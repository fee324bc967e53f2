"""Policies for testing the server: slow, failing, and recording ones.

They serve the embedded ALOHA-like spec by default and return zeros like :class:`NoopPolicy`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..base import ArraySpec, Policy, PolicySpec, make_fingerprint
from ..exceptions import InjectedPolicyFailure, PolicyConfigError
from ..numpy_backend import batch_size_of
from ..prefix import PrefixBatch
from .noop import NoopPolicy

__all__ = ["SleepPolicy", "FailingPolicy", "CountingPolicy", "PrefixEchoPolicy"]


class SleepPolicy(NoopPolicy):
    """A no-op that blocks its calling thread for ``seconds`` per batch, like a slow forward
    pass: proves the server's event loop stays responsive while a worker is busy.

    Raises:
        PolicyConfigError: ``seconds`` is negative or NaN.

    Args:
        seconds: how long each :meth:`infer_batch` blocks (``warmup`` does not block).
        spec: defaults to the embedded spec.
        sleep: the blocking call, injectable so tests can record instead of wait.
        name: the policy's name.
    """

    def __init__(
        self,
        seconds: float,
        *,
        spec: PolicySpec | None = None,
        sleep: Callable[[float], None] = time.sleep,
        name: str | None = None,
    ) -> None:
        if not seconds >= 0:  # also refuses NaN
            raise PolicyConfigError(f"seconds must be >= 0, got {seconds!r}")
        super().__init__(name or f"sleep:{seconds:g}", spec)
        self.seconds = float(seconds)
        self._sleep = sleep
        self._fingerprint = make_fingerprint(
            weights="none", backend="sleep", versions={}, precision="float32", device="cpu", spec=self.spec,
            settings={"seconds": self.seconds},
        )

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        out = super().infer_batch(obs)
        self._sleep(self.seconds)
        return out

    def warmup(self) -> None:
        """Nothing to warm: loading a sleep policy must not take ``seconds``."""


class FailingPolicy(NoopPolicy):
    """Raises :class:`~chunkline.policies.exceptions.InjectedPolicyFailure` from
    :meth:`infer_batch`, after ``succeed_first`` successful batches.

    :meth:`warmup` succeeds, so a server can load it and then see every request fail.

    Args:
        message: the exception's message.
        succeed_first: batches answered with zeros before failures start.
        spec: defaults to the embedded spec.
        name: the policy's name.
    """

    def __init__(
        self,
        message: str = "injected failure",
        *,
        succeed_first: int = 0,
        spec: PolicySpec | None = None,
        name: str = "fail",
    ) -> None:
        super().__init__(name, spec)
        self.message = message
        self._remaining = succeed_first
        self._lock = threading.Lock()
        self.failures = 0

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        with self._lock:
            if self._remaining > 0:
                self._remaining -= 1
                return super().infer_batch(obs)
            self.failures += 1
        raise InjectedPolicyFailure(self.message)

    def warmup(self) -> None:
        """Succeeds without counting as a batch."""


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
