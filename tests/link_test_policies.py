"""Policies for the shaped-link and compressed-field tests, loaded by server subprocesses through
``module:factory`` (PYTHONPATH=tests)."""

from __future__ import annotations

import numpy as np

from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.policies.numpy_backend import NumpyPolicy

#: a camera large enough that decoding one frame takes tens of milliseconds
BIG_SIDE = 4096


def big_camera() -> NumpyPolicy:
    """One 4096x4096x3 camera (raw or JPEG) and a state; answers zeros without reading the image."""
    spec = PolicySpec(observation={"cam": ArraySpec((BIG_SIDE, BIG_SIDE, 3), "uint8", encodings=("raw", "jpeg")),
                                   "state": ArraySpec((2,), "float32")}, action_dim=2, horizon=4, dt=0.1)
    return NumpyPolicy("big-camera", lambda obs: np.zeros((len(obs["state"]), 4, 2), np.float32), spec)
