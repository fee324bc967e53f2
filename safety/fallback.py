"""Fallback behaviours: what the robot does when no valid policy action is due.

A behaviour produces one position command per control period from the command state. The
built-in ones keep every limit by construction from any viable state (and are verified by
simulation at start-up anyway, see :mod:`chunkline.safety.verify`):

* :class:`HoldBehaviour` - brake each joint at full deceleration to zero velocity, then hold.
  The default: the shortest safe stop, no motion towards anything.
* :class:`SafePoseBehaviour` - brake, then move to a configured pose at a limited speed and
  hold there (e.g. a retracted arm, a gripper open above the table).
* :class:`CallableBehaviour` - a user-supplied function; verification is what makes it safe
  to use, so it is refused at start-up if it breaks a limit from any worst-case state.

Without limits (``limits=None``) :class:`HoldBehaviour` repeats the last command.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np

from .exceptions import ActionShapeError, LimitsError
from .limits import ArrayLike, Limits, MotionState

__all__ = ["FallbackBehaviour", "HoldBehaviour", "SafePoseBehaviour", "CallableBehaviour"]


class FallbackBehaviour(abc.ABC):
    """A behaviour the watchdog runs when no valid action is due.

    Subclasses implement :meth:`next_command`; :meth:`reset` is called each time the fallback
    takes over. Behaviours may keep internal state between calls (reset clears it).

    Attributes:
        name: a short name for logs and verification reports.
    """

    name: str = "fallback"
    #: ``next_command`` and ``settled`` also work on batches of states (``[S, A]`` arrays, one
    #: row per state); verification then simulates all start states at once.
    supports_batch: bool = False

    def reset(self, state: MotionState) -> None:  # noqa: B027 - an optional hook: doing nothing is the right default
        """Called when the fallback takes over, with the state at that moment. Default: nothing."""

    @abc.abstractmethod
    def next_command(self, state: MotionState) -> np.ndarray:
        """The next position command ``[A]`` given the command state."""

    def settled(self, state: MotionState) -> bool | None:
        """Whether the behaviour has reached its resting state; ``None`` if it claims none.

        Verification requires a behaviour that claims to settle to do so within its horizon.
        """
        return None


def _brake(velocity: np.ndarray, dv: np.ndarray) -> np.ndarray:
    # Move each velocity towards zero by at most dv, never past it.
    braked: np.ndarray = np.sign(velocity) * np.maximum(np.abs(velocity) - dv, 0.0)
    return braked


class HoldBehaviour(FallbackBehaviour):
    """Decelerate every joint to zero velocity within the acceleration limit, then hold.

    From a viable state the braking commands never leave the position bounds (that is what
    viability means), never exceed the velocity limit (speed only drops) and change velocity by
    at most ``max_acceleration * dt`` per period.

    Args:
        limits: the limits to brake within; ``None`` holds the last command at once.
    """

    name = "hold"
    supports_batch = True

    def __init__(self, limits: Limits | None) -> None:
        self.limits = limits

    def next_command(self, state: MotionState) -> np.ndarray:
        if self.limits is None:
            held: np.ndarray = state.position.copy()
            return held
        lim = self.limits
        v_next = _brake(state.velocity, lim.dv)
        return np.clip(state.position + v_next * lim.dt, lim.lower, lim.upper)

    def settled(self, state: MotionState) -> bool | None:
        return bool((state.velocity == 0).all())


class SafePoseBehaviour(FallbackBehaviour):
    """Move to ``pose`` at no more than ``max_speed`` per joint, within the limits, then hold.

    Each joint follows the fastest approach that can still brake exactly at the target: the
    desired speed towards the target is ``min(max_speed, w)`` with ``w`` the viable speed for
    the remaining distance (:meth:`Limits.viable_speed`), and the velocity change per period is
    capped by the acceleration limit. A joint moving away from the pose first brakes.

    Args:
        limits: the limits to move within.
        pose: the safe pose ``[A]``, inside the position bounds.
        max_speed: per-joint speed cap (scalar or ``[A]``), at most ``limits.max_velocity``;
            ``None`` uses half the velocity limit.
        tolerance: distance to the pose counted as arrived (for :meth:`settled`).
    """

    name = "safe_pose"
    supports_batch = True

    def __init__(self, limits: Limits, pose: ArrayLike, max_speed: ArrayLike | None = None, tolerance: float = 1e-9) -> None:
        self.limits = limits
        p = np.array(pose, dtype=np.float64, copy=True).reshape(-1)
        if p.shape != (limits.action_dim,):
            raise ActionShapeError(f"pose has {p.shape[0]} entries, expected {limits.action_dim}")
        if not np.isfinite(p).all() or (p < limits.lower).any() or (p > limits.upper).any():
            raise LimitsError("the safe pose must be finite and inside the position bounds")
        speed = 0.5 * limits.max_velocity if max_speed is None else np.broadcast_to(np.asarray(max_speed, dtype=np.float64), p.shape).copy()
        if not (np.isfinite(speed).all() and (speed > 0).all()):
            raise LimitsError("max_speed must be finite and > 0")
        if (speed > limits.max_velocity).any():
            raise LimitsError("max_speed may not exceed the velocity limit")
        p.setflags(write=False)
        self.pose = p
        self.max_speed = speed
        self.tolerance = float(tolerance)

    def next_command(self, state: MotionState) -> np.ndarray:
        lim = self.limits
        error = self.pose - state.position
        desired = np.sign(error) * np.minimum(self.max_speed, lim.viable_speed(np.abs(error)))
        v = state.velocity
        dv = lim.dv
        v_next = np.clip(desired, v - dv, v + dv)
        command: np.ndarray = np.clip(state.position + v_next * lim.dt, lim.lower, lim.upper)
        return command

    def settled(self, state: MotionState) -> bool | None:
        tol = self.tolerance * (1.0 + np.abs(self.pose))
        return bool((np.abs(state.position - self.pose) <= tol).all() and (np.abs(state.velocity) <= tol / self.limits.dt).all())


class CallableBehaviour(FallbackBehaviour):
    """A user-supplied behaviour: ``fn(state, step) -> next command``.

    ``step`` counts periods since the fallback took over (0 on the first call). The function
    must keep the limits from every viable state; start-up verification refuses it otherwise.

    Args:
        fn: the behaviour.
        name: its name in logs and reports.
        settled: optional ``settled(state) -> bool`` for verification to require settling.
    """

    def __init__(
        self,
        fn: Callable[[MotionState, int], ArrayLike],
        name: str = "user",
        settled: Callable[[MotionState], bool] | None = None,
    ) -> None:
        self._fn = fn
        self._settled = settled
        self.name = name
        self._step = 0

    def reset(self, state: MotionState) -> None:
        self._step = 0

    def next_command(self, state: MotionState) -> np.ndarray:
        out = np.array(self._fn(state, self._step), dtype=np.float64, copy=True).reshape(-1)
        self._step += 1
        return out

    def settled(self, state: MotionState) -> bool | None:
        return None if self._settled is None else bool(self._settled(state))
