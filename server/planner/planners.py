"""The planner interface, and the embedded planner that really plans from the observation.

A :class:`Planner` turns one :class:`PlanInput` into a validated
:class:`~chunkline.server.planner.schema.PlanDocument`. :meth:`Planner.check` looks at the
observation before admission (a malformed one never takes a queue slot); :meth:`Planner.plan`
is awaited on the event loop, so a planner that computes for long runs its work elsewhere (a
thread, an upstream server).

:class:`NearestTargetPlanner` is the embedded planner of the hierarchical closed-loop task
(``bench/closedloop/hierarchical.py``): the observation holds the end effector's ``position``
``[x, y]`` and the pending ``targets`` ``[N, 3]`` (``id, x, y`` per row); the plan visits them
nearest first (a greedy tour), keeping the target the robot is already on when it is still
pending, so a target that appears mid-way does not make the robot turn back. Deterministic:
the same observation and context give the same plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal
from chunkline.server.planner.schema import SKILLS, PlanDocument, PlanStep, plan_json_schema, validate_plan

if TYPE_CHECKING:
    from chunkline.server.planner.image_encoder import ImageEncoder

__all__ = ["PlanInput", "PlanResult", "Planner", "NearestTargetPlanner", "MAX_TARGETS", "Workspace", "DEFAULT_WORKSPACE",
           "read_targets", "observed_targets", "target_planner_metadata"]

#: Most targets one observation may list (the embedded planner's tour is O(N^2)).
MAX_TARGETS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Workspace:
    """Where a plan may send the robot, and where observed positions may lie (scene units)."""

    xmin: float
    ymin: float
    xmax: float
    ymax: float

    def contains(self, x: float, y: float) -> bool:
        return self.xmin <= x <= self.xmax and self.ymin <= y <= self.ymax

    def __str__(self) -> str:
        return f"x {self.xmin:g}..{self.xmax:g}, y {self.ymin:g}..{self.ymax:g}"


#: The plan schema's coordinate bounds: no planner may place a goal outside them.
DEFAULT_WORKSPACE = Workspace(-1000.0, -1000.0, 1000.0, 1000.0)


@dataclasses.dataclass(frozen=True)
class PlanInput:
    """One plan request, as a planner sees it.

    Args:
        obs: the observation (names to arrays or strings), as decoded.
        obs_time: robot clock of the observation, or ``None``.
        instruction: the task in words.
        subtask: the subtask the robot is executing (``context.subtask``).
        progress: how far along it is (0-1), if known.
        plan_id: the plan the robot holds, if any.
        tenant: who asked (a planner's CPU-heavy preparation runs in this tenant's turn).
        encoder: the service's image encoder, shared by its planners (``None``: the planner's own).
    """

    obs: dict[str, Any]
    obs_time: float | None = None
    instruction: str = ""
    subtask: str | None = None
    progress: float | None = None
    plan_id: str | None = None
    tenant: str = ""
    encoder: ImageEncoder | None = None


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A planner's answer: the validated plan and how many model calls it took (2 after a repair)."""

    document: PlanDocument
    attempts: int = 1


class Planner(Protocol):
    """What the planner class drives (see the module docstring)."""

    name: str
    fingerprint: str
    max_steps: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def metadata(self) -> dict[str, Any]:
        """What the hello lists for this planner: schema, skills, observation fields."""

    def check(self, request: PlanInput) -> None:
        """Refuse a request this planner cannot plan from (raises ``Refusal``), before admission."""

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        """The plan; raises a ``Refusal`` (``plan_invalid``, ``policy_failed``, ``deadline_exceeded``)."""


def _array(obs: dict[str, Any], name: str) -> np.ndarray:
    value = obs.get(name)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiu":
        raise Refusal(ErrorCode.INVALID_OBSERVATION, f"the observation needs a numeric array {name!r}")
    if not np.isfinite(value).all():
        raise Refusal(ErrorCode.INVALID_OBSERVATION, f"{name!r} holds non-finite values")
    return value.astype(np.float64)


def target_planner_metadata(backend: str, fingerprint: str, max_steps: int) -> dict[str, Any]:
    """What the hello lists for a planner that plans from ``position`` and ``targets``."""
    return {
        "backend": backend,
        "fingerprint": fingerprint,
        "skills": list(SKILLS),
        "schema": plan_json_schema(max_steps),
        "observation": {"position": "float [2]: end effector x, y",
                        "targets": f"float [N, 3], N <= {MAX_TARGETS}: id, x, y of each pending target"},
    }


