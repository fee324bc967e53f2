"""The watchdog: fallback in the same tick, fresh-and-reachable resume, blending back in."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chunkline.safety import (
    CallableBehaviour,
    FallbackReason,
    FallbackVerificationError,
    FilterMode,
    Limits,
    Mode,
    SafePoseBehaviour,
    UnsafeStateError,
    Watchdog,
)
from chunkline.safety.filter import Verdict

DT = 0.02


def limits() -> Limits:
    return Limits(lower=[-1.0, -1.0], upper=[1.0, 1.0], max_velocity=1.0, max_acceleration=10.0, dt=DT)


def policy_mode(dog: Watchdog, target: np.ndarray, seq: int = 1) -> None:
    dog.note_chunk(seq)
    for _ in range(dog.resume_steps):
        dog.step(target, seq)
    assert dog.mode is Mode.POLICY


def test_starts_in_fallback_holding_the_initial_position() -> None:
    dog = Watchdog(limits(), [0.1, -0.2])
    assert dog.verification is not None and dog.verification.settled
    assert dog.mode is Mode.FALLBACK and dog.reason is FallbackReason.NO_CHUNK
    for _ in range(3):
        cmd = dog.step(None, reason=FallbackReason.NO_CHUNK)
        np.testing.assert_array_equal(cmd, [0.1, -0.2])
    assert not cmd.flags.writeable
    assert dog.needs_fresh_chunk


def test_resume_hands_over_only_once_the_command_is_on_the_plan() -> None:
    # A plan moving away at the velocity limit (it moved on while the fallback held): the ramp
    # ends off it, and the clamped chase that follows is still the resume's, not the policy's.
    lim = limits()
    dog = Watchdog(lim, [0.0, 0.0], resume_steps=4)
    dog.note_chunk(1)
    modes, verdicts = [], []
    for i in range(50):
        target = np.full(2, 0.03 + 0.5 * lim.max_velocity * DT * i)
        cmd = dog.step(target, seq=1)
        modes.append(dog.mode)
        verdicts.append(dog.verdict)
    first = modes.index(Mode.POLICY)
    assert first > 4  # longer than the ramp: it had to catch the plan
    assert all(m is Mode.RESUMING for m in modes[:first])
    assert verdicts[first] is Verdict.PASSED and Verdict.CLAMPED in verdicts[:first]
    assert all(v is Verdict.PASSED for v in verdicts[first:])  # on the plan from there on
    np.testing.assert_allclose(cmd, target)
    assert dog.counts.resuming_ticks == first + 1


def test_resume_blends_in_over_resume_steps_then_policy() -> None:
    dog = Watchdog(limits(), [0.0, 0.0], resume_steps=4)
    dog.note_chunk(1)
    assert not dog.needs_fresh_chunk
    target = np.array([0.01, -0.01])
    cmds = []
    for i in range(4):
        cmds.append(dog.step(target, seq=1))
        assert dog.mode is (Mode.RESUMING if i < 3 else Mode.POLICY)
    # Monotone approach, never past the target, ending on it (within the limits throughout).
    xs = [c[0] for c in cmds]
    assert all(b >= a for a, b in zip(xs, xs[1:], strict=False)) and xs[-1] <= 0.01 + 1e-12
    assert dog.counts.resumes == 1 and dog.counts.resuming_ticks == 4
    dog.step(target, seq=1)
    assert dog.mode is Mode.POLICY and dog.verdict is not None


def test_missing_action_switches_to_fallback_in_the_same_tick() -> None:
    dog = Watchdog(limits(), [0.0, 0.0])
    policy_mode(dog, np.zeros(2))
    cmd = dog.step(None, reason=FallbackReason.STALE)
    assert dog.mode is Mode.FALLBACK and dog.reason is FallbackReason.STALE
    assert cmd is not None
    assert dog.counts.fallback_entries == 1 and dog.counts.by_reason == {"stale": 1}
    # The reason follows the cause while the fallback runs.
    dog.step(None, reason=FallbackReason.DISCONNECTED)
    assert dog.reason is FallbackReason.DISCONNECTED


def test_only_a_fresh_chunk_ends_the_fallback() -> None:
    dog = Watchdog(limits(), [0.0, 0.0])
    policy_mode(dog, np.zeros(2), seq=1)
    dog.step(None, reason=FallbackReason.EXPIRED)
    assert dog.needs_fresh_chunk
    for _ in range(5):
        dog.step(np.zeros(2), seq=1)  # the old chunk's actions: not trusted again
        assert dog.mode is Mode.FALLBACK
    dog.note_chunk(2)
    assert not dog.needs_fresh_chunk
    dog.step(np.zeros(2), seq=2)
    assert dog.mode is Mode.RESUMING


def test_unreachable_first_action_keeps_the_fallback() -> None:
    dog = Watchdog(limits(), [0.0, 0.0], resume_steps=5)
    dog.note_chunk(1)
    far = np.array([0.9, 0.0])  # 0.9 m away; 5 periods from rest cover 0.06 m
    for _ in range(3):
        cmd = dog.step(far, seq=1)
        assert dog.mode is Mode.FALLBACK
    np.testing.assert_array_equal(cmd, [0.0, 0.0])
    assert dog.counts.resume_refused == 3
    # A chunk out of reach is worth replacing: a newer one is wanted at once.
    assert dog.needs_fresh_chunk
    dog.note_chunk(2)
    assert not dog.needs_fresh_chunk
    near = np.array([0.05, 0.0])
    dog.step(near, seq=2)
    assert dog.mode is Mode.RESUMING


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_action_is_rejected_into_fallback(bad: float) -> None:
    dog = Watchdog(limits(), [0.0, 0.0])
    policy_mode(dog, np.zeros(2))
    cmd = dog.step(np.array([bad, 0.0]), seq=1)
    assert np.isfinite(cmd).all()
    assert dog.mode is Mode.FALLBACK and dog.reason is FallbackReason.REJECTED
    assert dog.filter_counts.nonfinite == 1
    # Never resumes on a NaN, even from a fresh chunk.
    dog.note_chunk(2)
    dog.step(np.array([bad, 0.0]), seq=2)
    assert dog.mode is Mode.FALLBACK


def test_reject_mode_falls_back_on_out_of_limit_actions_and_clamp_mode_clamps() -> None:
    strict = Watchdog(limits(), [0.0, 0.0], filter_mode=FilterMode.REJECT, resume_steps=1)
    policy_mode(strict, np.zeros(2))
    strict.step(np.array([0.5, 0.0]), seq=1)
    assert strict.mode is Mode.FALLBACK and strict.reason is FallbackReason.REJECTED
    lenient = Watchdog(limits(), [0.0, 0.0], resume_steps=1)
    policy_mode(lenient, np.zeros(2))
    cmd = lenient.step(np.array([0.5, 0.0]), seq=1)
    assert lenient.mode is Mode.POLICY and 0 < cmd[0] < 0.5
    assert lenient.filter_counts.clamped == 1


def test_commands_always_keep_the_limits_across_mode_changes() -> None:
    lim = limits()
    dog = Watchdog(lim, [0.0, 0.0], fallback=SafePoseBehaviour(lim, [0.5, 0.5]))
    rng = np.random.default_rng(3)
    prev = dog.state.copy()
    seq = 0
    for _t in range(600):
        r = rng.random()
        if r < 0.05:
            seq += 1
            dog.note_chunk(seq)
        proposal = None if r > 0.8 else rng.uniform(-1.5, 1.5, 2) * (0.05 if r < 0.6 else 1.0)
        if r < 0.02:
            proposal = np.array([math.nan, 0.0])
        cmd = dog.step(proposal, seq=seq, reason=FallbackReason.STALE)
        assert lim.step_violations(prev, cmd) == []
        prev = prev.advanced(cmd, DT)
    assert dog.counts.ticks == 600
    assert dog.counts.fallback_interventions == 0


def test_no_limits_passes_finite_actions_and_holds_otherwise() -> None:
    dog = Watchdog(None, [0.0, 0.0], resume_steps=1)
    dog.note_chunk(1)
    np.testing.assert_array_equal(dog.step(np.array([5.0, -5.0]), seq=1), [5.0, -5.0])
    np.testing.assert_array_equal(dog.step(np.array([9.0, 9.0]), seq=1), [9.0, 9.0])
    cmd = dog.step(np.array([math.nan, 0.0]), seq=1)
    np.testing.assert_array_equal(cmd, [9.0, 9.0])
    assert dog.mode is Mode.FALLBACK and not cmd.flags.writeable


def test_unverifiable_fallback_and_bad_initial_state_are_refused() -> None:
    lim = limits()
    with pytest.raises(FallbackVerificationError):
        Watchdog(lim, [0.0, 0.0], fallback=CallableBehaviour(lambda s, k: np.zeros(2), name="teleport"))
    with pytest.raises(UnsafeStateError):
        Watchdog(lim, [2.0, 0.0])


def test_reset_starts_over_at_a_new_position() -> None:
    dog = Watchdog(limits(), [0.0, 0.0])
    policy_mode(dog, np.zeros(2))
    dog.reset([0.3, 0.3])
    assert dog.mode is Mode.FALLBACK and dog.needs_fresh_chunk
    np.testing.assert_array_equal(dog.step(None, reason=FallbackReason.NO_CHUNK), [0.3, 0.3])
    with pytest.raises(UnsafeStateError):
        dog.reset([3.0, 0.0])


def test_watchdog_settings_are_validated() -> None:
    from chunkline.safety import WatchdogConfigError

    with pytest.raises(WatchdogConfigError):
        Watchdog(limits(), [0.0, 0.0], resume_steps=0)
    with pytest.raises(UnsafeStateError):
        Watchdog(None, [math.nan, 0.0])
