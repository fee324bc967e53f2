"""Simulated robots on MuJoCo tasks (gymnasium's models, MuJoCo's physics), commanded by joint
position targets as a real arm's joint servos are.

Each :class:`Task` steps its own physics: per 10 ms physics step a PD servo with velocity
feed-forward turns the position command into torques within the control range; one command per
20 ms control period, ``None`` holding the last one as a servo does. Observations are a ``state``
vector and 224x224x3 uint8 images (rendered, or synthetic frames of the same size: a render costs
more than a control period on this CPU). Tasks: ``reach`` (Reacher's fingertip tracks a target on a
wobbling circle; success: within 2 cm in 90 % of the counted ticks), ``reach-jump`` (the same target
jumps), ``track7`` (Pusher's 7-joint hand over a moving marker, 3 cm). The counted window starts
after an acquisition time plus one nominal round trip, the same for every strategy."""

from __future__ import annotations

import abc
import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.policies.embedded.tasks import IMAGE_SHAPE, REACH_ACCEL_FIELD, TASK_DT, TASK_HORIZON, reach_fk
from chunkline.safety.limits import Limits

__all__ = [
    "CAMERA_MODES",
    "TaskOutcome",
    "FrameSource",
    "Task",
    "ReachTrackTask",
    "Track7Task",
    "TASKS",
    "make_task",
    "TaskUnavailable",
]

CAMERA_MODES = ("synthetic", "render")


class TaskUnavailable(RuntimeError):
    """The task cannot run here (gymnasium[mujoco] missing, or rendering impossible)."""


@dataclasses.dataclass
class TaskOutcome:
    """How one episode went.

    Args:
        success: whether the task's success criterion held.
        score: the task's continuous score (lower is better for both tasks: metres).
        details: task-specific figures (tracking fraction, final distance, ...).
    """

    success: bool
    score: float
    details: dict[str, float]


class FrameSource:
    """Camera frames: rendered by MuJoCo, or synthetic of the same shape.

    Synthetic frames come from a bank of random images (incompressible, like camera noise)
    cycled per call, so producing one costs a copy, not a random draw.

    Args:
        mode: ``"synthetic"`` or ``"render"``.
        seed: seed of the synthetic bank.
        bank: synthetic images kept.
    """

    def __init__(self, mode: str = "synthetic", seed: int = 0, bank: int = 4) -> None:
        if mode not in CAMERA_MODES:
            raise ValueError(f"camera must be one of {CAMERA_MODES}, got {mode!r}")
        self.mode = mode
        rng = np.random.default_rng(seed)
        self._bank = [rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8) for _ in range(bank if mode == "synthetic" else 0)]
        self._i = 0

    def synthetic(self) -> np.ndarray:
        """The next synthetic frame."""
        self._i += 1
        return self._bank[self._i % len(self._bank)]


def _gym_env(env_id: str, render: bool) -> Any:
    if render:
        os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; read when mujoco is imported
    try:
        import gymnasium
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TaskUnavailable("the closed-loop tasks need gymnasium[mujoco]: pip install 'chunkline[sim]'") from exc
    kwargs: dict[str, Any] = {"render_mode": "rgb_array", "width": IMAGE_SHAPE[1], "height": IMAGE_SHAPE[0]} if render else {}
    try:
        return gymnasium.make(env_id, **kwargs).unwrapped
    except Exception as exc:  # gymnasium raises several kinds for a missing mujoco
        raise TaskUnavailable(f"cannot build {env_id}: {type(exc).__name__}: {exc}") from exc


