"""Policies for tests: in-process ones (``CountingPolicy``), and ones server subprocesses load
through ``module:factory`` (PYTHONPATH=tests)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.policies.base import ArraySpec, Policy, PolicySpec, make_fingerprint
from chunkline.policies.embedded import NoopPolicy, aloha_spec
from chunkline.policies.exceptions import PolicyConfigError
from chunkline.policies.numpy_backend import NumpyPolicy, batch_size_of
from chunkline.policies.prefix import PrefixBatch


def _fails_on_large_state(obs: dict[str, Any]) -> np.ndarray:
    if float(np.max(obs["state"][:, 0])) > 100.0:
        raise RuntimeError("state out of the training distribution")
    return np.zeros((len(obs["state"]), 50, 14), np.float32)


def flaky() -> NumpyPolicy:
    """Raises when any observation in the batch has ``state[0] > 100``; zeros otherwise."""
    return NumpyPolicy("flaky", _fails_on_large_state, aloha_spec())


def bad_shape() -> NumpyPolicy:
    """Returns the wrong output shape."""
    return NumpyPolicy("bad_shape", lambda obs: np.zeros((len(obs["state"]), 3), np.float32), aloha_spec())


class CallCounter(NumpyPolicy):
    """Stateful: each session's state counts its requests; actions are filled with that count."""

    stateful = True

    def __init__(self) -> None:
        super().__init__("counter", lambda obs: np.zeros((len(obs["state"]), 50, 14), np.float32), aloha_spec())

    def new_session_state(self) -> int:
        return 0

    def infer_batch_with_state(self, obs, states):
        counts = [s + 1 for s in states]
        actions = np.stack([np.full((50, 14), c, np.float32) for c in counts])
        return actions, counts


def counter() -> CallCounter:
    return CallCounter()


def _hangs_on_marker(obs: dict[str, Any]) -> np.ndarray:
    import time

    if float(np.max(obs["state"][:, 0])) == 555.0:
        time.sleep(4.0)  # a wedged backend (deadlock, stuck device call)
    return np.zeros((len(obs["state"]), 50, 14), np.float32)


def hangs() -> NumpyPolicy:
    """Hangs for 4 s on an observation whose ``state[0] == 555``."""
    return NumpyPolicy("hangs", _hangs_on_marker, aloha_spec())


def big_reply() -> NumpyPolicy:
    """State-only observations, 256 KiB chunks: a reader that stops reading fills buffers fast."""
    spec = PolicySpec(observation={"state": ArraySpec((14,), "float32")}, action_dim=64, horizon=1000, dt=0.01)
    return NumpyPolicy("big_reply", lambda obs: np.ones((len(obs["state"]), 1000, 64), np.float32), spec)


def fails_after_warmup() -> NumpyPolicy:
    """A regressed build: loads, warms up and passes the server's start-up timing, then fails
    every request (a rollout's canary that must be rolled back on its error rate)."""
    calls = itertools.count()

    def infer(obs: dict[str, Any]) -> np.ndarray:
        if next(calls) >= 16:
            raise RuntimeError("regressed build")
        return np.zeros((len(obs["state"]), 50, 14), np.float32)

    return NumpyPolicy("fails_after_warmup", infer, aloha_spec())


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
