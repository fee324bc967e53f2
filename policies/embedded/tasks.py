"""Scripted experts for the closed-loop MuJoCo tasks (:mod:`chunkline.bench.closedloop.tasks`),
served like any other policy; actions are joint position targets ``[50, A]`` at 20 ms.

* ``reach`` (Reacher, 2 joints): ``state`` is ``[q0, q1, qd0, qd1, tx, ty, tvx, tvy]``, the
  optional ``target_accel`` the target's acceleration. The expert predicts the target at each
  action's due time (``obs_time + k dt``), solves the inverse kinematics there, and shapes the
  joints within velocity and acceleration limits.
* ``track7`` (Pusher, 7 joints): the hand above a marker moving on the table; the expert predicts
  its circular motion and solves damped least squares on the MuJoCo model (imports ``mujoco``).

Both honour a real-time-chunking request: the chunk's frozen rows are the prefix's and the plan
continues from the last frozen row (position, velocity) instead of the observed state, with the
inverse-kinematics solution nearest to it, so a new chunk starts where the robot will be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..base import ArraySpec, FieldSpec, Policy, PolicySpec
from ..numpy_backend import NumpyPolicy
from ..prefix import PrefixBatch

__all__ = [
    "REACH_STATE_DIM",
    "REACH_ACCEL_FIELD",
    "TRACK7_STATE_DIM",
    "TASK_DT",
    "TASK_HORIZON",
    "IMAGE_SHAPE",
    "REACH_LINKS",
    "ReachPlanner",
    "Track7Planner",
    "reach_spec",
    "track7_spec",
    "reach_expert",
    "track7_expert",
    "reach_ik",
    "reach_fk",
    "pusher_model_path",
]

TASK_DT = 0.02  # 50 Hz, the control period of both tasks
TASK_HORIZON = 50  # one second of actions per chunk
IMAGE_SHAPE = (224, 224, 3)
REACH_STATE_DIM = 8
#: the reach task's optional observation field: the target's acceleration ``[ax, ay]``.
REACH_ACCEL_FIELD = "target_accel"
TRACK7_STATE_DIM = 26
#: Reacher's link lengths: shoulder to elbow, elbow to fingertip (reacher.xml).
REACH_LINKS = (0.1, 0.11)
# The planners stay below the robot's safety limits (bench/closedloop/tasks.py) so that the
# safety filter has nothing to clamp in normal operation: interventions then mean something.
_REACH_VMAX = np.array([6.0, 6.0])
_REACH_AMAX = np.array([40.0, 40.0])
_ARM7_VMAX = 1.6
_ARM7_AMAX = 10.0
#: the reach expert continuing a prefix: its acceleration leaves the prefix's at most this fast
#: (rad/s^3), and its velocity closes on the wanted one over _CONTINUE_TAU (s) rather than in
#: one step (real-time chunking's point: a chunk that continues what runs, without a kink).
_REACH_JERK = 400.0
_CONTINUE_TAU = 0.06


def reach_spec(*, cameras: tuple[str, ...] = ("cam_high",), horizon: int = TASK_HORIZON) -> PolicySpec:
    """The reach task's spec: ``state`` (8,) float32, one 224x224x3 uint8 image per camera and
    the optional ``target_accel`` (2,) float32.

    Args:
        cameras: camera names (fields ``images/<name>``).
        horizon: actions per chunk.
    """
    fields: dict[str, FieldSpec] = {f"images/{c}": ArraySpec(IMAGE_SHAPE, "uint8") for c in cameras}
    fields["state"] = ArraySpec((REACH_STATE_DIM,), "float32")
    fields[REACH_ACCEL_FIELD] = ArraySpec((2,), "float32", required=False)
    return PolicySpec(observation=fields, action_dim=2, horizon=horizon, dt=TASK_DT, default_deadline_ms=500.0)


def track7_spec(*, cameras: tuple[str, ...] = ("cam_high", "cam_wrist"), horizon: int = TASK_HORIZON) -> PolicySpec:
    """The track7 task's spec: ``state`` (26,) float32 and one 224x224x3 uint8 image per camera.

    Args:
        cameras: camera names (fields ``images/<name>``).
        horizon: actions per chunk.
    """
    fields: dict[str, FieldSpec] = {f"images/{c}": ArraySpec(IMAGE_SHAPE, "uint8") for c in cameras}
    fields["state"] = ArraySpec((TRACK7_STATE_DIM,), "float32")
    return PolicySpec(observation=fields, action_dim=7, horizon=horizon, dt=TASK_DT, default_deadline_ms=500.0)


# ---------------------------------------------------------------------------------------- reach


def reach_ik(point: np.ndarray, near: np.ndarray) -> np.ndarray:
    """Joint angles that put Reacher's fingertip at ``point`` (clamped into the reachable
    annulus), choosing the elbow branch and the shoulder's turn nearest to ``near``.

    Args:
        point: ``[2]`` fingertip position in the arena plane.
        near: ``[2]`` joint angles to stay close to (the shoulder is a continuous joint).
    """
    l1, l2 = REACH_LINKS
    x, y = float(point[0]), float(point[1])
    r = math.hypot(x, y)
    r = min(max(r, abs(l1 - l2) + 1e-3, 0.02), l1 + l2 - 1e-4)
    c2 = (r * r - l1 * l1 - l2 * l2) / (2 * l1 * l2)
    c2 = min(1.0, max(-1.0, c2))
    phi = math.atan2(y, x)
    best: tuple[float, float] | None = None
    best_d = math.inf
    for sign in (1.0, -1.0):
        q1 = sign * math.acos(c2)
        q0 = phi - math.atan2(l2 * math.sin(q1), l1 + l2 * math.cos(q1))
        q0 += 2 * math.pi * round((near[0] - q0) / (2 * math.pi))  # the turn nearest the shoulder now
        d = (q0 - near[0]) ** 2 + (q1 - near[1]) ** 2
        if d < best_d:
            best, best_d = (q0, q1), d
    assert best is not None
    return np.array(best)


def reach_fk(q: np.ndarray) -> np.ndarray:
    """Reacher's fingertip position for joint angles ``q`` (``[..., 2]`` -> ``[..., 2]``)."""
    l1, l2 = REACH_LINKS
    q = np.asarray(q, dtype=np.float64)
    a, b = q[..., 0], q[..., 0] + q[..., 1]
    return np.stack([l1 * np.cos(a) + l2 * np.cos(b), l1 * np.sin(a) + l2 * np.sin(b)], axis=-1)