class Task(abc.ABC):
    """A simulated robot on a MuJoCo task, driven by joint position commands.

    Its attributes are the MuJoCo model and data, the target's motion and the episode's settings,
    which every simulated step reads.

    Args:
        camera: ``"synthetic"`` or ``"render"`` (see the module docstring).
        episode_s: episode length in seconds of simulated time.
    """

    name: str
    env_id: str
    action_dim: int
    #: PD gains per joint: torque units of the model's ``ctrl`` per rad and per rad/s.
    kp: np.ndarray
    kd: np.ndarray
    cameras: tuple[str, ...]
    default_episode_s: float
    #: the outcome: seconds to reach the target first, then the error (m) to stay within, for
    #: at least this fraction of the remaining ticks.
    acquire_s: float
    tolerance_m: float
    required_fraction: float
    #: added to ``acquire_s`` and to a scene change's grace: the link's nominal round trip, the
    #: earliest any strategy's first answer (to the start, to the change) can land. Without it
    #: the round trip itself is scored, the same for every strategy, whatever it does.
    reaction_allowance_s: float = 0.0

    def __init__(self, camera: str = "synthetic", episode_s: float | None = None) -> None:
        self.camera = camera
        self.frames = FrameSource(camera)
        self.env = _gym_env(self.env_id, camera == "render")
        self.model = self.env.model
        self.data = self.env.data
        self.period = TASK_DT
        self.horizon = TASK_HORIZON
        self.episode_s = float(episode_s if episode_s is not None else self.default_episode_s)
        self.substeps = int(round(self.period / self.model.opt.timestep))
        if self.substeps < 1 or not math.isclose(self.substeps * self.model.opt.timestep, self.period, rel_tol=1e-9):
            raise TaskUnavailable(f"control period {self.period} is not a multiple of the physics step")
        self.ctrl_lo = self.model.actuator_ctrlrange[:, 0].copy()
        self.ctrl_hi = self.model.actuator_ctrlrange[:, 1].copy()
        self.time = 0.0
        self.command = np.zeros(self.action_dim)
        self._cmd_vel = np.zeros(self.action_dim)
        self.ticks = 0
        self.errors: list[float] = []  # per tick, from the episode's start (see _record)

    # ------------------------------------------------------------------ the robot

    @abc.abstractmethod
    def limits(self) -> Limits:
        """The safety limits of this robot's joints (for one control period)."""

    @abc.abstractmethod
    def _reset(self, rng: np.random.Generator) -> None:
        """Task-specific reset (arm, target, puck), after gymnasium's reset."""

    @abc.abstractmethod
    def state(self) -> np.ndarray:
        """The ``state`` field of the observation (float32)."""

    @abc.abstractmethod
    def error(self) -> float:
        """The task's instantaneous error (m), for timelines and the outcome."""

    @abc.abstractmethod
    def _before_substep(self) -> None:
        """Hook run before every physics step (moves kinematic objects)."""

    def _record(self) -> None:
        """Per-tick bookkeeping for the outcome: the error after this tick."""
        self.errors.append(self.error())

    def outcome(self) -> TaskOutcome:
        """How the episode went so far: a success when, after ``acquire_s`` and the
        :attr:`reaction_allowance_s`, the error stayed within ``tolerance_m`` for at least
        ``required_fraction`` of the ticks. ``details["success_strict"]`` is the same test
        without the allowance."""
        out = self._outcome(self.reaction_allowance_s)
        strict = out if self.reaction_allowance_s == 0 else self._outcome(0.0)
        out.details["success_strict"] = strict.success
        return out

    def _outcome(self, allowance_s: float) -> TaskOutcome:
        start = int(round((self.acquire_s + allowance_s) / self.period))
        err = np.asarray(self.errors[start:])
        if err.size == 0:
            return TaskOutcome(False, math.nan, {"within_fraction": math.nan, "max_error_m": math.nan})
        within = float((err < self.tolerance_m).mean())
        return TaskOutcome(within >= self.required_fraction, float(err.mean()),
                           {"within_fraction": within, "max_error_m": float(err.max()),
                            "p90_error_m": float(np.percentile(err, 90))})

    def reset(self, seed: int) -> np.ndarray:
        """Start an episode; returns the arm's joint positions (the initial command).

        Args:
            seed: the episode's seed (gymnasium's randomisation and the task's own).
        """
        self.env.reset(seed=seed)
        self.reaction_allowance_s = 0.0  # the runner sets the link's round trip after the reset
        rng = np.random.default_rng([seed, 7919])
        self.time = 0.0
        self.ticks = 0
        self._reset(rng)
        self.command = self.joint_positions().copy()
        self._cmd_vel = np.zeros(self.action_dim)
        return self.command.copy()

    def joint_positions(self) -> np.ndarray:
        """The arm's joint positions."""
        return self.data.qpos[: self.action_dim].copy()

    def joint_velocities(self) -> np.ndarray:
        """The arm's joint velocities."""
        return self.data.qvel[: self.action_dim].copy()

    def observe(self) -> dict[str, Any]:
        """The observation as the robot sends it: ``state``, ``images/<camera>`` and the task's
        :meth:`extra_fields`."""
        obs: dict[str, Any] = {"state": self.state(), **self.extra_fields()}
        for cam in self.cameras:
            obs[f"images/{cam}"] = self.render() if self.camera == "render" else self.frames.synthetic()
        return obs

    def extra_fields(self) -> dict[str, np.ndarray]:
        """Observation fields besides ``state`` and the images (none by default)."""
        return {}

    def render(self) -> np.ndarray:
        """One rendered frame (224x224x3 uint8).

        Raises:
            TaskUnavailable: MuJoCo cannot render here.
        """
        try:
            img = self.env.render()
        except Exception as exc:  # OpenGL errors come in many types
            raise TaskUnavailable(f"MuJoCo cannot render here: {type(exc).__name__}: {exc}") from exc
        return np.ascontiguousarray(img, dtype=np.uint8)

    def step(self, command: np.ndarray | None, periods: int = 1) -> None:
        """Run ``periods`` control periods of physics with ``command`` as the joint targets.

        Args:
            command: the new joint position targets, or ``None`` to keep the last ones.
            periods: control periods to run (more than one when the control loop overran).
        """
        if command is not None:
            cmd = np.asarray(command, dtype=np.float64)
            if cmd.shape != (self.action_dim,):
                raise ValueError(f"command has shape {cmd.shape}, expected ({self.action_dim},)")
            if np.isfinite(cmd).all():
                # Velocity feed-forward from the command stream, as joint servos do.
                self._cmd_vel = (cmd - self.command) / self.period
                self.command = cmd.copy()
            # A non-finite command is ignored (the servo keeps its last valid target).
        else:
            self._cmd_vel = np.zeros(self.action_dim)
        for _ in range(max(1, periods)):
            for _ in range(self.substeps):
                self._before_substep()
                self.env.do_simulation(np.clip(self._servo(), self.ctrl_lo, self.ctrl_hi), 1)
                self.time += self.model.opt.timestep
            self.ticks += 1
            self._record()

    def _servo(self) -> np.ndarray:
        """The actuators' ``ctrl`` for this physics step: PD on the command, with velocity
        feed-forward (gains :attr:`kp`, :attr:`kd` in ``ctrl`` units)."""
        n = self.action_dim
        q = self.data.qpos[:n]
        qd = self.data.qvel[:n]
        return self.kp * (self.command - q) + self.kd * (self._cmd_vel - qd)

    @property
    def done(self) -> bool:
        """The episode's time is up."""
        return self.time >= self.episode_s - 1e-9

    def close(self) -> None:
        """Release the environment."""
        self.env.close()


