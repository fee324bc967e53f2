"""The robot-side LeRobot mapping: per-motor observations and camera dicts to a served policy's
arrays and back, from the metadata the server publishes, with a typed error for each mismatch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkline.client.exceptions import MappingError, MappingErrorReason
from chunkline.client.lerobot_mapping import LeRobotMapping
from chunkline.policies.base import ArraySpec, PolicySpec, TextSpec

#: an SO-101 arm as LeRobot names it, in an order the checkpoint chose (not alphabetical)
MOTORS = ["shoulder_pan.pos", "shoulder_lift.pos", "elbow_flex.pos", "wrist_flex.pos", "wrist_roll.pos", "gripper.pos"]


def metadata(names: dict[str, list[str]] | None = None, camera_shape: tuple[int | None, ...] = (None, None, 3)) -> dict[str, Any]:
    """What the server publishes for a LeRobot checkpoint served with motor names."""
    spec = PolicySpec(observation={"observation.state": ArraySpec((6,), "float32"),
                                   "observation.images.front": ArraySpec(camera_shape, "uint8"),
                                   "task": TextSpec(required=False)}, action_dim=6, horizon=10, dt=1 / 30)
    meta: dict[str, Any] = {"name": "lerobot-act", "fingerprint": "sha256:0", **spec.to_wire()}
    if names is not False:
        meta["names"] = names or {"observation.state": MOTORS, "action": MOTORS}
    return meta


def robot_observation(**overrides: Any) -> dict[str, Any]:
    obs: dict[str, Any] = {m: float(i) / 10 for i, m in enumerate(MOTORS)}
    obs["front"] = np.zeros((480, 640, 3), np.uint8)
    obs.update(overrides)
    return obs


FEATURES = {**{m: float for m in MOTORS}, "front": (480, 640, 3)}


@pytest.fixture
def mapping() -> LeRobotMapping:
    return LeRobotMapping.from_metadata(metadata())


def test_from_metadata_reads_motors_cameras_and_task(mapping: LeRobotMapping) -> None:
    assert mapping.vectors == {"observation.state": tuple(MOTORS)}
    assert mapping.action_names == tuple(MOTORS)
    assert mapping.cameras == {"front": (None, None, 3)}
    assert mapping.task


def test_the_state_follows_the_checkpoint_order_not_the_robots(mapping: LeRobotMapping) -> None:
    shuffled = dict(reversed(list(robot_observation().items())))
    obs = mapping.observation(shuffled, task="fold")
    assert obs["observation.state"].dtype == np.float32
    np.testing.assert_array_equal(obs["observation.state"], np.arange(6, dtype=np.float32) / 10)
    assert obs["observation.images.front"] is shuffled["front"], "frames pass through uncopied"
    assert obs["task"] == "fold"


def test_actions_map_back_to_motor_names(mapping: LeRobotMapping) -> None:
    chunk = np.arange(60, dtype=np.float32).reshape(10, 6)
    steps = mapping.actions(chunk)
    assert len(steps) == 10 and list(steps[1]) == MOTORS
    assert steps[1] == {m: float(6 + i) for i, m in enumerate(MOTORS)}
    assert all(type(v) is float for v in steps[0].values()), "plain floats, as robot.send_action takes"


def test_a_missing_motor_is_named(mapping: LeRobotMapping) -> None:
    obs = robot_observation()
    del obs["gripper.pos"]
    with pytest.raises(MappingError) as err:
        mapping.observation(obs)
    assert err.value.reason is MappingErrorReason.MISSING_MOTORS and err.value.names == ("gripper.pos",)


def test_an_extra_motor_is_named(mapping: LeRobotMapping) -> None:
    with pytest.raises(MappingError) as err:
        mapping.observation(robot_observation(**{"wrist_yaw.pos": 0.0}))
    assert err.value.reason is MappingErrorReason.EXTRA_MOTORS and err.value.names == ("wrist_yaw.pos",)


def test_a_value_that_is_not_a_finite_number_is_refused(mapping: LeRobotMapping) -> None:
    with pytest.raises(MappingError) as err:
        mapping.observation(robot_observation(**{"elbow_flex.pos": float("nan")}))
    assert err.value.reason is MappingErrorReason.BAD_VALUE and err.value.names == ("elbow_flex.pos",)
    with pytest.raises(MappingError) as err:
        mapping.observation(robot_observation(**{"elbow_flex.pos": "high"}))
    assert err.value.reason is MappingErrorReason.BAD_VALUE


def test_cameras_missing_extra_of_wrong_dtype_or_shape(mapping: LeRobotMapping) -> None:
    obs = robot_observation()
    del obs["front"]
    cases = [
        (obs, MappingErrorReason.MISSING_CAMERA, ("front",)),
        (robot_observation(wrist=np.zeros((96, 128, 3), np.uint8)), MappingErrorReason.EXTRA_CAMERA, ("wrist",)),
        (robot_observation(front=np.zeros((480, 640, 3), np.float32)), MappingErrorReason.CAMERA_DTYPE, ("front",)),
        (robot_observation(front=np.zeros((480, 640), np.uint8)), MappingErrorReason.CAMERA_SHAPE, ("front",)),
        (robot_observation(front=np.zeros((480, 640, 4), np.uint8)), MappingErrorReason.CAMERA_SHAPE, ("front",)),
    ]
    for observation, reason, names in cases:
        with pytest.raises(MappingError) as err:
            mapping.observation(observation)
        assert (err.value.reason, err.value.names) == (reason, names)


def test_a_camera_of_fixed_size_takes_only_that_size() -> None:
    fixed = LeRobotMapping.from_metadata(metadata(camera_shape=(224, 224, 3)))
    fixed.observation(robot_observation(front=np.zeros((224, 224, 3), np.uint8)))
    with pytest.raises(MappingError, match="224x224x3"):
        fixed.observation(robot_observation())


def test_check_robot_accepts_the_robot_it_was_trained_on(mapping: LeRobotMapping) -> None:
    mapping.check_robot(FEATURES, {m: float for m in reversed(MOTORS)})


def test_check_robot_names_what_does_not_fit(mapping: LeRobotMapping) -> None:
    no_gripper = {k: v for k, v in FEATURES.items() if k != "gripper.pos"}
    cases = [
        (no_gripper, {m: float for m in MOTORS}, MappingErrorReason.MISSING_MOTORS),
        ({**FEATURES, "wrist": (480, 640, 3)}, {m: float for m in MOTORS}, MappingErrorReason.EXTRA_CAMERA),
        ({**FEATURES, "front": (480, 640, 1)}, {m: float for m in MOTORS}, MappingErrorReason.CAMERA_SHAPE),
        (FEATURES, {m: float for m in [*MOTORS, "base.vel"]}, MappingErrorReason.EXTRA_MOTORS),
        (FEATURES, {m: float for m in MOTORS[:5]}, MappingErrorReason.MISSING_MOTORS),
    ]
    for observation, action, reason in cases:
        with pytest.raises(MappingError) as err:
            mapping.check_robot(observation, action)
        assert err.value.reason is reason


def test_metadata_without_names_says_how_to_serve_them() -> None:
    with pytest.raises(MappingError, match="dataset=PATH") as err:
        LeRobotMapping.from_metadata(metadata(names=False))  # type: ignore[arg-type]
    assert err.value.reason is MappingErrorReason.NO_NAMES


def test_names_that_do_not_fit_the_spec_are_refused() -> None:
    with pytest.raises(MappingError, match="7 names") as err:
        LeRobotMapping.from_metadata(metadata(names={"observation.state": MOTORS[:5] + ["a", "b"], "action": MOTORS}))
    assert err.value.reason is MappingErrorReason.NO_NAMES
    with pytest.raises(MappingError, match="action"):
        LeRobotMapping.from_metadata(metadata(names={"observation.state": MOTORS, "action": MOTORS[:3]}))


def test_an_action_of_the_wrong_width_is_refused(mapping: LeRobotMapping) -> None:
    with pytest.raises(MappingError) as err:
        mapping.actions(np.zeros((10, 7), np.float32))
    assert err.value.reason is MappingErrorReason.ACTION_SHAPE
    with pytest.raises(MappingError):
        mapping.actions(np.zeros(6, np.float32))


def test_dataset_feature_names_reads_lerobot_info_json(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from chunkline.policies.exceptions import PolicyLoadError
    from chunkline.policies.lerobot_policy import dataset_feature_names

    (tmp_path / "meta").mkdir()
    info = {"features": {
        "observation.state": {"dtype": "float32", "shape": [6], "names": MOTORS},
        "action": {"dtype": "float32", "shape": [6], "names": {"motors": MOTORS}},  # older datasets
        "observation.images.front": {"dtype": "video", "shape": [480, 640, 3], "names": ["height", "width", "channels"]},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    }}
    (tmp_path / "meta" / "info.json").write_text(json.dumps(info))
    assert dataset_feature_names(tmp_path) == {"observation.state": MOTORS, "action": MOTORS}
    with pytest.raises(PolicyLoadError, match="info.json"):
        dataset_feature_names(tmp_path / "nowhere")
