"""The hierarchical closed-loop task: a remote planner chooses which target to visit next, a
local policy on the robot moves the arm there, on MuJoCo physics.

The robot is gymnasium's Reacher (2 joints, the same servo and safety limits as the ``reach``
task). An episode starts with :data:`START_TARGETS` targets in the arm's reach; a new one appears
at :data:`APPEAR_S` and one pending target jumps :data:`MOVE_M` at :data:`MOVE_S`. A target is
visited when the fingertip comes within :data:`REACH_TOL_M` of it *while the robot executes the
subtask that names it*. Success: every target visited before :data:`EPISODE_S`.

The planner is the server's embedded planner
(:class:`~chunkline.server.planner.planners.NearestTargetPlanner`, the same code ``chunkline
serve --planner`` runs) behind a simulated connection (:class:`SimulatedPlanner`): latency drawn
uniformly from a range (0.2-5 s), an outage window during which requests are never answered,
and a share of wrong plans (naming a target that does not exist) and of invalid ones (refused
``plan_invalid``). Time is simulated: a 5 s plan costs no wall time.

Two ways to use it (both see the same episodes, seed by seed):

* ``blocking``: ask for a plan whenever the current subtask is finished, and hold until it
  arrives (the naive integration: one plan at a time, nothing done while waiting);
* ``broker``: chunkline's plan broker (:class:`~chunkline.broker.plan_broker.PlanBrokerCore`):
  keeps executing the held plan's next steps while a fresh plan is requested, re-plans on scene
  changes and expiry, bounds the outage, and holds (its safe subtask) only when no valid plan
  step is left.

Every command passes the safety filter; each is then checked against the limits independently
(``limit_violations`` must be 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from chunkline.bench.closedloop.tasks import Task
from chunkline.broker.plan_broker import PlanBrokerConfig, PlanBrokerCore, PlanRequest, Subtask, Trigger
from chunkline.policies.embedded.tasks import reach_fk, reach_ik
from chunkline.safety.filter import SafetyFilter
from chunkline.safety.limits import Limits, MotionState
from chunkline.server.planner.planners import NearestTargetPlanner, PlanInput

__all__ = ["PlannerConditions", "SimulatedPlanner", "HierarchicalReachTask", "EpisodeFigures", "run_episode", "STRATEGIES"]

STRATEGIES = ("blocking", "broker")
START_TARGETS = 4
APPEAR_S = 3.0
MOVE_S = 6.0
MOVE_M = 0.06
REACH_TOL_M = 0.02
EPISODE_S = 60.0
VALID_FOR_S = 10.0
REQUEST_TIMEOUT_S = 6.0
_VMAX = np.array([6.0, 6.0])  # below the task's safety limits (8 rad/s, 60 rad/s^2)
_AMAX = np.array([40.0, 40.0])


@dataclasses.dataclass(frozen=True)
class PlannerConditions:
    """How the planner behaves in one condition.

    Args:
        name: for the table.
        latency_s: (low, high) of the uniform latency of each answer.
        outage: (start, end) episode seconds during which requests are never answered, or ``None``.
        wrong: share of plans whose first step names a target that does not exist.
        invalid: share of requests refused ``plan_invalid``.
    """

    name: str
    latency_s: tuple[float, float]
    outage: tuple[float, float] | None = None
    wrong: float = 0.0
    invalid: float = 0.0


class SimulatedPlanner:
    """The embedded planner behind a simulated connection (latency, outage, wrong and invalid plans)."""

    def __init__(self, conditions: PlannerConditions, seed: int) -> None:
        self.c = conditions
        self.rng = np.random.default_rng([seed, 4099])
        self.planner = NearestTargetPlanner("tour", max_steps=4)
        self.count = 0

    def request(self, now: float, request: PlanRequest, obs: dict[str, Any]) -> tuple[float, dict[str, Any] | None] | None:
        """When the answer arrives and what it is (``None`` for an error reply); ``None`` for never."""
        self.count += 1
        latency = float(self.rng.uniform(*self.c.latency_s))
        wrong, invalid = self.rng.random() < self.c.wrong, self.rng.random() < self.c.invalid
        if self.c.outage is not None and self.c.outage[0] <= now < self.c.outage[1]:
            return None
        if invalid:
            return now + latency, None
        doc = self.planner.tour(PlanInput(obs, obs_time=request.obs_time, subtask=request.subtask, plan_id=request.plan_id)).model_dump()
        if wrong:
            doc["steps"][0] = {"skill": "goto", "target": "t999", "goal": [0.0, 0.15]}
        return now + latency, {"plan_id": f"p{self.count}", "expires": request.obs_time + VALID_FOR_S, "plan": doc}


class HierarchicalReachTask(Task):
    """Reacher visiting targets (see the module docstring)."""

    name = "visit"
    env_id = "Reacher-v5"
    action_dim = 2
    kp = np.array([1.2, 1.2])
    kd = np.array([0.12, 0.12])
    cameras = ("cam_high",)
    default_episode_s = EPISODE_S
    acquire_s = 0.0
    tolerance_m = REACH_TOL_M
    required_fraction = 0.0

    def limits(self) -> Limits:
        return Limits(lower=np.array([-math.inf, -2.9]), upper=np.array([math.inf, 2.9]), max_velocity=np.full(2, 8.0),
                      max_acceleration=np.full(2, 60.0), dt=self.period)

    def _reset(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.targets: dict[int, np.ndarray] = {i: self._spot(rng) for i in range(START_TARGETS)}
        self.visited: list[int] = []
        self.appeared = self.moved = False
        self.errors = []
        import mujoco

        mujoco.mj_forward(self.model, self.data)

    @staticmethod
    def _spot(rng: np.random.Generator) -> np.ndarray:
        r, a = rng.uniform(0.09, 0.18), rng.uniform(-math.pi, math.pi)
        return np.array([r * math.cos(a), r * math.sin(a)])

    def _before_substep(self) -> None:
        if not self.appeared and self.time >= APPEAR_S:
            self.appeared = True
            self.targets[START_TARGETS] = self._spot(self.rng)
        if not self.moved and self.time >= MOVE_S and self.targets:
            self.moved = True
            k = sorted(self.targets)[-1]
            p = self.targets[k] + self.rng.normal(size=2) / math.sqrt(2) * MOVE_M
            r = float(np.clip(np.hypot(*p), 0.09, 0.18))
            self.targets[k] = p / np.hypot(*p) * r

    def fingertip(self) -> np.ndarray:
        return reach_fk(self.joint_positions())

    def state(self) -> np.ndarray:
        return np.concatenate([self.joint_positions(), self.joint_velocities()]).astype(np.float32)

    def error(self) -> float:
        return 0.0

    def planner_obs(self) -> dict[str, Any]:
        """What the robot sends the planner: the fingertip and the pending targets (id, x, y)."""
        rows = [(float(i), float(p[0]), float(p[1])) for i, p in sorted(self.targets.items())]
        return {"position": self.fingertip().astype(np.float32), "targets": np.array(rows, np.float32).reshape(-1, 3)}

    def scene(self) -> dict[str, tuple[float, float]]:
        return {f"t{i}": (float(p[0]), float(p[1])) for i, p in self.targets.items()}


class LocalPolicy:
    """The robot's own skill controller: ``goto`` shapes a joint trajectory to the target's inverse
    kinematics within velocity and acceleration limits; ``hold`` brakes to a stop."""

    def __init__(self, task: HierarchicalReachTask) -> None:
        self.task = task
        self.state = MotionState.at_rest(task.joint_positions())
        self.filter = SafetyFilter(task.limits())
        self.limits = task.limits()
        self.violations = 0

    def command(self, subtask: Subtask) -> np.ndarray:
        dt = self.task.period
        q, v = self.state.position, self.state.velocity
        if subtask.skill == "goto" and subtask.target is not None and int(subtask.target[1:]) in self.task.targets:
            goal = reach_ik(self.task.targets[int(subtask.target[1:])], q)
            want = np.clip(6.0 * (goal - q), -_VMAX, _VMAX)
        else:
            want = np.zeros(2)
        vel = np.clip(want, v - _AMAX * dt, v + _AMAX * dt)
        proposal = q + vel * dt
        cmd, _ = self.filter.apply(proposal, self.state)
        if cmd is None:
            cmd = q.copy()
        if not self.limits.step_ok(self.state, cmd):
            self.violations += 1
        self.state = self.state.advanced(np.asarray(cmd), dt)
        return np.asarray(cmd)


@dataclasses.dataclass
class EpisodeFigures:
    """One episode's figures."""

    strategy: str
    condition: str
    seed: int
    success: bool
    completion_s: float
    holding_s: float
    visited: int
    targets: int
    limit_violations: int
    plan_requests: int
    #: plan steps dropped because their target was already visited or does not exist (wrong plans)
    steps_skipped: int