class ReachTrackTask(Task):
    """Reacher tracking a moving target (see the module docstring).

    The target moves on a circle about the arena centre of radius ``r0 + a sin(w_r t)`` at
    angular rate ``w`` (random per episode), kinematically (it is not an obstacle). The state
    reports the target's position and velocity, as a perception stack would.
    """

    name = "reach"
    env_id = "Reacher-v5"
    action_dim = 2
    kp = np.array([1.2, 1.2])  # ctrl units; gear 200: 240 N m / rad
    kd = np.array([0.12, 0.12])
    cameras = ("cam_high",)
    default_episode_s = 6.0
    acquire_s = 1.5
    tolerance_m = 0.02
    required_fraction = 0.9

    def limits(self) -> Limits:
        # The shoulder turns without end stops; the elbow's range is +-3 rad in the model.
        return Limits(lower=np.array([-math.inf, -2.9]), upper=np.array([math.inf, 2.9]), max_velocity=np.full(2, 8.0),
                      max_acceleration=np.full(2, 60.0), dt=self.period)

    def _reset(self, rng: np.random.Generator) -> None:
        self.r0 = float(rng.uniform(0.10, 0.15))
        self.amp = float(rng.uniform(0.01, 0.03))
        self.w_r = float(rng.uniform(0.8, 1.6))
        speed = float(rng.uniform(0.25, 0.35))
        self.w = speed / self.r0 * (1.0 if rng.random() < 0.5 else -1.0)
        self.phase = float(rng.uniform(-math.pi, math.pi))
        self.errors = []
        self._move_target()
        import mujoco

        mujoco.mj_forward(self.model, self.data)

    def target(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """The target's position and velocity at episode time ``t``."""
        r = self.r0 + self.amp * math.sin(self.w_r * t)
        dr = self.amp * self.w_r * math.cos(self.w_r * t)
        a = self._phase_at(t) + self.w * t
        c, s = math.cos(a), math.sin(a)
        pos = np.array([r * c, r * s])
        vel = np.array([dr * c - r * self.w * s, dr * s + r * self.w * c])
        return pos, vel

    def target_acceleration(self, t: float) -> np.ndarray:
        """The target's acceleration at episode time ``t`` (radial: the wobble's less the
        centripetal; tangential: the Coriolis term of the wobble)."""
        r = self.r0 + self.amp * math.sin(self.w_r * t)
        dr = self.amp * self.w_r * math.cos(self.w_r * t)
        ddr = -self.amp * self.w_r * self.w_r * math.sin(self.w_r * t)
        a = self._phase_at(t) + self.w * t
        c, s = math.cos(a), math.sin(a)
        radial, tangential = ddr - r * self.w * self.w, 2.0 * dr * self.w
        return np.array([radial * c - tangential * s, radial * s + tangential * c])

    def extra_fields(self) -> dict[str, np.ndarray]:
        """The target's acceleration as the perception reports it (``target_accel``)."""
        return {REACH_ACCEL_FIELD: self.target_acceleration(self.time).astype(np.float32)}

    def _phase_at(self, t: float) -> float:
        """The target's angular phase at ``t`` (constant here; a jumping target changes it)."""
        return self.phase

    def _move_target(self) -> None:
        # The target's slide joints are qpos[2:4] (reacher.xml), measured from its body origin.
        pos, vel = self.target(self.time)
        self.data.qpos[2:4] = pos
        self.data.qvel[2:4] = vel

    def _before_substep(self) -> None:
        self._move_target()

    def fingertip(self) -> np.ndarray:
        """The fingertip's position in the arena plane."""
        return reach_fk(self.joint_positions())

    def state(self) -> np.ndarray:
        pos, vel = self.target(self.time)
        return np.concatenate([self.joint_positions(), self.joint_velocities(), pos, vel]).astype(np.float32)

    def error(self) -> float:
        pos, _ = self.target(self.time)
        return float(np.hypot(*(self.fingertip() - pos)))


class ReachJumpTask(ReachTrackTask):
    """Reacher tracking a target that, once per episode, jumps a quarter to a half turn round
    the arena (a bumped object, a re-detected goal). Chunks planned before the jump chase where
    the target was: a strategy that runs them late, or switches chunks with a jump, loses it.

    Success: as ``reach``, with the ``jump_grace_s`` after the jump left out of the count (the
    arm needs that long to get there, whatever the network). :attr:`scene_changes` tells the
    meter when the scene changed, for the reaction time.
    """

    name = "reach-jump"
    jump_at_s = 3.0
    jump_grace_s = 1.0

    @property
    def scene_changes(self) -> tuple[float, ...]:
        return (self.jump_at_s,)

    def _reset(self, rng: np.random.Generator) -> None:
        self.jump = float(rng.uniform(0.5, 1.0)) * math.pi * (1.0 if rng.random() < 0.5 else -1.0)
        super()._reset(rng)

    def _phase_at(self, t: float) -> float:
        return self.phase + (self.jump if t >= self.jump_at_s - 1e-9 else 0.0)

    def _outcome(self, allowance_s: float) -> TaskOutcome:
        start = int(round((self.acquire_s + allowance_s) / self.period))
        lo, hi = (int(round(x / self.period)) for x in (self.jump_at_s, self.jump_at_s + self.jump_grace_s + allowance_s))
        err = np.asarray(self.errors)
        keep = np.ones(err.size, dtype=bool)
        keep[:start] = False
        keep[lo:hi] = False
        counted = err[keep]
        if counted.size == 0:
            return TaskOutcome(False, math.nan, {"within_fraction": math.nan, "max_error_m": math.nan})
        within = float((counted < self.tolerance_m).mean())
        after = err[lo:]
        ok = np.flatnonzero(after < self.tolerance_m)
        return TaskOutcome(within >= self.required_fraction, float(counted.mean()),
                           {"within_fraction": within, "max_error_m": float(counted.max()),
                            "reacquired_s": float(ok[0] * self.period) if ok.size else math.nan})


class Track7Task(Task):
    """Pusher's 7-joint arm keeping its hand above a marker moving on the table (see the module
    docstring).

    The marker (pusher.xml's goal disc) moves kinematically on a circle of radius 5-8 cm at
    0.15-0.22 m/s around a point in the arm's reach; the state reports its position, velocity
    and acceleration, as a perception stack would. The puck is moved out of the way.
    """

    name = "track7"
    env_id = "Pusher-v5"
    action_dim = 7
    kp = np.full(7, 400.0)  # 1/s^2: a 20 rad/s servo bandwidth, critically damped
    kd = np.full(7, 40.0)
    cameras = ("cam_high", "cam_wrist")
    default_episode_s = 6.0
    acquire_s = 1.5
    tolerance_m = 0.03
    required_fraction = 0.9
    BASE = np.array([0.0, -0.6])  # the shoulder in the table plane (pusher.xml)
    #: the arm's posture at the start of an episode: the hand above the table's middle.
    READY = np.array([0.77, 0.64, -0.3, -1.06, 0.0, -0.5, 0.0])
    HOVER = 0.10  # the hand's goal: this far above the marker

    def limits(self) -> Limits:
        lo = self.model.jnt_range[:7, 0]
        hi = self.model.jnt_range[:7, 1]
        return Limits(lower=lo, upper=hi, max_velocity=np.full(7, 2.0), max_acceleration=np.full(7, 12.0), dt=self.period)

    def _servo(self) -> np.ndarray:
        # A computed-torque servo, as on industrial arms: the arm's own mass matrix and bias
        # forces (MuJoCo's) turn a PD acceleration into torques; gear 1, so ctrl = torque.
        import mujoco

        n = self.action_dim
        q, qd = self.data.qpos[:n], self.data.qvel[:n]
        full = np.zeros((self.model.nv, self.model.nv))
        mujoco.mj_fullM(self.model, self.data, full)
        acc = self.kp * (self.command - q) + self.kd * (self._cmd_vel - qd)
        return full[:n, :n] @ acc + self.data.qfrc_bias[:n] - self.data.qfrc_passive[:n]

    def _reset(self, rng: np.random.Generator) -> None:
        self._goal_id = self.model.body("goal").id
        self._tip_id = self.model.body("tips_arm").id
        self._home = self.model.body_pos[self._goal_id][:2].copy()  # where pusher.xml puts the marker
        # The circle's centre 60 cm from the shoulder towards the marker's home: the hand's
        # comfortable reach (the elbow straightens at about 75 cm).
        toward = (self._home - self.BASE) / np.linalg.norm(self._home - self.BASE)
        self.centre = self.BASE + 0.6 * toward + rng.uniform(-0.03, 0.03, 2)
        self.radius = float(rng.uniform(0.05, 0.08))
        self.w = float(rng.uniform(0.15, 0.22)) / self.radius * (1.0 if rng.random() < 0.5 else -1.0)
        self.phase = float(rng.uniform(-math.pi, math.pi))
        qpos = self.data.qpos.copy()
        qvel = np.zeros_like(self.data.qvel)
        qpos[:7] = self.READY
        qpos[-4], qpos[-3] = 0.6, 0.6  # the puck: off to the side, out of the way
        self.env.set_state(qpos, qvel)
        self._move_marker()
        import mujoco

        mujoco.mj_forward(self.model, self.data)
        self.errors = []

    def marker(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The marker's position, velocity and acceleration (table plane) at episode time ``t``."""
        a = self.phase + self.w * t
        c, s = math.cos(a), math.sin(a)
        r, w = self.radius, self.w
        pos = self.centre + r * np.array([c, s])
        vel = r * w * np.array([-s, c])
        acc = -r * w * w * np.array([c, s])
        return pos, vel, acc

    def _move_marker(self) -> None:
        # The marker's slide joints are the last two (goal_slidey, goal_slidex), from its body origin.
        pos, vel, _ = self.marker(self.time)
        off = pos - self._home
        self.data.qpos[-2], self.data.qpos[-1] = off[1], off[0]
        self.data.qvel[-2], self.data.qvel[-1] = vel[1], vel[0]

    def _before_substep(self) -> None:
        self._move_marker()

    def _marker_height(self) -> float:
        return float(self.data.xpos[self._goal_id][2])

    def hand(self) -> np.ndarray:
        """The hand point (``tips_arm``) in world coordinates."""
        return self.data.xpos[self._tip_id].copy()

    def state(self) -> np.ndarray:
        pos, vel, acc = self.marker(self.time)
        z = self._marker_height()
        return np.concatenate([self.joint_positions(), self.joint_velocities(), self.hand(), [pos[0], pos[1], z],
                               [vel[0], vel[1], 0.0], [acc[0], acc[1], 0.0]]).astype(np.float32)

    def error(self) -> float:
        pos, _, _ = self.marker(self.time)
        goal = np.array([pos[0], pos[1], self._marker_height() + self.HOVER])
        return float(np.linalg.norm(self.hand() - goal))


TASKS: Mapping[str, type[Task]] = {"reach": ReachTrackTask, "track7": Track7Task, "reach-jump": ReachJumpTask}


def make_task(name: str, *, camera: str = "synthetic", episode_s: float | None = None) -> Task:
    """Build the task ``name`` (``reach``, ``track7`` or ``reach-jump``).

    Args:
        name: the task.
        camera: ``"synthetic"`` or ``"render"``.
        episode_s: episode length (default: the task's).

    Raises:
        KeyError: unknown task.
        TaskUnavailable: gymnasium[mujoco] is missing, or rendering impossible.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](camera=camera, episode_s=episode_s)
