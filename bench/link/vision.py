"""A small fixed-weight CNN policy on three camera frames and the robot state, and realistic
frames (MuJoCo renders) to run it on: the vision policy of ``chunkline bench link``.

Not a trained policy: its weights are drawn from a fixed seed (He initialisation). It is there
to measure how far JPEG moves a convolutional policy's actions away from what it does on raw
frames. A trained policy is smoother in some directions and sharper in others, so the figure is
an indication of the effect's size, not a guarantee for another network; run the same
measurement on the policy you serve (``action_deviation`` takes any policy).

Serve it with ``--policy chunkline.bench.link.vision:vision_policy``; its spec lets the cameras
travel as JPEG (quality 50 and up) and an optional depth map as PNG.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.policies.base import ArraySpec, FieldSpec, Policy, PolicySpec, TextSpec
from chunkline.policies.embedded.spec import ACTION_DIM, ALOHA_CAMERAS, DT, HORIZON, STATE_DIM, camera_key
from chunkline.policies.numpy_backend import NumpyPolicy

__all__ = ["vision_spec", "vision_policy", "VisionCNN", "render_frames", "CAMERAS", "IMAGE"]

IMAGE = 224
CAMERAS = tuple(camera_key(c) for c in ALOHA_CAMERAS)
_PATCH = 8
_C1, _C2, _HIDDEN = 16, 32, 128


def vision_spec() -> PolicySpec:
    """Three 224x224x3 cameras (raw or JPEG), an optional 224x224 uint16 depth map (raw or PNG),
    the state; ALOHA-sized chunks."""
    fields: dict[str, FieldSpec] = {cam: ArraySpec((IMAGE, IMAGE, 3), "uint8", encodings=("raw", "jpeg"), jpeg_min_quality=50)
                                    for cam in CAMERAS}
    fields["depth"] = ArraySpec((IMAGE, IMAGE), "uint16", required=False, encodings=("raw", "png"))
    fields["state"] = ArraySpec((STATE_DIM,), "float32")
    fields["prompt"] = TextSpec()
    return PolicySpec(observation=fields, action_dim=ACTION_DIM, horizon=HORIZON, dt=DT)


class VisionCNN:
    """Per camera: an 8x8 stride-8 convolution (16 channels), a 2x2 stride-2 one (32), ReLUs and
    a mean pool; the cameras' features and the state through a 128-unit layer to a
    ``[50, 14]`` chunk in (-1, 1).

    Args:
        seed: the weights' seed.
    """

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)

        def he(fan_in: int, *shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

        n_cams = len(CAMERAS)
        self.weights = {
            "conv1": he(_PATCH * _PATCH * 3, _PATCH * _PATCH * 3, _C1), "conv1_b": np.zeros(_C1, np.float32),
            "conv2": he(4 * _C1, 4 * _C1, _C2), "conv2_b": np.zeros(_C2, np.float32),
            "fc1": he(n_cams * _C2 + STATE_DIM, n_cams * _C2 + STATE_DIM, _HIDDEN), "fc1_b": np.zeros(_HIDDEN, np.float32),
            "fc2": he(_HIDDEN, _HIDDEN, HORIZON * ACTION_DIM) * 0.5, "fc2_b": np.zeros(HORIZON * ACTION_DIM, np.float32),
        }

    def features(self, images: np.ndarray) -> np.ndarray:
        """``[B, 224, 224, 3]`` uint8 to ``[B, 32]`` features."""
        w = self.weights
        b = images.shape[0]
        g = IMAGE // _PATCH
        x = images.astype(np.float32) * (1.0 / 255.0) - 0.5
        x = x.reshape(b, g, _PATCH, g, _PATCH, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, g, g, _PATCH * _PATCH * 3)
        x = np.maximum(x @ w["conv1"] + w["conv1_b"], 0.0)
        h = g // 2
        x = x.reshape(b, h, 2, h, 2, _C1).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, h, 4 * _C1)
        x = np.maximum(x @ w["conv2"] + w["conv2_b"], 0.0)
        return x.mean(axis=(1, 2))

    def __call__(self, obs: Mapping[str, Any]) -> np.ndarray:
        w = self.weights
        feats = [self.features(np.asarray(obs[cam])) for cam in CAMERAS]
        z = np.concatenate([*feats, np.asarray(obs["state"], np.float32)], axis=1)
        z = np.maximum(z @ w["fc1"] + w["fc1_b"], 0.0)
        out = np.tanh(z @ w["fc2"] + w["fc2_b"])
        return out.reshape(-1, HORIZON, ACTION_DIM).astype(np.float32)


def vision_policy() -> Policy:
    """The CNN as a servable policy (``module:factory`` reference)."""
    cnn = VisionCNN()
    return NumpyPolicy("vision-cnn", cnn, vision_spec(), weights=cnn.weights)


#: MuJoCo scenes the frames come from, one per camera, each from its own viewpoint
_SCENES = ("Ant-v5", "HalfCheetah-v5", "Hopper-v5")


def render_frames(per_camera: int = 6, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``per_camera`` observations of three rendered 224x224 MuJoCo frames (one scene per
    camera, random actions between frames) and a random state.

    Raises:
        RuntimeError: rendering is impossible here (gymnasium[mujoco] or an OpenGL backend missing).
    """
    os.environ.setdefault("MUJOCO_GL", "egl")  # headless; read when mujoco is imported
    try:
        import gymnasium
    except ImportError as exc:
        raise RuntimeError("rendered frames need gymnasium[mujoco]: pip install 'chunkline[sim]'") from exc
    rng = np.random.default_rng(seed)
    frames: dict[str, list[np.ndarray]] = {}
    for cam, scene in zip(CAMERAS, _SCENES, strict=True):
        try:
            env = gymnasium.make(scene, render_mode="rgb_array", width=IMAGE, height=IMAGE)
        except Exception as exc:  # gymnasium raises several kinds for a missing mujoco or GL
            raise RuntimeError(f"cannot render {scene}: {type(exc).__name__}: {exc}") from exc
        try:
            env.reset(seed=seed)
            env.action_space.seed(seed)  # reset seeds the scene, not the space's own sampler
            shots = []
            for _ in range(per_camera):
                for _ in range(5):
                    env.step(env.action_space.sample())
                shots.append(np.ascontiguousarray(env.render(), dtype=np.uint8))
            frames[cam] = shots
        finally:
            env.close()
    return [{**{cam: frames[cam][i] for cam in CAMERAS}, "state": rng.standard_normal(STATE_DIM).astype(np.float32)}
            for i in range(per_camera)]