def _shape_trajectory(q: np.ndarray, v: np.ndarray, goals: np.ndarray, dt: float, vmax: np.ndarray,
                      amax: np.ndarray, gain: float, *, moving: bool = False, accel: np.ndarray | None = None,
                      jerk: float | None = None) -> np.ndarray:
    """Follow ``goals[k]`` (with their finite-difference velocity as feed-forward) from state
    ``(q, v)``: per step the velocity moves towards ``ff + gain * error`` by at most ``amax dt``
    and stays within ``vmax``. Row ``k`` is the position at ``k dt`` (row 0 is one step on).

    ``moving``: the start is a point on a running plan (a real-time-chunking prefix), so the
    first step has the goals' velocity as feed-forward too; without it the plan would brake
    at its first row and speed up again, a bump in acceleration right where the prefix ends.
    From a measured state the first step keeps none (the measured velocity
    rings around the command's).

    ``jerk`` (a plan continuing a running one, ``accel`` its acceleration there): the velocity
    closes on the wanted one over ``_CONTINUE_TAU`` rather than in one step, and step ``k``'s
    acceleration stays within ``jerk * dt * (k + 1)`` of ``accel``: the plan leaves the running
    one's acceleration gradually (a ramp, not a rate limit inside the loop: after
    ``2 amax / (jerk dt)`` steps it no longer binds, so it cannot make the loop ring)."""
    out = np.empty_like(goals)
    prev_goal = goals[0]
    pos, vel = q.astype(np.float64).copy(), v.astype(np.float64).copy()
    acc = np.zeros_like(pos) if accel is None else np.asarray(accel, dtype=np.float64).copy()
    first_ff = (goals[1] - goals[0]) / dt if moving and goals.shape[0] > 1 else np.zeros_like(pos)
    for k in range(goals.shape[0]):
        ff = (goals[k] - prev_goal) / dt if k else first_ff
        prev_goal = goals[k]
        want = np.clip(ff + gain * (goals[k] - pos), -vmax, vmax)
        if jerk is None:
            vel = np.clip(want, vel - amax * dt, vel + amax * dt)
        else:
            band = jerk * dt * (k + 1)
            step = np.clip((want - vel) * min(1.0, dt / _CONTINUE_TAU), -amax * dt, amax * dt)
            vel = np.clip(vel + np.clip(step, (acc - band) * dt, (acc + band) * dt), -vmax, vmax)
        pos = pos + vel * dt
        out[k] = pos
    return out


