"""The zero-action policies: ``noop`` (as fast as possible, for measuring server overhead), and for
load and fault drills ``sleep:S`` (blocks S seconds a batch, like a slow forward pass) and ``fail``
(raises an injected failure)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..base import Policy, PolicySpec, make_fingerprint
from ..exceptions import InjectedPolicyFailure, PolicyConfigError
from ..numpy_backend import batch_size_of
from .spec import aloha_spec

__all__ = ["NoopPolicy", "SleepPolicy", "FailingPolicy"]


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