def read_targets(obs: dict[str, Any], workspace: Workspace = DEFAULT_WORKSPACE) -> tuple[np.ndarray, np.ndarray]:
    """The observation's ``position`` ``[2]`` and ``targets`` ``[N, 3]`` (id, x, y), checked,
    every position inside ``workspace``.

    Raises:
        Refusal: ``invalid_observation`` naming the field (or the target outside the workspace).
    """
    position = _array(obs, "position")
    if position.shape != (2,):
        raise Refusal(ErrorCode.INVALID_OBSERVATION, f"'position' must have shape (2,), got {position.shape}")
    if not workspace.contains(float(position[0]), float(position[1])):
        raise Refusal(ErrorCode.INVALID_OBSERVATION, f"'position' is outside the planner's workspace ({workspace})")
    return position, _targets(obs, workspace)


def observed_targets(obs: dict[str, Any], workspace: Workspace = DEFAULT_WORKSPACE) -> dict[str, tuple[float, float]] | None:
    """The observation's targets by plan id (``t<id>``) and position, checked as
    :func:`read_targets` does; ``None`` when the observation lists no ``targets``."""
    if "targets" not in obs:
        return None
    return {f"t{int(row[0])}": (float(row[1]), float(row[2])) for row in _targets(obs, workspace)}


def _targets(obs: dict[str, Any], workspace: Workspace) -> np.ndarray:
    targets = _array(obs, "targets")
    if targets.size == 0:
        targets = targets.reshape(0, 3)
    if targets.ndim != 2 or targets.shape[1] != 3 or targets.shape[0] > MAX_TARGETS:
        raise Refusal(ErrorCode.INVALID_OBSERVATION, f"'targets' must have shape (N <= {MAX_TARGETS}, 3), got {targets.shape}")
    ids = targets[:, 0]
    if (ids < 0).any() or (ids != np.round(ids)).any() or (ids >= 1 << 31).any() or len(set(ids.tolist())) != len(ids):
        raise Refusal(ErrorCode.INVALID_OBSERVATION, "target ids must be distinct non-negative integers")
    for row in targets:
        if not workspace.contains(float(row[1]), float(row[2])):
            raise Refusal(ErrorCode.INVALID_OBSERVATION, f"target t{int(row[0])} is outside the planner's workspace ({workspace})")
    return targets


class NearestTargetPlanner:
    """The embedded deterministic planner (see the module docstring).

    Args:
        name: the planner's served name.
        max_steps: most ``goto`` steps per plan.
        workspace: where positions and targets may lie; others are refused ``invalid_observation``.
    """

    def __init__(self, name: str, max_steps: int = 4, workspace: Workspace = DEFAULT_WORKSPACE) -> None:
        self.name = name
        self.max_steps = max_steps
        self.workspace = workspace
        self.fingerprint = "sha256:" + hashlib.sha256(f"chunkline.nearest-target.v1:{max_steps}".encode()).hexdigest()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def metadata(self) -> dict[str, Any]:
        return target_planner_metadata("embedded", self.fingerprint, self.max_steps)

    def check(self, request: PlanInput) -> None:
        read_targets(request.obs, self.workspace)

    def tour(self, request: PlanInput) -> PlanDocument:
        """The plan, computed synchronously (microseconds for a few dozen targets)."""
        position, targets = read_targets(request.obs, self.workspace)
        if targets.shape[0] == 0:
            return PlanDocument(steps=[PlanStep(skill="hold", target=None, goal=None)], note="no target pending")
        pending = {int(row[0]): (float(row[1]), float(row[2])) for row in targets}
        order: list[int] = []
        current = request.subtask[1:] if request.subtask is not None and request.subtask.startswith("t") else None
        if current is not None and current.isdigit() and int(current) in pending:
            order.append(int(current))  # keep going where the robot already is
        here = pending[order[0]] if order else (float(position[0]), float(position[1]))
        while len(order) < min(self.max_steps, len(pending)):
            # nearest next; ties by the smaller id, so the plan is deterministic
            nxt = min((i for i in pending if i not in order), key=lambda i: (math.dist(here, pending[i]), i))
            order.append(nxt)
            here = pending[nxt]
        steps = [PlanStep(skill="goto", target=f"t{i}", goal=[pending[i][0], pending[i][1]]) for i in order]
        return validate_plan(PlanDocument(steps=steps, note=f"{len(pending)} targets pending, nearest first").model_dump(),
                             self.max_steps)

    async def plan(self, request: PlanInput, deadline: float) -> PlanResult:
        return PlanResult(self.tour(request))
