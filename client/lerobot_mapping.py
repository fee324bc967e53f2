"""Map a LeRobot robot's observations and actions to a served LeRobot policy's spec, and back.

A LeRobot robot speaks per motor and per camera: ``robot.get_observation()`` returns
``{"shoulder_pan.pos": 0.1, ..., "front": <H x W x 3 uint8>}`` and ``robot.send_action`` takes
``{"shoulder_pan.pos": 0.2, ...}``. A policy served with ``--policy lerobot:PATH`` takes arrays
(``observation.state`` in the checkpoint's motor order, ``observation.images.<camera>`` frames,
an optional ``task``) and returns ``[H, A]`` chunks. The server publishes the motor names in the
model's metadata when it is given them (``--policy-arg dataset=PATH``, or ``state_names=`` and
``action_names=``); :meth:`LeRobotMapping.from_metadata` builds the mapping from that metadata,
so the robot never hard-codes an order.

    client = Client.connect(url)
    mapping = LeRobotMapping.from_metadata(client.hello.models["act"])
    mapping.check_robot(robot.observation_features, robot.action_features)   # once, up front
    chunk = client.infer(mapping.observation(robot.get_observation(), task="fold the towel"))
    for action in mapping.actions(chunk.actions):
        robot.send_action(action)

Every mismatch is a :class:`~chunkline.client.exceptions.MappingError` with a reason and the
motors or cameras concerned. Robot side: numpy only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .exceptions import MappingError, MappingErrorReason

__all__ = ["LeRobotMapping", "CAMERA_PREFIX", "TASK_FIELD"]

#: the prefix of a camera's field in a LeRobot policy's spec (``observation.images.front``)
CAMERA_PREFIX = "observation.images."
#: the language instruction's field
TASK_FIELD = "task"


def _listed(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


@dataclasses.dataclass(frozen=True)
class LeRobotMapping:
    """How one policy's fields are made of a robot's motors and cameras.

    Args:
        vectors: per vector field (``observation.state``, ...), its motor names in order.
        action_names: the action's motor names, in the order of a chunk's columns.
        cameras: per robot camera name, its field's shape (``None`` for a free size).
        task: whether the policy takes a ``task`` text.
    """

    vectors: Mapping[str, tuple[str, ...]]
    action_names: tuple[str, ...]
    cameras: Mapping[str, tuple[int | None, ...]]
    task: bool = False

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> LeRobotMapping:
        """From a served policy's metadata (the native ``hello``'s ``models[name]``, or openpi's
        metadata frame).

        Raises:
            MappingError: ``no_names`` when the metadata lists no motor names (or too few).
        """
        names = metadata.get("names")
        observation = metadata.get("observation") or {}
        if not isinstance(names, Mapping) or "action" not in names:
            raise MappingError(MappingErrorReason.NO_NAMES,
                               f"the policy {metadata.get('name', '?')!r} publishes no motor names: serve it with "
                               "--policy-arg dataset=PATH (its LeRobot dataset) or state_names=... and action_names=...")
        vectors: dict[str, tuple[str, ...]] = {}
        cameras: dict[str, tuple[int | None, ...]] = {}
        for key, field in observation.items():
            if field.get("kind") == "text":
                continue
            shape = tuple(field.get("shape") or ())
            if key.startswith(CAMERA_PREFIX):
                cameras[key[len(CAMERA_PREFIX):]] = shape
            elif key in names:
                vectors[key] = tuple(names[key])
                if len(shape) != 1 or shape[0] != len(vectors[key]):
                    raise MappingError(MappingErrorReason.NO_NAMES, f"{key} has shape {list(shape)} but "
                                       f"{len(vectors[key])} names", vectors[key])
            elif field.get("required", True):
                raise MappingError(MappingErrorReason.NO_NAMES, f"the policy's metadata names no motors for {key}", (key,))
        action = tuple(names["action"])
        if len(action) != metadata.get("action_dim", len(action)):
            raise MappingError(MappingErrorReason.NO_NAMES, f"{len(action)} action names for {metadata.get('action_dim')} "
                               "action entries", action)
        return cls(vectors=vectors, action_names=action, cameras=cameras, task=TASK_FIELD in observation)

    # ------------------------------------------------------------------ features

    @property
    def motors(self) -> frozenset[str]:
        """Every motor name an observation must carry."""
        return frozenset(n for names in self.vectors.values() for n in names)

    def check_robot(self, observation_features: Mapping[str, Any], action_features: Mapping[str, Any]) -> None:
        """Check a LeRobot robot's ``observation_features`` and ``action_features`` (per motor a
        type, per camera its ``(H, W, C)`` shape) against the mapping, before the first request.

        Raises:
            MappingError: the first of missing or extra motors (observation, then action), missing
                or extra cameras, a camera whose shape the policy does not take.
        """
        robot_cameras = {k: tuple(v) for k, v in observation_features.items() if isinstance(v, tuple | list)}
        robot_motors = set(observation_features) - set(robot_cameras)
        self._check_names(robot_motors, self.motors, "the robot's observation")
        self._check_cameras(set(robot_cameras))
        for name, shape in robot_cameras.items():
            self._check_shape(name, shape)
        self._check_names(set(action_features), set(self.action_names), "the robot's action")

    @staticmethod
    def _check_names(have: set[str], want: set[str] | frozenset[str], where: str) -> None:
        missing, extra = want - have, have - want
        if missing:
            raise MappingError(MappingErrorReason.MISSING_MOTORS, f"{where} lacks {_listed(missing)} (the policy wants "
                               f"{_listed(want)})", tuple(sorted(missing)))
        if extra:
            raise MappingError(MappingErrorReason.EXTRA_MOTORS, f"{where} has motors the policy does not know: "
                               f"{_listed(extra)}", tuple(sorted(extra)))

    def _check_cameras(self, have: set[str]) -> None:
        missing, extra = set(self.cameras) - have, have - set(self.cameras)
        if missing:
            raise MappingError(MappingErrorReason.MISSING_CAMERA, f"no frame from camera {_listed(missing)} "
                               f"(the policy wants {_listed(set(self.cameras))})", tuple(sorted(missing)))
        if extra:
            raise MappingError(MappingErrorReason.EXTRA_CAMERA, f"the policy takes no camera {_listed(extra)} "
                               f"(it wants {_listed(set(self.cameras))})", tuple(sorted(extra)))

    def _check_shape(self, camera: str, shape: tuple[int, ...]) -> None:
        want = self.cameras[camera]
        if len(shape) != len(want) or any(w is not None and w != d for w, d in zip(want, shape, strict=False)):
            free = ["any" if w is None else str(w) for w in want]
            raise MappingError(MappingErrorReason.CAMERA_SHAPE, f"camera {camera} gives {'x'.join(map(str, shape))} frames; "
                               f"the policy takes {'x'.join(free)}", (camera,))

    # ------------------------------------------------------------------ observations and actions

    def observation(self, robot_observation: Mapping[str, Any], task: str | None = None) -> dict[str, Any]:
        """The policy's observation from a robot's: each vector in the checkpoint's motor order
        (float32), each camera's frame under its field (uint8 ``H x W x 3``, not copied), the task.

        Raises:
            MappingError: a motor or camera missing or extra, a value that is not a finite real
                number, a frame of the wrong shape or dtype.
        """
        frames = {k: v for k, v in robot_observation.items() if k in self.cameras or isinstance(v, np.ndarray) and v.ndim >= 2}
        self._check_names(set(robot_observation) - set(frames), self.motors, "the observation")
        self._check_cameras(set(frames))
        out: dict[str, Any] = {}
        for key, names in self.vectors.items():
            values = [robot_observation[n] for n in names]
            try:
                vector = np.array(values, dtype=np.float32)
            except (TypeError, ValueError) as exc:
                raise MappingError(MappingErrorReason.BAD_VALUE, f"{key}: not numbers: {exc}", names) from exc
            bad = [n for n, v in zip(names, vector.tolist(), strict=True) if not math.isfinite(v)]
            if vector.shape != (len(names),) or bad:
                raise MappingError(MappingErrorReason.BAD_VALUE, f"{key}: {_listed(bad) or 'values'} not finite real "
                                   "numbers", tuple(bad) or names)
            out[key] = vector
        for camera, frame in frames.items():
            if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8:
                dtype = getattr(frame, "dtype", type(frame).__name__)
                raise MappingError(MappingErrorReason.CAMERA_DTYPE, f"camera {camera} gives {dtype} frames; the policy "
                                   "takes uint8 H x W x 3", (camera,))
            self._check_shape(camera, frame.shape)
            out[CAMERA_PREFIX + camera] = frame
        if task is not None and self.task:
            out[TASK_FIELD] = task
        return out

    def action(self, row: np.ndarray | Sequence[float]) -> dict[str, float]:
        """One action (a chunk's row) as ``{motor: value}``, what ``robot.send_action`` takes.

        Raises:
            MappingError: ``action_shape`` for a row of another width.
        """
        values = np.asarray(row, dtype=np.float64)
        if values.shape != (len(self.action_names),):
            raise MappingError(MappingErrorReason.ACTION_SHAPE, f"an action of shape {list(values.shape)}; the policy's "
                               f"has {len(self.action_names)} motors", self.action_names)
        return dict(zip(self.action_names, values.tolist(), strict=True))

    def actions(self, chunk: np.ndarray) -> list[dict[str, float]]:
        """A chunk ``[H, A]`` as one ``{motor: value}`` per step.

        Raises:
            MappingError: ``action_shape`` for a chunk that is not ``[H, number of action motors]``.
        """
        chunk = np.asarray(chunk)
        if chunk.ndim != 2:
            raise MappingError(MappingErrorReason.ACTION_SHAPE, f"a chunk of shape {list(chunk.shape)}, expected "
                               f"[H, {len(self.action_names)}]", self.action_names)
        return [self.action(row) for row in chunk]
