"""Policies loaded by server subprocesses in tests through ``module:factory`` (PYTHONPATH=tests)."""

from __future__ import annotations

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