def _target_of(subtask: Subtask) -> int | None:
    if subtask.skill != "goto" or subtask.target is None or not subtask.target[1:].isdigit():
        return None
    return int(subtask.target[1:])


def run_episode(strategy: str, conditions: PlannerConditions, seed: int) -> EpisodeFigures:
    """One episode of ``strategy`` under ``conditions`` (simulated time; seconds of wall time)."""
    task = HierarchicalReachTask()
    try:
        task.reset(seed)
        planner = SimulatedPlanner(conditions, seed)
        policy = LocalPolicy(task)
        core = PlanBrokerCore(PlanBrokerConfig(request_timeout_s=REQUEST_TIMEOUT_S, outage_bound_s=3.0, refresh_before_s=1.0,
                                               scene_threshold=0.03, retry_s=0.25))
        pending: list[tuple[float, int, dict[str, Any] | None]] = []  # (arrives, request id, reply or None for an error)
        blocking_subtask: Subtask | None = None
        blocking_wait: tuple[int, float] | None = None  # (request id, sent at)
        ids = iter(range(1, 1 << 30))
        holding_ticks = skipped = 0
        while not task.done and (task.targets or not task.appeared):
            now = task.time
            arrived = [p for p in pending if p[0] <= now]
            pending = [p for p in pending if p[0] > now]
            if strategy == "broker":
                for _, rid, reply in arrived:
                    if reply is None:
                        core.on_failure(rid, now)
                    else:
                        core.on_reply(rid, reply, now)
                decision = core.tick(now, task.scene())
                subtask = decision.subtask
                if decision.request is not None:
                    answer = planner.request(now, decision.request, task.planner_obs())
                    if answer is not None:
                        pending.append((answer[0], decision.request.request_id, answer[1]))
                target = _target_of(subtask)
                if target is not None and target not in task.targets:
                    core.reject_subtask(now)
                    skipped += 1
                    subtask = core.tick(now, task.scene()).subtask
            else:
                for _, rid, reply in arrived:
                    if blocking_wait is not None and rid == blocking_wait[0]:
                        blocking_wait = None
                        if reply is not None:
                            first = reply["plan"]["steps"][0]
                            blocking_subtask = Subtask(first["skill"], first["target"], None, reply["plan_id"], 0)
                if blocking_wait is not None and now >= blocking_wait[1] + REQUEST_TIMEOUT_S:
                    blocking_wait = None
                target = _target_of(blocking_subtask) if blocking_subtask is not None else None
                if blocking_subtask is not None and target is not None and target not in task.targets:
                    blocking_subtask, skipped = None, skipped + 1
                if blocking_subtask is not None and blocking_subtask.skill == "hold" and task.targets:
                    blocking_subtask = None  # a target appeared while holding: ask again
                if blocking_subtask is None and blocking_wait is None:
                    rid = next(ids)
                    req = PlanRequest(rid, Trigger.SUBTASK_DONE, now, REQUEST_TIMEOUT_S * 1000.0, None, None, None)
                    blocking_wait = (rid, now)
                    answer = planner.request(now, req, task.planner_obs())
                    if answer is not None:
                        pending.append((answer[0], rid, answer[1]))
                subtask = blocking_subtask if blocking_subtask is not None else Subtask("hold")
            if subtask.skill != "goto" and task.targets:
                holding_ticks += 1
            task.step(policy.command(subtask))
            target = _target_of(subtask)
            if target is not None and target in task.targets and np.hypot(*(task.fingertip() - task.targets[target])) < REACH_TOL_M:
                del task.targets[target]
                task.visited.append(target)
                if strategy == "broker":
                    core.subtask_done(task.time)
                else:
                    blocking_subtask = None
        success = not task.targets and task.appeared
        return EpisodeFigures(strategy, conditions.name, seed, success, task.time if success else math.nan,
                              holding_ticks * task.period, len(task.visited), START_TARGETS + 1, policy.violations, planner.count, skipped)
    finally:
        task.close()

