"""Observations shaped like the embedded policies' spec (ALOHA-like)."""

from __future__ import annotations

from typing import Any

import numpy as np

CAMERAS = ("images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist")


def aloha_obs(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {cam: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for cam in CAMERAS}
    obs["state"] = rng.standard_normal(14).astype(np.float32)
    obs["prompt"] = "pick up the cube"
    return obs