def _frozen_start(prefix: np.ndarray | None, delay: int, dt: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Where a plan honouring ``prefix[:delay]`` starts: the last frozen row, its velocity and
    its acceleration (from the last two and three rows; zero where there are fewer)."""
    if prefix is None or delay < 1:
        return None
    q = prefix[delay - 1].astype(np.float64)
    v = (q - prefix[delay - 2]) / dt if delay >= 2 else np.zeros_like(q)
    a = (v - (prefix[delay - 2] - prefix[delay - 3]) / dt) / dt if delay >= 3 else np.zeros_like(q)
    return q, v, a


class _InpaintingExpert(NumpyPolicy):
    """A scripted expert served with real-time chunking: rows below each item's delay are its
    prefix (``plan(state, prefix, delay)`` continues from them)."""

    accepts_prefix = True

    def __init__(self, name: str, planner: ReachPlanner | Track7Planner, spec: PolicySpec, settings: dict[str, Any]) -> None:
        super().__init__(name, planner, spec, settings={**settings, "inpaints_prefix": True})
        self._planner = planner

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Any) -> tuple[np.ndarray, Any]:
        rows = []
        accel = obs.get(REACH_ACCEL_FIELD)
        for b, state in enumerate(np.asarray(obs["state"])):
            delay = int(prefix.delay[b])
            given = bool(prefix.mask[b, :delay].all()) if delay else False
            extra = {} if accel is None else {"accel": np.asarray(accel[b])}
            rows.append(self._planner.plan(state, prefix.actions[b] if given else None, delay if given else 0, **extra))
        return np.stack(rows).astype(np.float32), states


class ReachPlanner:
    """The reach expert's planning, one observation at a time (numpy only).

    Args:
        horizon: actions per chunk.
        dt: seconds between actions.
        gain: how fast (1/s) the plan closes the distance to the predicted target.
    """

    def __init__(self, horizon: int = TASK_HORIZON, dt: float = TASK_DT, gain: float = 5.0,
                 wobble_rate: float = 1.2) -> None:
        self.horizon = horizon
        self.dt = dt
        self.gain = gain
        self.wobble_rate = wobble_rate

    def predict_target(self, state: np.ndarray, accel: np.ndarray | None = None) -> np.ndarray:
        """Where the target will be when action ``k`` is due, ``k dt`` after the observation,
        ``[H, 2]``: rotating about the arena centre at the observed angular rate. The radius
        moves on at the observed radial speed; given the target's acceleration (``accel``, not
        all zero: a batch's filler for a robot that sent none), it oscillates instead, at
        :attr:`wobble_rate` (rad/s), from the observed radial speed and acceleration: bounded
        however far ahead, exact when the wobble has that rate."""
        p = state[4:6].astype(np.float64)
        v = state[6:8].astype(np.float64)
        r = float(np.hypot(p[0], p[1]))
        t = np.arange(self.horizon) * self.dt
        if r < 1e-6:
            return p[None, :] + v[None, :] * t[:, None]
        omega = (p[0] * v[1] - p[1] * v[0]) / (r * r)
        vr = (p[0] * v[0] + p[1] * v[1]) / r
        ang = math.atan2(p[1], p[0]) + omega * t
        if accel is not None and np.any(accel) and np.isfinite(accel).all():
            # The radial acceleration is the measured one's radial part plus the centripetal r w^2.
            rdd = float((p[0] * accel[0] + p[1] * accel[1]) / r) + r * omega * omega
            w = self.wobble_rate
            rad = np.clip(r + vr * np.sin(w * t) / w + rdd * (1.0 - np.cos(w * t)) / (w * w), 0.0, None)
        else:
            rad = np.clip(r + vr * t, 0.0, None)
        return np.stack([rad * np.cos(ang), rad * np.sin(ang)], axis=1)

    def plan(self, state: np.ndarray, prefix: np.ndarray | None = None, delay: int = 0,
             accel: np.ndarray | None = None) -> np.ndarray:
        """The chunk ``[H, 2]`` for one observed ``state`` (8,) (and the target's ``accel``,
        when the robot sent it); with a ``prefix`` ([H, 2] on the chunk's grid), its first
        ``delay`` rows are kept and the plan continues from them."""
        state = np.asarray(state, dtype=np.float64)
        acc = None if accel is None else np.asarray(accel, dtype=np.float64)
        start = _frozen_start(prefix, delay, self.dt)
        if start is not None and prefix is not None:
            q, v, a = start
            targets = self.predict_target(state, acc)[delay:]
            goals = np.empty((targets.shape[0], 2))
            near = self._head_on(state, reach_ik(targets[0], q), q) if targets.shape[0] else q
            for k in range(targets.shape[0]):
                near = goals[k] = reach_ik(targets[k], near)
            rest = _shape_trajectory(q, v, goals, self.dt, _REACH_VMAX, _REACH_AMAX, self.gain, moving=True, accel=a,
                                     jerk=_REACH_JERK) if goals.size else goals
            return np.concatenate([prefix[:delay].astype(np.float64), rest])
        q, qd = state[0:2], state[2:4]
        targets = self.predict_target(state, acc)
        goals = np.empty((self.horizon, 2))
        near = self._head_on(state, reach_ik(targets[0], q), q)
        for k in range(self.horizon):
            near = goals[k] = reach_ik(targets[k], near)
        # Half the measured velocity: the servo's velocity rings a little around the command's,
        # and a plan that trusted it fully would feed that ringing back, chunk after chunk.
        return _shape_trajectory(q, 0.5 * qd, goals, self.dt, _REACH_VMAX, _REACH_AMAX, self.gain)

    @staticmethod
    def _head_on(state: np.ndarray, first: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The first goal's shoulder turn from ``q``: far round either way (the target jumped,
        or the arm starts far from it), which way is nearest flips with every observation of a
        moving target, and successive chunks would pull the arm both ways; chasing it from
        behind closes only at the arm's speed less the target's. Always meet the target head on
        (against its motion): a choice every chunk agrees on, with or without a prefix."""
        turn = first[0] - q[0]
        if abs(turn) > 2.0:
            p, v = state[4:6], state[6:8]
            omega = float(p[0] * v[1] - p[1] * v[0])
            if omega * turn > 0:
                first = first.copy()
                first[0] -= math.copysign(2 * math.pi, turn)
        return first

    def __call__(self, batch: Mapping[str, Any]) -> np.ndarray:
        states = np.asarray(batch["state"])
        accel = batch.get(REACH_ACCEL_FIELD)
        return np.stack([self.plan(s, accel=None if accel is None else np.asarray(accel[b]))
                         for b, s in enumerate(states)]).astype(np.float32)


def _horizon_steps(horizon: int, horizon_s: float | None) -> int:
    if horizon_s is None:
        return int(horizon)
    steps = int(round(float(horizon_s) / TASK_DT))
    if steps < 2:
        raise ValueError(f"horizon_s must cover at least two actions of {TASK_DT} s, got {horizon_s}")
    return steps


def reach_expert(horizon: int = TASK_HORIZON, *, horizon_s: float | None = None) -> Policy:
    """The reach task's scripted expert as a servable policy (numpy backend).

    Args:
        horizon: actions per chunk.
        horizon_s: the chunk's duration in seconds instead (``horizon_s / TASK_DT`` actions):
            ``chunkline serve --policy chunkline.policies.embedded.tasks:reach_expert
            --policy-arg horizon_s=2``.
    """
    horizon = _horizon_steps(horizon, horizon_s)
    planner = ReachPlanner(horizon)
    return _InpaintingExpert("reach-expert", planner, reach_spec(horizon=horizon),
                             {"planner": "reach", "gain": planner.gain, "wobble_rate": planner.wobble_rate, "vmax": _REACH_VMAX.tolist(),
                              "amax": _REACH_AMAX.tolist()})


# ---------------------------------------------------------------------------------------- track7


def pusher_model_path() -> str:
    """Path of gymnasium's ``pusher.xml`` (the MuJoCo model the task simulates).

    Raises:
        ImportError: gymnasium is not installed (``pip install 'gymnasium[mujoco]'``).
    """
    import os

    import gymnasium

    return os.path.join(os.path.dirname(gymnasium.__file__), "envs", "mujoco", "assets", "pusher.xml")


def _predict_circular(p: np.ndarray, v: np.ndarray, a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Positions at times ``t`` of a point moving on a circle (in the xy plane) given its
    position, velocity and acceleration now; straight on when it does not turn."""
    speed2 = float(v[0] ** 2 + v[1] ** 2)
    acc = float(np.hypot(a[0], a[1]))
    out = np.repeat(p[None, :].astype(np.float64), t.shape[0], axis=0)
    if speed2 < 1e-12:
        return out
    if acc * 1e3 < speed2:  # radius over 1 km: a straight line
        out[:, :2] += v[None, :2] * t[:, None]
        return out
    rho = speed2 / acc
    centre = p[:2] + a[:2] * (rho / acc)  # the acceleration points at the centre, |a| = v^2 / rho
    omega = math.copysign(math.sqrt(speed2) / rho, (p[0] - centre[0]) * v[1] - (p[1] - centre[1]) * v[0])
    ang = math.atan2(p[1] - centre[1], p[0] - centre[0]) + omega * t
    out[:, 0] = centre[0] + rho * np.cos(ang)
    out[:, 1] = centre[1] + rho * np.sin(ang)
    return out


class Track7Planner:
    """The 7-joint tracking expert: the hand follows a marker moving on the table.

    The marker's future positions at the actions' due times come from its observed position,
    velocity and acceleration (circular motion); the hand point (``tips_arm``) is placed
    ``HOVER`` above each, and each waypoint becomes joint targets by damped least squares on
    the MuJoCo model (with a pull towards a neutral posture in the null space).

    Args:
        horizon: actions per chunk.
        dt: seconds between actions.
    """

    #: the arm's posture the null space pulls towards.
    NEUTRAL = np.array([0.77, 0.64, -0.3, -1.06, 0.0, -0.5, 0.0])
    HOVER = 0.10  # the hand this far above the marker (the table is 2.5 cm under the marker's centre)

    def __init__(self, horizon: int = TASK_HORIZON, dt: float = TASK_DT, gain: float = 10.0) -> None:
        import mujoco

        self._mj = mujoco
        self.model = mujoco.MjModel.from_xml_path(pusher_model_path())
        self.data = mujoco.MjData(self.model)
        self.tip_id = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, "tips_arm")
        self.lower = self.model.jnt_range[:7, 0].copy()
        self.upper = self.model.jnt_range[:7, 1].copy()
        self.horizon = horizon
        self.dt = dt
        self.gain = gain
        self._jac = np.zeros((3, self.model.nv))

    def tip(self, q: np.ndarray) -> np.ndarray:
        """Forward kinematics of the hand point for arm joints ``q`` (7,)."""
        self.data.qpos[:7] = q
        self._mj.mj_kinematics(self.model, self.data)
        return np.array(self.data.xpos[self.tip_id], dtype=float)

    def ik_step(self, q: np.ndarray, goal: np.ndarray, iters: int = 3) -> np.ndarray:
        """A few damped least-squares steps moving the hand from ``q`` towards ``goal``."""
        q = q.copy()
        for _ in range(iters):
            self.data.qpos[:7] = q
            self._mj.mj_kinematics(self.model, self.data)
            self._mj.mj_comPos(self.model, self.data)
            pos = self.data.xpos[self.tip_id]
            err = goal - pos
            self._mj.mj_jac(self.model, self.data, self._jac, None, pos, self.tip_id)
            j = self._jac[:, :7]
            jjt = j @ j.T + 1e-4 * np.eye(3)
            dq = j.T @ np.linalg.solve(jjt, err)
            dq += (np.eye(7) - j.T @ np.linalg.solve(jjt, j)) @ (0.1 * (self.NEUTRAL - q))
            q = np.clip(q + dq, self.lower + 1e-3, self.upper - 1e-3)
        return q

    def waypoints(self, state: np.ndarray) -> np.ndarray:
        """The hand's path ``[H, 3]``: above the marker's predicted positions at ``k dt``."""
        marker, vel, acc = state[17:20], state[20:23], state[23:26]
        path = _predict_circular(marker.astype(np.float64), vel, acc, np.arange(self.horizon) * self.dt)
        path[:, 2] += self.HOVER
        return path

    def plan(self, state: np.ndarray, prefix: np.ndarray | None = None, delay: int = 0) -> np.ndarray:
        """The chunk ``[H, 7]`` for one observed ``state`` (26,); with a ``prefix`` ([H, 7] on the
        chunk's grid), its first ``delay`` rows are kept and the plan continues from them."""
        state = np.asarray(state, dtype=np.float64)
        start = _frozen_start(prefix, delay, self.dt)
        if start is not None and prefix is not None:
            q0, v0, _ = start
            path = self.waypoints(state)[delay:]
            goals = np.empty((path.shape[0], 7))
            cur = q0
            for k in range(path.shape[0]):
                cur = goals[k] = self.ik_step(cur, path[k], iters=6 if k == 0 else 2)
            rest = goals if not goals.size else _shape_trajectory(
                q0, v0, goals, self.dt, np.full(7, _ARM7_VMAX), np.full(7, _ARM7_AMAX), self.gain, moving=True)
            return np.concatenate([prefix[:delay].astype(np.float64), rest])
        q, qd = state[0:7], state[7:14]
        path = self.waypoints(state)
        goals = np.empty((self.horizon, 7))
        cur = q
        for k in range(self.horizon):
            cur = goals[k] = self.ik_step(cur, path[k], iters=6 if k == 0 else 2)
        return _shape_trajectory(q, qd, goals, self.dt, np.full(7, _ARM7_VMAX), np.full(7, _ARM7_AMAX), self.gain)

    def __call__(self, batch: Mapping[str, Any]) -> np.ndarray:
        states = np.asarray(batch["state"])
        return np.stack([self.plan(s) for s in states]).astype(np.float32)


def track7_expert(horizon: int = TASK_HORIZON, *, horizon_s: float | None = None) -> Policy:
    """The track7 task's scripted expert as a servable policy (numpy backend; imports mujoco).

    Args:
        horizon: actions per chunk.
        horizon_s: the chunk's duration in seconds instead (see :func:`reach_expert`).
    """
    horizon = _horizon_steps(horizon, horizon_s)
    planner = Track7Planner(horizon)
    return _InpaintingExpert("track7-expert", planner, track7_spec(horizon=horizon),
                             {"planner": "track7", "gain": planner.gain, "vmax": _ARM7_VMAX, "amax": _ARM7_AMAX})
