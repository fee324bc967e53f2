"""The watchdog: one command per tick, from the policy when a valid action is due, else from the fallback.

States (:class:`Mode`): ``FALLBACK`` -> ``RESUMING`` (a fresh, finite, reachable proposal) ->
``POLICY`` (after ``resume_steps`` ticks on it); any tick without a valid proposal goes back to
``FALLBACK`` in that same tick, so the robot never waits a period without a command.
- Back to the policy only with a chunk that arrived after the fallback took over (the chunk that
  ran out, or held a NaN, is not trusted again), whose action is coverable in ``resume_steps``
  periods within the velocity and acceleration limits.
- ``RESUMING`` blends from the fallback's command to the proposal, then follows it clamped until
  the filter passes it unchanged: a chase after a plan that moved on is not counted as the policy's.
Starts in ``FALLBACK`` holding the initial position. Every command passes the filter, so the
emitted sequence always keeps the limits."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from .exceptions import ActionShapeError, UnsafeStateError, WatchdogConfigError
from .fallback import FallbackBehaviour, HoldBehaviour
from .filter import FilterMode, InterventionCounts, SafetyFilter, Verdict
from .limits import ArrayLike, Limits, MotionState
from .verify import VerificationReport, verify_fallback

__all__ = ["Mode", "FallbackReason", "WatchdogCounts", "Watchdog"]


class Mode(str, enum.Enum):
    """Where the command of a tick came from."""

    POLICY = "policy"
    RESUMING = "resuming"
    FALLBACK = "fallback"


class FallbackReason(str, enum.Enum):
    """Why no valid policy action was due (stable strings, safe to log and count).

    ``no_chunk``: no chunk covers this time (none received yet, or the next one starts later).
    ``stale``: the timeline ran dry: the latest action's due time passed by more than the tolerance.
    ``expired``: the action is past its chunk's ``expires``.
    ``server_error``: the last request failed and nothing valid is left.
    ``disconnected``: the connection is down and nothing valid is left.
    ``rejected``: the safety filter refused the action (non-finite, or out of limits in reject mode).
    ``unreachable``: in fallback, the policy's action is too far from the current command to hand
    back to it (see :meth:`Watchdog.reachable`): chunks arrive, but from somewhere else.
    """

    NO_CHUNK = "no_chunk"
    STALE = "stale"
    EXPIRED = "expired"
    SERVER_ERROR = "server_error"
    DISCONNECTED = "disconnected"
    REJECTED = "rejected"
    UNREACHABLE = "unreachable"


@dataclasses.dataclass
class WatchdogCounts:
    """Counters of the watchdog (mutable, updated in place).

    Args:
        ticks: commands emitted.
        policy_ticks / resuming_ticks / fallback_ticks: commands per mode.
        fallback_entries: switches to the fallback, and ``by_reason`` why.
        resumes: hand-backs to the policy started.
        resume_refused: ticks in fallback with a fresh proposal that was out of reach or non-finite.
        fallback_interventions: fallback commands the filter had to change (0 for verified behaviours).
    """

    ticks: int = 0
    policy_ticks: int = 0
    resuming_ticks: int = 0
    fallback_ticks: int = 0
    fallback_entries: int = 0
    resumes: int = 0
    resume_refused: int = 0
    fallback_interventions: int = 0
    by_reason: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """The counters as a plain dict."""
        return dataclasses.asdict(self)


class Watchdog:
    """Chooses, filters and emits one command per tick (sans-I/O: no clock, no threads).

    Args:
        limits: the limits every command keeps; ``None`` disables limit enforcement (commands
            pass unless non-finite; the fallback then holds the last command).
        initial_position: the actuators' position at start ``[A]`` (the first command state).
        fallback: the fallback behaviour; ``None`` for :class:`HoldBehaviour`.
        filter_mode: ``clamp`` or ``reject`` for out-of-limits policy actions.
        resume_steps: ticks of blending when handing back to the policy (>= 1); also sets how
            far a proposal may be from the current command to count as reachable.
        verify: verify the fallback at construction (:func:`verify_fallback`); leave on.

    Raises:
        FallbackVerificationError: the fallback broke a limit in start-up verification.
        UnsafeStateError: the initial position is outside the bounds (or not finite).
        WatchdogConfigError: ``resume_steps < 1``.
    """

    def __init__(
        self,
        limits: Limits | None,
        initial_position: ArrayLike,
        *,
        fallback: FallbackBehaviour | None = None,
        filter_mode: FilterMode | str = FilterMode.CLAMP,
        resume_steps: int = 10,
        verify: bool = True,
    ) -> None:
        if resume_steps < 1:
            raise WatchdogConfigError("resume_steps must be >= 1")
        self.limits = limits
        self.state = MotionState.at_rest(initial_position)
        dim = self.state.position.shape[0]
        if limits is not None:
            if limits.action_dim != dim:
                raise ActionShapeError(f"initial position has {dim} entries, limits have {limits.action_dim}")
            limits.check_state(self.state)
        elif not np.isfinite(self.state.position).all():
            raise UnsafeStateError("initial position must be finite")
        self.action_dim = dim
        self.fallback = fallback if fallback is not None else HoldBehaviour(limits)
        self.verification: VerificationReport | None = None
        if verify and limits is not None:
            self.verification = verify_fallback(self.fallback, limits)
        self.filter = SafetyFilter(limits, filter_mode) if limits is not None else None
        self.resume_steps = int(resume_steps)
        self._ramp = [(j + 1) / self.resume_steps for j in range(self.resume_steps)]
        if limits is not None:
            # Distance coverable in resume_steps periods from rest within both limits.
            n = np.arange(1, self.resume_steps + 1)[:, None]
            self._reach: np.ndarray = (np.minimum(n * limits.dv[None, :], limits.max_velocity[None, :]) * limits.dt).sum(axis=0)
        else:
            self._reach = np.full(dim, np.inf)
        self.counts = WatchdogCounts()
        self.mode = Mode.FALLBACK
        self.reason: FallbackReason | None = FallbackReason.NO_CHUNK
        self.verdict: Verdict | None = None
        self._resume_j = 0
        self._resume_prev: np.ndarray | None = None  # resuming: the previous tick's proposal
        self._last_seq = 0  # newest chunk sequence number seen
        self._fresh_from = 1  # proposals from chunks with seq >= this may resume the policy
        self._refused_seq = 0  # newest chunk whose action was refused as out of reach
        self.fallback.reset(self.state.copy())

    def reset(self, position: ArrayLike) -> None:
        """Start over at rest at ``position`` (a new episode): fallback mode, reason ``no_chunk``,
        only chunks received from now on may hand control back to the policy.

        Raises:
            UnsafeStateError: the position is outside the bounds.
        """
        state = MotionState.at_rest(position)
        if state.position.shape != (self.action_dim,):
            raise ActionShapeError(f"position has {state.position.shape[0]} entries, expected {self.action_dim}")
        if self.limits is not None:
            self.limits.check_state(state)
        self.state = state
        self.mode = Mode.FALLBACK
        self.reason = FallbackReason.NO_CHUNK
        self.verdict = None
        self._fresh_from = self._last_seq + 1
        self.fallback.reset(self.state.copy())

    @property
    def filter_counts(self) -> InterventionCounts | None:
        """The filter's intervention counters (``None`` without limits)."""
        return None if self.filter is None else self.filter.counts

    def note_chunk(self, seq: int) -> None:
        """Tell the watchdog a chunk with sequence number ``seq`` (increasing) was received."""
        if seq > self._last_seq:
            self._last_seq = seq

    @property
    def needs_fresh_chunk(self) -> bool:
        """In fallback and no chunk that could end it is at hand (none arrived since the fallback
        began, or the newest one's action was out of reach): the broker should request one now.
        A policy conditioned on the observed state answers from where the robot now is."""
        return self.mode is Mode.FALLBACK and (self._last_seq < self._fresh_from or self._refused_seq >= self._last_seq)

    @property
    def ramping(self) -> bool:
        """Resuming, within the ramp from the fallback's command (not yet the chase of the plan
        that may follow it): the command still blends in from the fallback."""
        return self.mode is Mode.RESUMING and self._resume_j < self.resume_steps

    @property
    def reach(self) -> np.ndarray:
        """Per joint, how far a proposal may be from the current command to hand back to it:
        the distance coverable in ``resume_steps`` periods from rest within the limits."""
        return self._reach

    def reachable(self, proposal: np.ndarray) -> bool:
        """Whether ``proposal`` is finite and within reach of the current command (see the module docstring)."""
        d = np.abs(proposal - self.state.position)
        return bool((d <= self._reach).all())  # NaN compares False: never reachable

    def step(self, proposal: np.ndarray | None, seq: int = 0, reason: FallbackReason | None = None) -> np.ndarray:
        """Emit the command for this tick. Hot path.

        Args:
            proposal: the policy action due now ``[A]``, or ``None`` when none is valid.
            seq: the sequence number of the chunk the proposal came from (freshness check).
            reason: why there is no proposal (required when ``proposal`` is ``None``).

        Returns:
            The command, a read-only float64 array ``[A]`` (it also becomes the command state);
            :attr:`mode`, :attr:`reason` and :attr:`verdict` describe it.
        """
        counts = self.counts
        counts.ticks += 1
        mode = self.mode
        if proposal is not None and mode is Mode.POLICY:
            cmd, verdict = self._filter(proposal, None)
            self.verdict = verdict
            if cmd is not None:
                counts.policy_ticks += 1
                return self._emit(cmd)
            reason = FallbackReason.REJECTED
        elif proposal is not None and mode is Mode.FALLBACK:
            if seq >= self._fresh_from:
                if self.reachable(proposal):
                    self.mode = mode = Mode.RESUMING
                    self._resume_j = 0
                    self._resume_prev = None
                    counts.resumes += 1
                else:
                    counts.resume_refused += 1
                    self._refused_seq = max(self._refused_seq, seq)
                    self.reason = FallbackReason.UNREACHABLE if np.isfinite(proposal).all() else FallbackReason.REJECTED
        if proposal is not None and mode is Mode.RESUMING:
            if np.isfinite(proposal).all():
                j = self._resume_j
                if j < self.resume_steps:
                    base = self._fallback_command()
                    w = self._ramp[j]
                    target = base + w * (np.asarray(proposal, dtype=np.float64) - base)
                    self._resume_j = j = j + 1
                else:
                    target = proposal  # the ramp is done: chasing the plan within the limits
                cmd, verdict = self._filter(target, True)
                assert cmd is not None  # clamping never rejects a finite target
                self.verdict = verdict
                prev, self._resume_prev = self._resume_prev, proposal
                if j >= self.resume_steps and verdict is Verdict.PASSED and self._on_plan(proposal, prev):
                    self.mode = Mode.POLICY
                    self.reason = None
                counts.resuming_ticks += 1
                return self._emit(cmd)
            reason = FallbackReason.REJECTED
            if self.filter is not None:
                self.filter.counts.checked += 1
                self.filter.counts.rejected += 1
                self.filter.counts.nonfinite += 1
        # No usable proposal: fallback.
        if self.mode is not Mode.FALLBACK:
            self._enter_fallback(reason if reason is not None else FallbackReason.STALE)
        elif proposal is None and reason is not None:
            self.reason = reason  # keep the current cause visible (e.g. stale -> disconnected)
        counts.fallback_ticks += 1
        cmd = self._fallback_command()
        if self.filter is not None:
            safe, verdict = self._filter(cmd, True)
            assert safe is not None  # clamping never rejects a finite target
            # Only a real change counts: a verified behaviour's command may sit on a limit and
            # be "clamped" by float round-off (1e-16) alone.
            if verdict is not Verdict.PASSED and float(np.max(np.abs(safe - cmd))) > 1e-9 * (1.0 + float(np.max(np.abs(cmd)))):
                counts.fallback_interventions += 1
            cmd = safe
        else:
            cmd = np.array(cmd, dtype=np.float64)
            cmd.flags.writeable = False
        self.verdict = None
        return self._emit(cmd)

    # ------------------------------------------------------------------ internals

    def _filter(self, target: np.ndarray, clamp: bool | None) -> tuple[np.ndarray | None, Verdict]:
        f = self.filter
        if f is None:
            t = np.array(target, dtype=np.float64)
            if t.shape == (self.action_dim,) and np.isfinite(t).all():
                t.flags.writeable = False
                return t, Verdict.PASSED
            return None, Verdict.REJECTED
        return f.apply(target, self.state, clamp=clamp)

    def _on_plan(self, proposal: np.ndarray, prev: np.ndarray | None) -> bool:
        """Resuming, the ramp done and this tick's proposal passed as it was: whether the command
        can follow the plan from here within the acceleration limit, its velocity (the filter's,
        of the command it just passed) within one tick's change of the plan's (the last two
        proposals'). A chase arrives faster than the plan moves: handed over then, it would
        overshoot at the next tick and be clamped as the policy's."""
        lim, f = self.limits, self.filter
        if lim is None or f is None or prev is None:
            return True  # no limits, or a one-tick ramp: nothing tells the plan's velocity yet
        v_plan = (np.asarray(proposal, dtype=np.float64) - prev) / lim.dt
        return bool((np.abs(f.velocity - v_plan) <= lim.dv * (1.0 + 1e-9)).all())

    def _fallback_command(self) -> np.ndarray:
        cmd = np.asarray(self.fallback.next_command(self.state), dtype=np.float64)
        if not np.isfinite(cmd).all() or cmd.shape != (self.action_dim,):
            # A user behaviour misbehaving at run time despite verification: hold instead.
            return HoldBehaviour(self.limits).next_command(self.state)
        return cmd

    def _enter_fallback(self, reason: FallbackReason) -> None:
        self.mode = Mode.FALLBACK
        self.reason = reason
        self.counts.fallback_entries += 1
        self.counts.by_reason[reason.value] = self.counts.by_reason.get(reason.value, 0) + 1
        self._fresh_from = self._last_seq + 1
        self.fallback.reset(self.state.copy())

    def _emit(self, cmd: np.ndarray) -> np.ndarray:
        # Commands are read-only (the filter makes them so): the command doubles as the next
        # state's position, and a caller scaling it in place must not corrupt that state.
        state = self.state
        if self.filter is None:
            state.velocity = np.zeros(self.action_dim)
        else:
            state.velocity = self.filter.velocity
        state.position = cmd
        return cmd
