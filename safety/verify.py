"""Start-up verification of fallback behaviours by simulation from worst-case states.

A fallback is only useful if it is safe from whatever viable state the robot is in when it takes
over, so each behaviour is simulated from the extreme viable states (every joint at a bound, the
centre or where braking room is tightest, at the fastest viable speed towards or away from a bound,
or at rest; neighbours moving in opposite directions; seeded random viable states) for long enough
to stop and travel the whole range. Every command is checked against the limits, and a behaviour
that claims to settle must have settled; the first failure raises :class:`FallbackVerificationError`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .exceptions import FallbackVerificationError
from .fallback import FallbackBehaviour, SafePoseBehaviour
from .limits import Limits, MotionState

__all__ = ["VerificationReport", "worst_case_states", "default_horizon", "verify_fallback"]


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    """What verification simulated.

    Args:
        behaviour: the behaviour's name.
        states: how many start states were simulated.
        steps: periods simulated from each.
        settled: whether the behaviour claimed to settle (and did, from every state).
    """

    behaviour: str
    states: int
    steps: int
    settled: bool


def _anchor_span(limits: Limits) -> tuple[np.ndarray, np.ndarray]:
    # Finite stand-ins for infinite bounds: far enough that a full-speed stop fits several times.
    reach = 4.0 * (limits.max_velocity * limits.dt + limits.stopping_distance(limits.max_velocity))
    lo = np.where(np.isfinite(limits.lower), limits.lower, np.where(np.isfinite(limits.upper), limits.upper - 2 * reach, -reach))
    hi = np.where(np.isfinite(limits.upper), limits.upper, lo + 2 * reach)
    return lo, hi


def _fastest(limits: Limits, q: np.ndarray, direction: float) -> np.ndarray:
    """The fastest viable velocity at ``q`` in ``direction`` (+1 towards upper, -1 towards lower)."""
    room = (limits.upper - q) if direction > 0 else (q - limits.lower)
    # The state (q, v) is viable when stopping_distance(v) <= room: v = sqrt(2 a room).
    speed = np.minimum(limits.max_velocity, np.sqrt(2.0 * limits.max_acceleration * np.maximum(room, 0.0)))
    velocity: np.ndarray = direction * speed
    return velocity


def worst_case_states(limits: Limits, n_random: int = 32, seed: int = 0) -> list[MotionState]:
    """Extreme viable command states for the given limits (see the module docstring).

    Args:
        limits: the limits.
        n_random: how many seeded random viable states to add.
        seed: the random seed (verification is deterministic).
    """
    lo, hi = _anchor_span(limits)
    mid = 0.5 * (lo + hi)
    vmax = limits.max_velocity
    # Where a joint at full speed towards a bound must start braking to stop exactly on it.
    brake_up = np.maximum(hi - limits.stopping_distance(vmax), mid)
    brake_lo = np.minimum(lo + limits.stopping_distance(vmax), mid)
    states: list[MotionState] = []

    def add(q: np.ndarray, v: np.ndarray) -> None:
        states.append(MotionState(np.array(q, dtype=np.float64), np.array(v, dtype=np.float64)))

    for q in (lo, hi, mid, brake_up, brake_lo):
        add(q, np.zeros_like(q))
        add(q, _fastest(limits, q, +1.0))
        add(q, _fastest(limits, q, -1.0))
    alt = np.where(np.arange(limits.action_dim) % 2 == 0, 1.0, -1.0)
    q_alt = np.where(alt > 0, brake_up, brake_lo)
    add(q_alt, np.where(alt > 0, _fastest(limits, q_alt, +1.0), _fastest(limits, q_alt, -1.0)))
    add(q_alt, np.where(alt > 0, _fastest(limits, q_alt, -1.0), _fastest(limits, q_alt, +1.0)))
    q_flip = np.where(alt > 0, lo, hi)
    add(q_flip, np.where(alt > 0, _fastest(limits, q_flip, +1.0), _fastest(limits, q_flip, -1.0)))
    rng = np.random.default_rng(seed)
    for _ in range(n_random):
        q = rng.uniform(lo, hi)
        v_hi = _fastest(limits, q, +1.0)
        v_lo = _fastest(limits, q, -1.0)
        add(q, rng.uniform(v_lo, v_hi))
    return states


def default_horizon(limits: Limits, behaviour: FallbackBehaviour) -> int:
    """Periods enough to brake from full speed and, for a safe pose, cross the whole range."""
    stop = float(np.max(limits.max_velocity / limits.dv))
    steps = 2 * math.ceil(stop) + 10
    if isinstance(behaviour, SafePoseBehaviour):
        lo, hi = _anchor_span(limits)
        # From the farthest start state to the pose (after braking, which travel_time allows for).
        far = np.maximum(np.abs(hi - behaviour.pose), np.abs(behaviour.pose - lo))
        travel = float(np.max(far / behaviour.max_speed)) / limits.dt
        accel = float(np.max(behaviour.max_speed / limits.dv))
        steps += math.ceil(travel) + 2 * math.ceil(accel) + 20
    return steps


def verify_fallback(
    behaviour: FallbackBehaviour,
    limits: Limits,
    *,
    steps: int | None = None,
    n_random: int = 32,
    seed: int = 0,
    require_settle: bool | None = None,
) -> VerificationReport:
    """Simulate ``behaviour`` from every worst-case state and refuse it if any command breaks a limit.

    Args:
        behaviour: the behaviour to verify (its internal state is reset per start state).
        limits: the limits it must keep.
        steps: periods per start state; ``None`` for :func:`default_horizon`.
        n_random: random viable start states on top of the extreme ones.
        seed: seed of those random states.
        require_settle: require :meth:`FallbackBehaviour.settled` to be true at the end;
            ``None`` requires it when the behaviour makes a claim (returns a bool).

    Raises:
        FallbackVerificationError: the first failing start state, step and limit.
    """
    horizon = default_horizon(limits, behaviour) if steps is None else int(steps)
    starts = worst_case_states(limits, n_random=n_random, seed=seed)
    if behaviour.supports_batch:
        passed, claim = _batch_passes(behaviour, limits, starts, horizon, require_settle)
        if passed:
            return VerificationReport(behaviour.name, len(starts), horizon, bool(claim))
    # One state at a time: the general path, and the one that names the failing state.
    all_settled = True
    for i, start in enumerate(starts):
        state = start.copy()
        behaviour.reset(state.copy())
        for k in range(horizon):
            try:
                command = np.asarray(behaviour.next_command(state.copy()), dtype=np.float64).reshape(-1)
            except Exception as exc:  # a user behaviour that raises is as unsafe as one that breaks a limit
                raise FallbackVerificationError(
                    behaviour.name, f"raised {type(exc).__name__}: {exc} from start state {i} at step {k}") from exc
            if command.shape != (limits.action_dim,):
                raise FallbackVerificationError(behaviour.name, f"returned shape {command.shape} at step {k}")
            if not limits.step_ok(state, command):
                violations = limits.step_violations(state, command)
                broken = violations[0] if violations else "round-off at the tolerance edge"
                raise FallbackVerificationError(
                    behaviour.name,
                    f"start state {i} (q={np.array2string(start.position, precision=4)}, "
                    f"v={np.array2string(start.velocity, precision=4)}), step {k}: {broken}",
                )
            state = state.advanced(command, limits.dt)
        claim = behaviour.settled(state)
        must = (claim is not None) if require_settle is None else require_settle
        if must and not claim:
            raise FallbackVerificationError(behaviour.name, f"did not settle within {horizon} steps from start state {i}")
        all_settled = all_settled and bool(claim)
    return VerificationReport(behaviour.name, len(starts), horizon, all_settled)


def _batch_passes(
    behaviour: FallbackBehaviour, limits: Limits, starts: list[MotionState], horizon: int, require_settle: bool | None
) -> tuple[bool, bool | None]:
    """Simulate every start state at once (rows of ``[S, A]`` arrays): (passed, settle claim)."""
    state = MotionState(np.stack([s.position for s in starts]), np.stack([s.velocity for s in starts]))
    behaviour.reset(state.copy())
    for _ in range(horizon):
        command = np.asarray(behaviour.next_command(state.copy()), dtype=np.float64)
        if not limits.step_ok(state, command):
            return False, None
        state = state.advanced(command, limits.dt)
    claim = behaviour.settled(state)
    must = (claim is not None) if require_settle is None else require_settle
    return not (must and not claim), claim
