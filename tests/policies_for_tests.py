"""Policies loaded by server subprocesses in tests through ``module:factory`` (PYTHONPATH=tests)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from chunkline.policies.embedded import aloha_spec
from chunkline.policies.numpy_backend import NumpyPolicy


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
    from chunkline.policies.base import ArraySpec, PolicySpec

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
