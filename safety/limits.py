"""Per-dimension motion limits for position-commanded actuators, and the checks that use them.

Actions are position targets sent once per period ``dt``; the *command state* is the last command
``q`` and its velocity ``v = (q - q_prev) / dt``. A next command ``q'`` is within the limits when it
is finite, ``lower <= q' <= upper``, ``|q' - q| / dt <= max_velocity`` and
``|(q' - q) / dt - v| / dt <= max_acceleration``. Bounds alone are not enough with a bounded
deceleration: a state is *viable* when braking at ``max_acceleration`` stops inside the bounds. The
filter and the fallbacks keep the state viable, which guarantees that a safe next command always
exists (:meth:`Limits.velocity_window`)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import numpy as np

from .exceptions import ActionShapeError, LimitsError, UnsafeStateError

__all__ = ["ArrayLike", "LimitKind", "Violation", "MotionState", "Limits"]

ArrayLike = float | Sequence[float] | np.ndarray


class LimitKind(str, enum.Enum):
    """Which limit a command broke (or the filter enforced). Stable strings, safe to count."""

    NONFINITE = "nonfinite"
    POSITION = "position"
    VELOCITY = "velocity"
    ACCELERATION = "acceleration"


@dataclasses.dataclass(frozen=True)
class Violation:
    """One limit broken by one command.

    Args:
        kind: the limit.
        dim: the action dimension.
        value: the offending position, velocity or acceleration.
        limit: the bound it broke.
    """

    kind: LimitKind
    dim: int
    value: float
    limit: float

    def __str__(self) -> str:
        return f"{self.kind.value} of dim {self.dim}: {self.value:.6g} beyond {self.limit:.6g}"


@dataclasses.dataclass(slots=True)
class MotionState:
    """The command state: the last command and its velocity.

    Args:
        position: the last command sent, ``[A]`` float64.
        velocity: ``(last - previous) / dt``, ``[A]`` float64; zero at start.
    """

    position: np.ndarray
    velocity: np.ndarray

    @classmethod
    def at_rest(cls, position: ArrayLike) -> MotionState:
        """A state holding still at ``position``."""
        q = np.array(position, dtype=np.float64, copy=True).reshape(-1)
        return cls(q, np.zeros_like(q))

    def advanced(self, command: np.ndarray, dt: float) -> MotionState:
        """The state after sending ``command`` one period ``dt`` after this state."""
        q = np.array(command, dtype=np.float64, copy=True)
        return MotionState(q, (q - self.position) / dt)

    def copy(self) -> MotionState:
        """An independent copy."""
        return MotionState(self.position.copy(), self.velocity.copy())


def _vector(name: str, value: ArrayLike, dim: int | None) -> np.ndarray:
    arr = np.array(value, dtype=np.float64, copy=True)
    if arr.ndim > 1:
        raise LimitsError(f"{name} must be a scalar or a 1-D sequence, got shape {arr.shape}")
    if arr.ndim == 0:
        if dim is None:
            raise LimitsError(f"{name} is a scalar but no dimension is known: give lower/upper as sequences")
        arr = np.full(dim, float(arr))
    if dim is not None and arr.shape[0] != dim:
        raise LimitsError(f"{name} has {arr.shape[0]} entries, expected {dim}")
    if np.isnan(arr).any():
        raise LimitsError(f"{name} contains NaN")
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class Limits:
    """Position bounds and velocity/acceleration limits per action dimension, for one control period.

    Scalars broadcast to every dimension; the dimension comes from the first non-scalar field.
    Validated at construction: ``lower < upper`` everywhere (bounds may be infinite for joints
    without end stops), velocity and acceleration limits finite and positive, ``dt`` positive.
    Arrays are stored read-only as float64.

    Args:
        lower: lowest allowed position per dimension.
        upper: highest allowed position per dimension.
        max_velocity: largest ``|q' - q| / dt`` per dimension.
        max_acceleration: largest change of that velocity per second, per dimension.
        dt: the control period, seconds.
    """

    lower: np.ndarray
    upper: np.ndarray
    max_velocity: np.ndarray
    max_acceleration: np.ndarray
    dt: float

    def __post_init__(self) -> None:
        dim: int | None = None
        for value in (self.lower, self.upper, self.max_velocity, self.max_acceleration):
            shape = np.shape(value)
            if len(shape) == 1:
                dim = shape[0]
                break
        if dim == 0:
            raise LimitsError("limits need at least one dimension")
        lower = _vector("lower", self.lower, dim)
        dim = lower.shape[0]
        upper = _vector("upper", self.upper, dim)
        vmax = _vector("max_velocity", self.max_velocity, dim)
        amax = _vector("max_acceleration", self.max_acceleration, dim)
        if not (lower < upper).all():
            bad = int(np.argmin(lower < upper))
            raise LimitsError(f"lower must be < upper: dim {bad} has [{lower[bad]}, {upper[bad]}]")
        if np.isposinf(lower).any() or np.isneginf(upper).any():
            raise LimitsError("lower may not be +inf and upper may not be -inf")
        for name, arr in (("max_velocity", vmax), ("max_acceleration", amax)):
            if not (np.isfinite(arr).all() and (arr > 0).all()):
                raise LimitsError(f"{name} must be finite and > 0 in every dimension")
        dt = float(self.dt)
        if not (math.isfinite(dt) and dt > 0):
            raise LimitsError(f"dt must be finite and > 0, got {self.dt}")
        object.__setattr__(self, "lower", lower)
        object.__setattr__(self, "upper", upper)
        object.__setattr__(self, "max_velocity", vmax)
        object.__setattr__(self, "max_acceleration", amax)
        object.__setattr__(self, "dt", dt)

    # ------------------------------------------------------------------ derived quantities

    @property
    def action_dim(self) -> int:
        """``A``, the number of dimensions."""
        return int(self.lower.shape[0])

    @property
    def dv(self) -> np.ndarray:
        """Largest velocity change in one period (``max_acceleration * dt``)."""
        return self.max_acceleration * self.dt

    def stopping_distance(self, velocity: ArrayLike) -> np.ndarray:
        """Distance covered while braking from ``velocity`` at full deceleration, ``v^2 / (2 a)``.

        This continuous-time figure is an upper bound of the discrete one (the distance the
        commands actually travel when the velocity drops by ``a * dt`` each period), so a state
        whose continuous stopping distance fits inside the bounds can always stop in time.
        """
        v = np.asarray(velocity, dtype=np.float64)
        return v * v / (2.0 * self.max_acceleration)

    def viable_speed(self, room: ArrayLike) -> np.ndarray:
        """Largest velocity ``w >= 0`` such that ``w * dt + stopping_distance(w) <= room``.

        ``room`` is the distance to the bound ahead (``upper - q`` or ``q - lower``). Solving
        ``w^2 / (2a) + w dt = room`` gives ``w = sqrt(dv^2 + 2 a room) - dv`` with ``dv = a dt``.
        Infinite room gives an infinite speed (the velocity limit then applies alone).
        """
        r = np.maximum(np.asarray(room, dtype=np.float64), 0.0)
        dv = self.dv
        speed: np.ndarray = np.sqrt(dv * dv + 2.0 * self.max_acceleration * r) - dv
        return speed

    def velocity_window(self, state: MotionState) -> tuple[np.ndarray, np.ndarray]:
        """The interval of next velocities that keeps every limit and the state viable.

        It is the intersection of the acceleration window ``[v - dv, v + dv]``, the velocity
        limit and the viability bounds towards both position bounds. From a viable state it is
        never empty: braking (``v`` moved towards zero by at most ``dv``) always lies inside it.
        """
        v = state.velocity
        dv = self.dv
        lo = np.maximum(v - dv, -self.max_velocity)
        hi = np.minimum(v + dv, self.max_velocity)
        hi = np.minimum(hi, self.viable_speed(self.upper - state.position))
        lo = np.maximum(lo, -self.viable_speed(state.position - self.lower))
        return lo, hi

    def is_viable(self, state: MotionState, rtol: float = 1e-9) -> bool:
        """Whether ``state`` is within the bounds and can still brake to a stop inside them."""
        q, v = state.position, state.velocity
        if not (np.isfinite(q).all() and np.isfinite(v).all()):
            return False
        tol = rtol * (1.0 + np.abs(q))
        if (q < self.lower - tol).any() or (q > self.upper + tol).any():
            return False
        if (np.abs(v) > self.max_velocity * (1 + rtol)).any():
            return False
        reach = np.where(v > 0, q + self.stopping_distance(v) - self.upper, self.lower - q + self.stopping_distance(v))
        return bool((reach <= tol).all())

    def check_state(self, state: MotionState) -> None:
        """Raise if ``state`` is not a viable state of these limits.

        Raises:
            ActionShapeError: the state has the wrong width.
            UnsafeStateError: out of bounds, too fast, or unable to stop inside the bounds.
        """
        if state.position.shape != (self.action_dim,) or state.velocity.shape != (self.action_dim,):
            raise ActionShapeError(f"state has shape {state.position.shape}, expected ({self.action_dim},)")
        if not self.is_viable(state):
            raise UnsafeStateError("state is outside the limits or cannot stop inside the position bounds")

    # ------------------------------------------------------------------ step checks

    def step_ok(self, state: MotionState, command: np.ndarray, rtol: float = 1e-6) -> bool:
        """Whether sending ``command`` after ``state`` keeps every limit (fast; same tolerances as
        :meth:`step_violations`, which says what broke). Also takes batches ``[S, A]`` of states
        and commands, and is then true when every row keeps the limits."""
        cmd = np.asarray(command, dtype=np.float64)
        if cmd.shape[-1:] != (self.action_dim,) or cmd.shape != state.position.shape:
            return False
        if not np.isfinite(cmd).all():
            return False  # also keeps an infinite value out of the tolerances below
        eps = 2.220446049250313e-16
        scale = 1.0 + np.abs(cmd) + np.abs(state.position)
        vel = (cmd - state.position) / self.dt
        acc = (vel - state.velocity) / self.dt
        # Written so that NaN fails every comparison.
        return bool(
            (cmd >= self.lower - rtol * scale).all()
            and (cmd <= self.upper + rtol * scale).all()
            and (np.abs(vel) <= self.max_velocity * (1 + rtol) + 8 * eps * scale / self.dt).all()
            and (np.abs(acc) <= self.max_acceleration * (1 + rtol) + 16 * eps * scale / (self.dt * self.dt)).all()
        )

    def step_violations(self, state: MotionState, command: np.ndarray, rtol: float = 1e-6) -> list[Violation]:
        """Every limit that sending ``command`` after ``state`` would break (empty when safe).

        Tolerances absorb float64 round-off only: ``rtol`` of each limit, plus the round-off of
        dividing position differences by ``dt`` (twice, for the acceleration).

        Args:
            state: the state before the command.
            command: the next position command ``[A]``.
            rtol: relative tolerance on each limit.
        """
        cmd = np.asarray(command, dtype=np.float64)
        if cmd.shape != (self.action_dim,):
            raise ActionShapeError(f"command has shape {cmd.shape}, expected ({self.action_dim},)")
        out: list[Violation] = []
        for d in np.flatnonzero(~np.isfinite(cmd)):
            out.append(Violation(LimitKind.NONFINITE, int(d), float(cmd[d]), math.nan))
        if out:
            return out
        eps = np.finfo(np.float64).eps
        scale = 1.0 + np.abs(cmd) + np.abs(state.position)
        pos_tol = rtol * scale
        for d in np.flatnonzero((cmd < self.lower - pos_tol) | (cmd > self.upper + pos_tol)):
            limit = self.lower[d] if cmd[d] < self.lower[d] else self.upper[d]
            out.append(Violation(LimitKind.POSITION, int(d), float(cmd[d]), float(limit)))
        vel = (cmd - state.position) / self.dt
        vel_tol = rtol * self.max_velocity + 8 * eps * scale / self.dt
        for d in np.flatnonzero(np.abs(vel) > self.max_velocity + vel_tol):
            out.append(Violation(LimitKind.VELOCITY, int(d), float(vel[d]), float(self.max_velocity[d])))
        acc = (vel - state.velocity) / self.dt
        acc_tol = rtol * self.max_acceleration + 16 * eps * scale / (self.dt * self.dt)
        for d in np.flatnonzero(np.abs(acc) > self.max_acceleration + acc_tol):
            out.append(Violation(LimitKind.ACCELERATION, int(d), float(acc[d]), float(self.max_acceleration[d])))
        return out

    def check_action_shape(self, action: np.ndarray) -> None:
        """Raise :class:`ActionShapeError` unless ``action`` is ``[A]``."""
        if np.shape(action) != (self.action_dim,):
            raise ActionShapeError(f"action has shape {np.shape(action)}, expected ({self.action_dim},)")
