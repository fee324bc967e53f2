"""The action filter: every command passes through it before it leaves for the actuators.

Given the command state (last command and its velocity) and a proposed next position, the
filter either passes the proposal unchanged, clamps it to the nearest command that keeps every
limit (and keeps the state able to brake inside the bounds), or rejects it. Non-finite
proposals (NaN, +-inf) are always rejected: there is no meaningful nearest safe value.

The per-tick path allocates one array (the command) and runs about fifteen small numpy
operations when the proposal is already safe; the clamp path is only taken on intervention.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from .exceptions import ActionShapeError
from .limits import LimitKind, Limits, MotionState

count_nonzero = np.count_nonzero
_F64 = np.dtype(np.float64)
#: action dimensions up to which the filter's per-tick pass check runs on Python floats
SMALL_DIM = 24

__all__ = ["FilterMode", "Verdict", "InterventionCounts", "FilterResult", "SafetyFilter"]


class FilterMode(str, enum.Enum):
    """What the filter does with a finite proposal that would break a limit.

    ``clamp`` sends the nearest safe command instead (smooth, keeps the policy in charge; the
    usual choice). ``reject`` sends nothing from the policy: the watchdog runs the fallback
    for that tick (strict; use it when a policy that asks for something out of limits should
    not be trusted at all).
    """

    CLAMP = "clamp"
    REJECT = "reject"


class Verdict(str, enum.Enum):
    """What the filter did with one proposal."""

    PASSED = "passed"
    CLAMPED = "clamped"
    REJECTED = "rejected"


@dataclasses.dataclass
class InterventionCounts:
    """Counters of every filter decision (mutable, updated in place).

    Args:
        checked: proposals seen.
        passed: sent unchanged.
        clamped: changed to the nearest safe command.
        rejected: refused (non-finite, or out of limits in ``reject`` mode).
        nonfinite: proposals with NaN or infinity (also counted in ``rejected``).
        position: interventions where a position bound (or braking room before it) bound.
        velocity: interventions where the velocity limit bound.
        acceleration: interventions where the acceleration limit bound.
    """

    checked: int = 0
    passed: int = 0
    clamped: int = 0
    rejected: int = 0
    nonfinite: int = 0
    position: int = 0
    velocity: int = 0
    acceleration: int = 0

    @property
    def interventions(self) -> int:
        """Proposals not passed unchanged."""
        return self.clamped + self.rejected

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for logs and metrics)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class FilterResult:
    """The outcome of :meth:`SafetyFilter.check` (the allocation-light :meth:`SafetyFilter.apply` returns a tuple).

    Args:
        command: the command to send, or ``None`` when rejected.
        verdict: what the filter did.
        limits_hit: which limits bound, when it intervened.
    """

    command: np.ndarray | None
    verdict: Verdict
    limits_hit: tuple[LimitKind, ...] = ()


class SafetyFilter:
    """Checks proposals against :class:`Limits` and clamps or rejects them.

    Args:
        limits: the limits to enforce.
        mode: what to do with an out-of-limits finite proposal (:class:`FilterMode`).
    """

    def __init__(self, limits: Limits, mode: FilterMode | str = FilterMode.CLAMP) -> None:
        self.limits = limits
        self.mode = FilterMode(mode)
        self.counts = InterventionCounts()
        a = limits.action_dim
        self._dt = limits.dt
        self._inv_dt = 1.0 / limits.dt
        self._dv = limits.dv
        self._vmax = limits.max_velocity
        self._neg_vmax = -limits.max_velocity
        # Positions from which even full speed leaves room to brake before either bound: the
        # viability constraint cannot bind there, so the per-tick path skips computing it.
        margin = limits.max_velocity * limits.dt + limits.stopping_distance(limits.max_velocity)
        self._lo_safe = limits.lower + margin
        self._up_safe = limits.upper - margin
        self._n = a
        self._vt = np.empty(a)
        self._lo = np.empty(a)
        self._hi = np.empty(a)
        self._step = limits.max_velocity * limits.dt * (1.0 + 1e-9)
        # Up to SMALL_DIM dimensions the per-tick pass check runs on Python floats: a dozen numpy
        # calls on arrays this short cost more in call overhead than the arithmetic itself.
        self._small = (a,) if a <= SMALL_DIM else None
        self._dv_vmax = list(zip(self._dv.tolist(), self._vmax.tolist(), strict=True))
        self._last_cmd: np.ndarray | None = None
        self._interior_ticks = 0
        #: velocity of the last command returned, relative to the state it was filtered from
        #: (``(command - position) / dt``); a new array per call, safe to keep.
        self.velocity = np.zeros(a)

    def _interior_for(self, q: np.ndarray) -> bool:
        """Whether the braking-room (viability) constraint cannot bind at ``q``.

        Every command the filter returns moves each joint by at most ``max_velocity * dt``, so
        when ``q`` is the filter's own last command, the distance to the zone where that
        constraint can bind tells for how many ticks the check can be skipped. Any other
        state gets the full check.
        """
        if q is self._last_cmd and self._interior_ticks > 0:
            self._interior_ticks -= 1
            return True
        margin = np.minimum(q - self._lo_safe, self._up_safe - q)
        if not (margin >= 0).all():
            self._interior_ticks = 0
            return False
        ticks = float((margin / self._step).min())
        self._interior_ticks = int(min(ticks, 1e9)) - 1
        return True

    def _passes_small(self, target: np.ndarray, q: np.ndarray, v: np.ndarray) -> list[float] | None:
        """The velocities of a ``target`` within the velocity and acceleration window from
        ``(q, v)`` (the braking-room constraint cannot bind: ``q`` is interior), or ``None`` when
        one is outside it or not finite (the numpy path then decides, and classifies). The same
        float64 operations as the numpy path, so the same verdicts and velocities to the bit."""
        inv = self._inv_dt
        out = []
        for t, p, w, (dv, vmax) in zip(target.tolist(), q.tolist(), v.tolist(), self._dv_vmax, strict=True):
            x = (t - p) * inv
            # x >= max(w - dv, -vmax) and x <= min(w + dv, vmax), as two comparisons each: NaN
            # fails every comparison, so a non-finite target or state never passes here.
            if not (w - dv <= x <= w + dv and -vmax <= x <= vmax):
                return None
            out.append(x)
        return out

    def apply(self, target: np.ndarray, state: MotionState, *, clamp: bool | None = None) -> tuple[np.ndarray | None, Verdict]:
        """Filter one proposal. Hot path: called once per control tick.

        Args:
            target: the proposed next position ``[A]`` (any float dtype).
            state: the command state before this command (not modified).
            clamp: override the mode for this call (``True``: clamp, ``False``: reject);
                ``None`` uses :attr:`mode`. The watchdog clamps its own blend-in commands.

        Returns:
            ``(command, verdict)``: a read-only float64 array to send (``target`` itself when it
            already is one and passes), or ``None`` when rejected. :attr:`velocity` is set.
        """
        counts = self.counts
        counts.checked += 1
        q = state.position
        interior = self._interior_for(q)
        if interior and target.shape == self._small:
            passing = self._passes_small(target, q, state.velocity)
            if passing is not None:
                counts.passed += 1
                if target.flags.writeable or target.dtype != _F64:
                    target = np.array(target, dtype=np.float64)
                    target.flags.writeable = False
                self.velocity = np.array(passing)
                self._last_cmd = target
                return target, Verdict.PASSED
        vt = self._vt
        lo = self._lo
        hi = self._hi
        np.subtract(target, q, out=vt)
        vt *= self._inv_dt
        np.subtract(state.velocity, self._dv, out=lo)
        np.maximum(lo, self._neg_vmax, out=lo)
        np.add(state.velocity, self._dv, out=hi)
        np.minimum(hi, self._vmax, out=hi)
        if not interior:
            lim = self.limits
            np.minimum(hi, lim.viable_speed(lim.upper - q), out=hi)
            np.maximum(lo, -lim.viable_speed(q - lim.lower), out=lo)
        n = self._n
        # count_nonzero is several times cheaper than ndarray.all() on small arrays, and NaN
        # fails both comparisons, so a non-finite proposal never takes this branch.
        if count_nonzero(vt >= lo) + count_nonzero(vt <= hi) == n + n:
            counts.passed += 1
            if target.flags.writeable or target.dtype != _F64:
                target = np.array(target, dtype=np.float64)
                target.flags.writeable = False
            self.velocity = vt
            self._vt = np.empty(n)
            self._last_cmd = target
            return target, Verdict.PASSED
        return self._intervene(target, state, clamp)

    def check(self, target: np.ndarray, state: MotionState, *, clamp: bool | None = None) -> FilterResult:
        """Like :meth:`apply`, but also says which limits bound (slower; for tests and tools)."""
        before = dataclasses.replace(self.counts)
        command, verdict = self.apply(target, state, clamp=clamp)
        hit = tuple(
            kind
            for kind, name in (
                (LimitKind.NONFINITE, "nonfinite"),
                (LimitKind.POSITION, "position"),
                (LimitKind.VELOCITY, "velocity"),
                (LimitKind.ACCELERATION, "acceleration"),
            )
            if getattr(self.counts, name) > getattr(before, name)
        )
        return FilterResult(command, verdict, hit)

    def _intervene(self, target: np.ndarray, state: MotionState, clamp: bool | None) -> tuple[np.ndarray | None, Verdict]:
        counts = self.counts
        target = np.asarray(target, dtype=np.float64)
        if target.shape != (self._n,):
            raise ActionShapeError(f"action has shape {target.shape}, expected ({self._n},)")
        if not np.isfinite(target).all():
            counts.nonfinite += 1
            counts.rejected += 1
            return None, Verdict.REJECTED
        vt, lo, hi = self._vt, self._lo, self._hi
        lim = self.limits
        # Classify which limit bound (a proposal may break several).
        v = state.velocity
        if (np.abs(vt) > self._vmax * (1 + 1e-12)).any():
            counts.velocity += 1
        if (np.abs(vt - v) > self._dv * (1 + 1e-12)).any():
            counts.acceleration += 1
        room_hi = lim.viable_speed(lim.upper - state.position)
        room_lo = lim.viable_speed(state.position - lim.lower)
        # Count the braking-room constraint only where it is tighter than the other two.
        hi_other = np.minimum(v + self._dv, self._vmax)
        lo_other = np.maximum(v - self._dv, self._neg_vmax)
        if ((vt > room_hi) & (room_hi < hi_other)).any() or ((vt < -room_lo) & (-room_lo > lo_other)).any():
            counts.position += 1
        do_clamp = (self.mode is FilterMode.CLAMP) if clamp is None else clamp
        if not do_clamp:
            counts.rejected += 1
            return None, Verdict.REJECTED
        # lo > hi can only come from float round-off on a state at the edge of viability;
        # np.clip then returns hi (the viability side), the safer of the two.
        v_next = np.minimum(np.maximum(vt, lo), hi)
        command = state.position + v_next * self._dt
        np.clip(command, lim.lower, lim.upper, out=command)
        command.flags.writeable = False
        self.velocity = (command - state.position) * self._inv_dt
        self._last_cmd = command
        counts.clamped += 1
        return command, Verdict.CLAMPED
