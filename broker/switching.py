"""How the broker switches from its plan to a newly arrived chunk: at once, cross-faded, joined
along a path within the limits, or not at all (too far).

A pure function of the chunk, the plan (:class:`~.timeline.Timeline`), the command state before
the next tick and the limits: the broker (:mod:`.core`) calls it when a chunk arrives and hands its
answer to :meth:`.timeline.Timeline.add` as the transition. Kept apart from the broker's request
and fallback state machine because it reads none of it beyond :class:`SwitchState`.

The rule, in short: a switch the filter would pass as it is happens at once (for ``rtc``, only if
the chunk also agrees with the plan at its frozen end); otherwise a smootherstep cross-fade as long
as ``switch_accel_fraction`` of the limits needs; a position gap beyond ``max_switch_steps`` is too
far; a fade longer than the longest worth waiting for is too far while the plan lasts until a fresh
answer could land, and is otherwise replaced by a catch-up join (:mod:`.catchup`). When the plan
runs dry before a fresh answer could land, a chunk too far for either (within the reach the
fallback hands back with) is joined at the full acceleration budget for the rows it has.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

from ..safety.limits import Limits, MotionState
from .catchup import catch_up
from .chunk import ActionChunk
from .config import BrokerConfig
from .timeline import Join, Timeline, fade_weight

__all__ = ["SwitchKind", "SwitchPlan", "SwitchState", "plan_switch"]

#: a chunk that merely disagrees with the plan at an ``rtc`` switch (nothing breaks a limit) is
#: faded in at this share of the switch budget: nothing forces that hand-over to be quick.
_RTC_FADE_SHARE = 0.25
#: at an ``rtc`` switch, commands within this share of the acceleration limit (times one period
#: squared) of the plan's count as agreeing: taken as they are.
_RTC_AGREE_SHARE = 0.05
#: an ``rtc`` cross-fade is also long enough that the jump in acceleration it adds from one tick to
#: the next stays within this share of the acceleration limit.
_RTC_JERK_SHARE = 0.2
#: a catch-up join changes the command's acceleration by at most this share of its limit per
#: tick (its start and its hand-over to the chunk included). Unbounded, its bang-bang steps broke
#: the boundary target at 200 ms (rtc's largest acceleration jump at a switch on reach-jump, 1 s
#: chunks: 14.7 -> 29.3 rad/s^2 against replace's 47-52); at rtc's fade share (0.2) no join fits
#: within the rows a late chunk has left; at 0.4 it fell to 10.8.
_JOIN_JERK_SHARE = 0.4


class SwitchKind(enum.Enum):
    """How a switch to a new chunk goes."""

    AT_ONCE = "at_once"  # its rows take over as they are (or nothing to switch from)
    FADE = "fade"  # cross-faded in from the plan over ``ticks`` ticks
    JOIN = "join"  # joined along a catch-up path within the limits
    FAR = "far"  # refused: too far for a smooth switch while the plan runs


@dataclasses.dataclass(frozen=True, slots=True)
class SwitchPlan:
    """What :func:`plan_switch` decided: ``ticks`` is set (>= 2) for a ``FADE`` only, ``join`` for a
    ``JOIN`` only."""

    kind: SwitchKind
    ticks: int = 0
    join: Join | None = None

    @property
    def transition(self) -> int | Join:
        """The transition :meth:`.timeline.Timeline.add` takes (0: the merge mode's own hand-over)."""
        return self.join if self.join is not None else self.ticks


AT_ONCE = SwitchPlan(SwitchKind.AT_ONCE)
FAR = SwitchPlan(SwitchKind.FAR)


def _joined(join: Join | None) -> SwitchPlan:
    return FAR if join is None else SwitchPlan(SwitchKind.JOIN, join=join)


@dataclasses.dataclass(frozen=True, slots=True)
class SwitchState:
    """What a switch is planned from, besides the chunk, the plan and the limits.

    Args:
        t_next: the robot-clock time of the next tick (the first a switch can change).
        position: the command before that tick (the watchdog's).
        velocity: the command's velocity before that tick.
        resuming: the command still blends in from the fallback.
        rtc: the broker merges in ``rtc`` mode.
        expected_rtt: the expected round trip (seconds) of a request sent now.
        remaining: seconds until the plan runs dry.
        reach: per joint, how far from the command a chunk's action may be for the watchdog to
            hand back to it from the fallback (``None``: no bound); a chunk too far for a smooth
            switch is taken while the plan runs dry before a fresh answer only within it.
    """

    t_next: float
    position: np.ndarray
    velocity: np.ndarray
    resuming: bool
    rtc: bool
    expected_rtt: float
    remaining: float
    reach: np.ndarray | None = None


def plan_switch(chunk: ActionChunk, at: SwitchState, timeline: Timeline, limits: Limits, config: BrokerConfig, *,
            late: bool = False, take_from: int = 0) -> SwitchPlan:
    """How a switch to ``chunk`` goes: a cross-fade over the ticks it needs; at once when it may switch (the
    commands it causes at the first two ticks of the switch pass the filter as they are and,
    for ``rtc``, it agrees with the plan up to there), or when nothing is to switch from (no
    plan, the fallback runs, no limits); ``FAR`` when it is too far (refused): its position
    gap alone needs more than ``max_switch_steps``, or its fade more than the longest worth
    waiting for (``max_switch_steps``, up to twice that while the expected round trip is
    longer), unless the plan runs dry before a fresh answer could land (then see
    :func:`_run_dry_switch`). ``late``: an ``rtc`` chunk that lands after its frozen rows;
    ``take_from``: the chunk's first row that takes over (an ``rtc`` chunk on time, at its frozen
    end: the switch is at the first tick that plays it, the command state there is the plan's, and
    it agrees when its last frozen row is the plan's)."""
    period = config.control_period_s
    t_next = at.t_next
    position, velocity = at.position, at.velocity
    start = chunk.t0 + take_from * chunk.dt
    anchor = None  # (the chunk's last frozen row, the command there): whether they agree
    if take_from > 0:
        if start > t_next + 1e-9 * period:
            # The first tick at or after the takeover, and the commands the plan gives before it.
            t_next += math.ceil((start - t_next) / period - 1e-9) * period
            before = [timeline.continued_at(t_next - j * period) for j in (1, 2)]
            if before[0] is not None and before[1] is not None:
                position = np.asarray(before[0], dtype=np.float64)
                velocity = (position - before[1]) / period
        k = math.floor((t_next - period - chunk.t0) / chunk.dt + 1e-9)
        if 0 <= k < chunk.horizon:
            anchor = (chunk.actions[k].astype(np.float64), np.asarray(position, dtype=np.float64))
    new, old = [], []
    for j in range(2):
        tau = t_next + j * period
        k = math.floor((tau - chunk.t0) / chunk.dt + 1e-9)
        if not 0 <= k < chunk.horizon:
            return AT_ONCE  # the chunk starts later or ends now: nothing to switch to yet
        new.append(chunk.actions[k].astype(np.float64))
        # Past the plan's end (a prefetched chunk lands just then) compare with, and fade from,
        # the plan continued at its final velocity: a chunk from the other side of the
        # workspace is still a chunk too far, and holding the last row would be a jump too.
        row = timeline.continued_at(tau)
        if row is None:
            return AT_ONCE
        old.append(row)
    if not (np.isfinite(new[0]).all() and np.isfinite(new[1]).all()):
        return AT_ONCE  # the filter rejects a non-finite action; nothing to fade
    if not (np.isfinite(old[0]).all() and np.isfinite(old[1]).all()):
        # The plan there is a non-finite action (the filter refuses it when it is due): nothing
        # to fade from or to measure the gap against (the fade's length came out NaN and the merge
        # raised; hypothesis found it, with a policy answering NaN).
        return AT_ONCE
    v0 = (new[0] - position) / period
    v1 = (new[1] - new[0]) / period
    a0 = (v0 - velocity) / period
    a1 = (v1 - v0) / period
    amax, vmax = limits.max_acceleration * (1 - 1e-6), limits.max_velocity * (1 - 1e-6)
    passes = bool((np.abs(a0) <= amax).all() and (np.abs(a1) <= amax).all() and (np.abs(v0) <= vmax).all()
                  and (np.abs(v1) <= vmax).all())
    gap = np.abs(new[0] - old[0])
    # rtc: a chunk that lands within its frozen rows and agrees with the plan there is taken
    # as it is (past them it continues smoothly from the last frozen row: the policy's job).
    # One that lands late, or ignored its prefix, is faded in even when the jump would pass
    # the filter: that jump is what rtc is there to avoid. Taking over at its frozen end, it
    # agrees when its last frozen row is the plan's (no other chunk changed the plan since
    # the request): from there on its rows are its own plan, within the limits.
    agree_gap = gap if anchor is None else np.abs(anchor[0] - anchor[1])
    agrees = not late and float(np.max(agree_gap)) <= _RTC_AGREE_SHARE * float(np.min(limits.max_acceleration)) * period * period
    if passes and (not at.rtc or agrees):
        return AT_ONCE
    dv = np.abs((new[1] - new[0]) - (old[1] - old[0])) / period
    frac = config.switch_accel_fraction
    # A smootherstep cross-fade w over K ticks of the difference e(t) = gap + dv t adds
    # w'' e + 2 w' e' to the acceleration: at most 5.8 gap / (K P)^2 + 3.75 dv / (K P) (9 kept
    # for the second term as margin). With K the sum of the ticks each term needs alone, their
    # sum stays within the budget; the velocity it adds, 1.875 gap / (K P), within the same
    # share of the velocity limit. A position gap beyond max_switch_steps makes a chunk too far;
    # a velocity mismatch is what a re-plan from a newer observation brings and fades out (it
    # refuses a chunk only beyond the longest fade worth waiting for, below).
    budget = frac * limits.max_acceleration
    for_gap = np.maximum(np.sqrt(5.8 * gap / budget) / period, 1.875 * gap / (frac * limits.max_velocity * period))
    far = float(np.max(for_gap))
    if not math.isfinite(far) or far > config.max_switch_steps:
        return _run_dry_switch(chunk, at, timeline, limits, period, take_from)
    if at.resuming and not take_from:
        # The command still blends in from the fallback: the switch is as near as the filter
        # can take it.
        return AT_ONCE
    need = float(np.max(for_gap + 9.0 * dv / (budget * period)))
    # A fade longer than max_switch_steps is worth its length only while a fresh answer, asked
    # now from where the robot is, would come later than it ends (at a round trip of tens of
    # milliseconds, asking again is quicker than a second-long fade; at 300 ms it is not).
    longest = min(2 * config.max_switch_steps,
                  max(config.max_switch_steps, math.ceil(at.expected_rtt / period - 1e-9)))
    if need > longest:
        # The two trajectories diverge (a late answer after the target moved): a cross-fade
        # between them would have to be long to keep what it adds within the budget, while
        # the limits could change that velocity in a fraction of it. While the plan lasts
        # until a fresh answer, asked now from where the robot is, could land, that answer
        # is the better one (joining a late answer at 200 ms one way churned the plan: 13.0 ->
        # 16.4 mm on reach-jump, rtc-replan, 1 s chunks); otherwise refusing it leaves the
        # arm heading for the old target until the plan runs dry. Then join it along a path
        # within the limits (the same budget for the correction), if it gets there within
        # the longest fade and the chunk's rows; otherwise it is too far.
        if at.remaining > at.expected_rtt:
            return FAR
        join = _join(chunk, t_next, position, velocity, budget, longest, timeline, limits, period)
        return _joined(join) if join is not None else _run_dry_switch(chunk, at, timeline, limits, period, take_from)
    wish = need
    if passes:
        # Only an rtc disagreement: nothing forces a quick hand-over, so a gentle one.
        gentle = budget * _RTC_FADE_SHARE
        wish = float(np.max(np.maximum(np.sqrt(5.8 * gap / gentle) / period, for_gap) + 9.0 * dv / (gentle * period)))
    if at.rtc:
        # rtc hands over gently in jerk too: the same fade's third derivative is at most
        # 60 gap / T^3 + 17.3 dv / T^2 over T = K P (smootherstep's third derivative is at most
        # 60 / T^3, three times its second 17.3 / T^2); times P it is the jump in acceleration
        # from one tick to the next. T at least the sum of what each term needs alone keeps
        # their sum within the share.
        jump = _RTC_JERK_SHARE * limits.max_acceleration
        for_jerk = np.cbrt(60.0 * gap * period / jump) + np.sqrt(17.3 * dv * period / jump)
        wish = max(wish, float(np.max(for_jerk)) / period)
    # The gentle wishes are kept as far as the longest fade allows (they never refuse a chunk).
    ticks = max(2, int(math.ceil(min(max(need, wish), longest) - 1e-9)))
    if at.rtc and not _fade_passes(chunk, t_next, position, velocity, ticks, timeline, limits, period):
        # The fade's length is sized for trajectories that part linearly (the gap and the velocity
        # mismatch at the switch). A chunk that turns while the plan runs on (the first answers
        # after reach-jump's jump, heading for the new target at the velocity limit) parts
        # quadratically, and the blend then asks for more than the limits (9.1 rad/s against 8,
        # -170 rad/s^2 against 60): the filter cuts it, the command falls off the plan, and
        # clamping it back on flips the acceleration between its limits for several ticks, one of
        # them the next switch (a 120 rad/s^2 jump). A fade's jerk terms do not shrink with its
        # length there, so the join (within the limits by construction) takes it when it fits;
        # otherwise the fade stands, as before.
        join = _join(chunk, t_next, position, velocity, budget, longest, timeline, limits, period, _RTC_JERK_SHARE)
        if join is not None:
            return _joined(join)
    return SwitchPlan(SwitchKind.FADE, ticks)


def _fade_passes(chunk: ActionChunk, t_next: float, position: np.ndarray, velocity: np.ndarray, ticks: int,
                 timeline: Timeline, limits: Limits, period: float) -> bool:
    """Whether the commands of a ``ticks``-long cross-fade into ``chunk`` from the plan (as
    :meth:`.timeline.Timeline.add` blends them, sampled at the ticks from ``t_next``) and the two
    ticks after it stay within the filter's window from the command state: no velocity or
    acceleration the filter would cut. Only on the chunk's own grid (elsewhere it says yes)."""
    if abs(chunk.dt - period) > 1e-9 * period:
        return True
    q = np.asarray(position, dtype=np.float64)
    v = np.asarray(velocity, dtype=np.float64)
    state = MotionState(q, v)
    for i in range(ticks + 2):
        tau = t_next + i * period
        k = math.floor((tau - chunk.t0) / chunk.dt + 1e-9)
        if not 0 <= k < chunk.horizon:
            return True  # the chunk ends first: what follows is the fallback's business
        cmd = chunk.actions[k].astype(np.float64)
        if i < ticks:
            old = timeline.continued_at(tau)
            if old is None:
                return True  # nothing to blend from: the chunk's rows as they are
            w = fade_weight(i, ticks)
            cmd = (1.0 - w) * np.asarray(old, dtype=np.float64) + w * cmd
        if not np.isfinite(cmd).all():
            return True  # the filter refuses a non-finite command whatever the switch
        lo, hi = limits.velocity_window(state)
        nv = (cmd - state.position) / period
        slack = 1e-6 * (np.abs(lo) + np.abs(hi) + limits.dv)
        if bool((nv < lo - slack).any() or (nv > hi + slack).any()):
            return False
        state = state.advanced(cmd, period)
    return True

def _join(chunk: ActionChunk, t_next: float, position: np.ndarray, velocity: np.ndarray, budget: np.ndarray,
          longest: int, timeline: Timeline, limits: Limits, period: float, jerk_share: float = _JOIN_JERK_SHARE,
          partial: bool = False) -> Join | None:
    """The catch-up join onto ``chunk`` from the command state before the tick at ``t_next``,
    or ``None`` (too far) when it does not end within ``longest`` ticks and the chunk's rows.
    ``partial``: when it does not, the join's commands for every row the chunk has left instead
    (they lead onto it within the limits; the plan ends with the chunk)."""
    if abs(chunk.dt - period) > 1e-9 * period:
        return None  # the join is computed per tick: on the chunk's own grid only
    k0 = math.floor((t_next - chunk.t0) / chunk.dt + 1e-9)  # the chunk's row at the first tick
    end = min(chunk.horizon, k0 + longest + 2)
    if not 0 <= k0 < end - 1:
        return None
    target = chunk.actions[max(k0 - 1, 0):end].astype(np.float64)
    if k0 == 0:
        # The row before the chunk's first, continued backwards: its velocity at the start.
        target = np.concatenate([2.0 * target[:1] - target[1:2], target])
    if not np.isfinite(target).all():
        return None
    # The command's acceleration before the join (from the plan's commands before it; the
    # filter passed them as they are): the join starts from it within the jerk bound.
    q = np.asarray(position, dtype=np.float64)
    v = np.asarray(velocity, dtype=np.float64)
    before = [timeline.continued_at(t_next - j * period) for j in (2, 3)]
    accel = np.zeros_like(q)
    if before[0] is not None and before[1] is not None:
        accel = (v - (np.asarray(before[0], dtype=np.float64) - before[1]) / period) / period
        if not np.isfinite(accel).all():
            accel = np.zeros_like(q)
    jerk = jerk_share * limits.max_acceleration
    rows = catch_up(limits, q, v, target, budget, period, jerk=jerk, acceleration=accel)
    if rows is None and partial and end == chunk.horizon and len(target) >= 2:
        # The chunk continued at its final velocity for the join's look-ahead past its last row
        # (what the last join commands aim at); the join then stands for every row it has.
        beyond = target[-1] + (target[-1] - target[-2]) * np.arange(1.0, 4.0)[:, None]
        rows = catch_up(limits, q, v, np.concatenate([target, beyond]), budget, period, jerk=jerk,
                        acceleration=accel, partial=True)
    return None if rows is None else Join(rows, k0)


def _run_dry_switch(chunk: ActionChunk, at: SwitchState, timeline: Timeline, limits: Limits, period: float,
                    take_from: int) -> SwitchPlan:
    """How a chunk too far for a smooth switch (or its join) is taken while the plan runs dry before
    a fresh answer could land; ``None`` (refused) while the plan lasts longer, or when the chunk's
    action is beyond the reach the watchdog hands back from the fallback with (the other elbow
    branch 4 rad away that the far rule was made for, at 200 ms one way, stays refused), or takes
    over only at its frozen end (the plan runs until then).

    Refusing it then keeps the arm on the old plan until that runs dry, the fallback brakes it and
    a ramp hands back to a later answer. Traced at 300 ms one way with 1 s chunks (reach-jump, seed
    3): the first answer after the target's jump landed 1.65 rad from the plan with 19 of its rows
    left and was refused, the answers behind it were held by a stall, and the arm headed for the
    old target for 0.3 s, then held for 0.3 s more. Instead the command is joined onto the chunk at
    the full acceleration budget (a tick-by-tick path within the filter's window, the jerk bounded
    as every join's), for as many of its rows as it has: if the join has not caught the chunk when
    they end, the plan runs dry there, as it would have anyway. While the command ramps in from the
    fallback the chunk is taken at once, as the ramp takes every other (it blends from where the
    command is)."""
    if take_from or at.remaining > at.expected_rtt:
        return FAR
    k0 = math.floor((at.t_next - chunk.t0) / chunk.dt + 1e-9)
    if not 0 <= k0 < chunk.horizon:
        return FAR
    row = chunk.actions[k0].astype(np.float64)
    if at.reach is not None and not bool((np.abs(row - at.position) <= at.reach).all()):
        return FAR
    if at.resuming:
        return AT_ONCE
    return _joined(_join(chunk, at.t_next, at.position, at.velocity, limits.max_acceleration, chunk.horizon, timeline, limits,
                 period, partial=True))
