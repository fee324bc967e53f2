"""The observation spec every embedded policy serves: ALOHA-like (DESIGN.md section 6)."""

from __future__ import annotations

from collections.abc import Sequence

from ..base import ArraySpec, FieldSpec, PolicySpec, TextSpec

__all__ = ["ALOHA_CAMERAS", "IMAGE_SIZE", "STATE_DIM", "ACTION_DIM", "HORIZON", "DT", "aloha_spec", "camera_key"]

#: the three ALOHA cameras openpi's examples send (resized to 224x224x3 uint8).
ALOHA_CAMERAS: tuple[str, ...] = ("cam_high", "cam_left_wrist", "cam_right_wrist")
IMAGE_SIZE = 224
STATE_DIM = 14
ACTION_DIM = 14
HORIZON = 50
DT = 0.02  # 50 Hz bimanual control


def camera_key(camera: str) -> str:
    """The observation field of a camera: ``images/<camera>``."""
    return f"images/{camera}"


def aloha_spec(
    *,
    cameras: Sequence[str] = ALOHA_CAMERAS,
    image_size: int = IMAGE_SIZE,
    state_dim: int = STATE_DIM,
    action_dim: int = ACTION_DIM,
    horizon: int = HORIZON,
    dt: float = DT,
) -> PolicySpec:
    """The embedded policies' spec: one ``(S, S, 3) uint8`` image per camera, ``state``
    ``(state_dim,) float32``, an optional ``prompt``; chunks of ``horizon x action_dim`` at ``dt``.

    Args:
        cameras: camera names (fields ``images/<name>``).
        image_size: ``S``, the square image side.
        state_dim: width of ``state``.
        action_dim: ``A``.
        horizon: ``H``.
        dt: seconds between actions.
    """
    fields: dict[str, FieldSpec] = {camera_key(c): ArraySpec((image_size, image_size, 3), "uint8") for c in cameras}
    fields["state"] = ArraySpec((state_dim,), "float32")
    fields["prompt"] = TextSpec()
    return PolicySpec(observation=fields, action_dim=action_dim, horizon=horizon, dt=dt)
