"""Broker configuration: merge modes, staleness tolerance, prefetch and resume settings."""

from __future__ import annotations

import dataclasses
import enum
import math

from pydantic import ConfigDict, with_config

from ..safety.filter import FilterMode
from .exceptions import BrokerConfigError

__all__ = ["MergeMode", "BrokerConfig"]


class MergeMode(str, enum.Enum):
    """How a newly arrived chunk combines with the actions already on the timeline.

    ``replace``: from the first slot not yet executed, the new chunk's actions take
    over; slots before the new chunk's ``t0`` (if it starts in the future) keep the old plan.
    Use it with policies whose consecutive chunks agree (most diffusion/flow policies with
    real-time chunking, or any policy when latency is well below the chunk length): it
    executes exactly what the newest, best-informed inference asked for.

    ``blend``: over the first few slots of the hand-over, the command is a weighted mix of
    old and new actions (``BrokerConfig.blend_weights`` are the new chunk's weights, rising
    to 1). Use it when consecutive chunks disagree a little (a jump at every hand-over would
    excite the arm) but you still want the new chunk to take over within a few periods.

    ``ensemble``: ACT-style temporal ensembling: every slot keeps a weighted average of all
    predictions made for that time, weight ``exp(-m * i)`` for the ``i``-th prediction of that
    slot (``i = 0`` the oldest; ``m = BrokerConfig.ensemble_decay``). Use it when chunks arrive
    often (every few periods) from a policy trained for it (ACT): it smooths strongly, at the
    cost of reacting more slowly to new observations.

    ``rtc`` (default): real-time chunking. Each request carries the rest of the plan as its prefix and
    the number of its rows that will run before a typical answer arrives (``prefix_delay``,
    counted from the ``rtc_delay_quantile`` of recent round trips); a policy that inpaints the
    prefix returns a chunk that already agrees with it, and the chunk is taken as it is from the
    first slot not yet executed (like ``replace``). A chunk that does not agree at the switch
    (it came after its frozen rows had run, or the policy did not honour them) is cross-faded
    in instead of jumped to. The broker re-plans continuously: a new request goes out as soon as
    a chunk arrives (but not sooner than ``BrokerConfig.rtc_min_replan_s`` after the last one),
    and further ones overlap it when its answer is later than half a typical round trip or the
    plan would run dry before it.

    Whatever the mode, a switch never asks the safety filter for a jump it would have to cut:
    where the commands at the switch would break a limit, the merged rows are cross-faded in
    from the old plan (sampled at the control ticks) over as many slots as the acceleration
    budget needs (``BrokerConfig.switch_accel_fraction``), and a chunk whose position gap alone
    would need more than ``BrokerConfig.max_switch_steps`` is refused while the current plan
    runs (a new request goes out at once).
    """

    REPLACE = "replace"
    BLEND = "blend"
    ENSEMBLE = "ensemble"
    RTC = "rtc"


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise BrokerConfigError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {value}")


# The one definition of the settings: configuration files validate into this class directly
# (:mod:`.settings`), unknown keys refused.
@with_config(ConfigDict(extra="forbid"))
@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """Settings of the broker core (all times in seconds, robot clock).

    One field per broker setting (the ``[broker]`` table).

    Args:
        control_period_s: the control loop's period (must match the safety limits' ``dt``).
        max_age_s: how late an action may run after its due time; ``None``: one chunk ``dt``
            (each action holds until the next is due, and the last one for one period).
        lead_s: how early an action may be taken before its due time. A plan starts at the tick
            that observed, so its rows fall on the robot's tick grid, and a tick that wakes a hair
            less late than that one would otherwise take the row before (running it twice, then
            skipping one). ``None``: a tenth of the control period (:attr:`lead`).
        merge: how a new chunk combines with the timeline (:class:`MergeMode`).
        blend_weights: for ``blend``: the new chunk's weight in the first slots of the hand-over.
        ensemble_decay: for ``ensemble``: ``m`` in ``exp(-m * i)`` (ACT uses 0.01).
        latency_window: round trips kept for the latency estimate.
        latency_quantile: quantile of that window used as the expected round trip (0.95).
        latency_spread_k: the expected round trip is at least the window's mean plus this many
            standard deviations.
        rtc_delay_quantile: ``rtc``: the quantile of the window taken as the *typical* round
            trip, which sets ``prefix_delay`` (the rows frozen for the policy) and paces the
            overlapping requests. Lower reacts sooner (fewer frozen rows) and fades in more late
            chunks; the tail is covered by the prefetch, which uses ``latency_quantile``.
        in_flight_window: requests in flight at once while a chunk outlasts the expected round
            trip with room to spare (its coverage less that round trip and the margin is at least
            half a typical round trip). With more than one, the next request goes out when the
            plan *including the chunks in flight* (each assumed to cover what the last chunk
            covered from its observation) would run dry within the expected round trip plus the
            margin: a round trip up to the chunk's duration keeps the plan full. While the
            fallback runs, it also asks again every typical round trip shared among the window,
            whatever is in flight (a stalled link holds those answers up).
        max_in_flight: the most requests ever in flight. Where the expected round trip nears or
            passes a chunk's coverage the plan lives on overlap, and the window widens from
            ``in_flight_window`` to as many requests as that round trip holds at the pace the plan
            needs, up to this (:mod:`chunkline.broker.cadence`). Set it to ``in_flight_window``
            for a fixed window.
        rtc_min_replan_s: ``rtc``: the least time between two re-planning requests (from the
            send of one to the issue of the next): the execution horizon of real-time chunking
            (Black et al. 2025 re-plan every ``s`` steps with ``s`` at least the inference delay).
            Without it rtc asks again as soon as each answer is in: every tick when round trips
            are under a period, every ~3 ticks at 50 ms. A plan that would run dry before the
            next answer still asks at once (the prefetch rule); 0 re-plans at every answer.
        replan_interval_s: also ask for a new chunk this long after the last request went out,
            whatever the plan still holds (within the in-flight window): how fast the robot reacts to
            a change in the scene. ``None``: only when the plan runs short. Re-planning often
            from round-trip-old observations suits ``rtc`` (the prefix keeps chunks consistent).
        switch_accel_fraction: the share of the acceleration (and velocity) limits a chunk
            switch's cross-fade may use.
        max_switch_steps: the longest cross-fade; a chunk needing more is refused while the
            current plan is valid.
        initial_latency_s: expected round trip before any has been measured.
        prefetch_margin_s: extra time on top of the expected round trip: the next request is
            sent at the last tick from which it still lands this long before the timeline
            runs dry (remaining < round trip + margin + one control period).
        idle_deadline_s: deadline budget of a request sent when the timeline is already dry.
        min_deadline_s: smallest deadline budget ever sent.
        request_timeout_s: a request unanswered this long counts as lost (a new one may go).
        error_backoff_s: wait after a server error before the next request, unless the server
            said when to retry.
        unreachable_backoff_s: wait after a chunk whose action was out of reach of the held
            command (the fallback's reason reads ``unreachable``) before asking again: a policy
            that answers the same observation the same way would otherwise be asked every tick.
        reconnect_interval_s: while disconnected, how often a request may go out (the shell's
            send doubles as the reconnection attempt).
        send_prefix: attach the actions that will run while the request is in flight
            (for policies that support real-time chunking).
        resume_steps: ticks of blending when handing back from the fallback to the policy; also
            sets how far the policy's action may be from the held command to hand back at all
            (coverable in that many ticks within the limits).
        filter_mode: what the safety filter does with out-of-limit actions (clamp or reject).
        hold_tolerance: hold-and-resume, while the server is saturated: a chunk answering an
            observation the robot has held still since (the fallback holds; the measured state
            within this distance per joint, action units) starts from its first row at the next
            tick instead of losing the rows due during the wait; ``None`` turns it off
            (:mod:`chunkline.broker.hold`).
        pace_under_load: when the server's replies say it is saturated (queueing, refusals),
            keep one request in flight and ask only from a held state or as late as the round
            trip allows (:mod:`chunkline.broker.pacing`); prefetch again once it has room.
        paced_lead_rows: ``rtc`` with hold-and-resume, while paced: the request goes out when the
            plan holds this many rows, frozen as its prefix; its answer resumes after them from
            the hold (they ran from the current plan), so the robot holds that much less per
            chunk and each chunk runs that many rows fewer. 0: ask once the plan is dry. Fewer
            (one at least) where that makes requests go out every two round trips: a chunk that
            barely outlasts the round trip (:func:`chunkline.broker.pacing.paced_ahead_s`).
        refresh_queued: while paced, the request in flight waits in the server's queue: once a
            control period, from an observation a period old or more, send the current one in
            its place (``Infer.replaces``; :mod:`chunkline.broker.refresh`), so its chunk answers
            a fresher observation. Needs a shell that sends requests concurrently.

    Raises:
        BrokerConfigError: a value is out of range.
    """

    control_period_s: float = 0.02
    max_age_s: float | None = None
    lead_s: float | None = None
    merge: MergeMode = MergeMode.RTC
    blend_weights: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    ensemble_decay: float = 0.01
    latency_window: int = 50
    latency_quantile: float = 0.95
    latency_spread_k: float = 2.0
    rtc_delay_quantile: float = 0.75
    in_flight_window: int = 4
    max_in_flight: int = 8
    rtc_min_replan_s: float = 0.1
    replan_interval_s: float | None = None
    switch_accel_fraction: float = 0.5
    max_switch_steps: int = 25
    initial_latency_s: float = 0.1
    prefetch_margin_s: float = 0.02
    idle_deadline_s: float = 1.0
    min_deadline_s: float = 0.005
    request_timeout_s: float = 2.0
    error_backoff_s: float = 0.1
    unreachable_backoff_s: float = 0.25
    reconnect_interval_s: float = 0.5
    send_prefix: bool = True
    resume_steps: int = 10
    filter_mode: FilterMode = FilterMode.CLAMP
    hold_tolerance: float | None = 0.005
    pace_under_load: bool = True
    paced_lead_rows: int = 2
    refresh_queued: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "merge", MergeMode(self.merge))
        object.__setattr__(self, "filter_mode", FilterMode(self.filter_mode))
        object.__setattr__(self, "blend_weights", tuple(float(w) for w in self.blend_weights))
        _positive("control_period_s", self.control_period_s)
        if self.max_age_s is not None:
            _positive("max_age_s", self.max_age_s)
        if self.lead_s is not None:
            _positive("lead_s", self.lead_s, allow_zero=True)
        if not all(0.0 <= w <= 1.0 for w in self.blend_weights):
            raise BrokerConfigError("blend_weights must lie in [0, 1]")
        if any(b < a for a, b in zip(self.blend_weights, self.blend_weights[1:], strict=False)):
            raise BrokerConfigError("blend_weights must not decrease (the new chunk takes over)")
        _positive("ensemble_decay", self.ensemble_decay, allow_zero=True)
        if self.latency_window < 1:
            raise BrokerConfigError("latency_window must be >= 1")
        if not 0.0 < self.latency_quantile <= 1.0:
            raise BrokerConfigError("latency_quantile must be in (0, 1]")
        if not 0.0 < self.rtc_delay_quantile <= 1.0:
            raise BrokerConfigError("rtc_delay_quantile must be in (0, 1]")
        for name in ("initial_latency_s", "prefetch_margin_s", "error_backoff_s", "unreachable_backoff_s", "reconnect_interval_s"):
            _positive(name, getattr(self, name), allow_zero=True)
        for name in ("idle_deadline_s", "min_deadline_s", "request_timeout_s"):
            _positive(name, getattr(self, name))
        _positive("latency_spread_k", self.latency_spread_k, allow_zero=True)
        _positive("rtc_min_replan_s", self.rtc_min_replan_s, allow_zero=True)
        if self.replan_interval_s is not None:
            _positive("replan_interval_s", self.replan_interval_s)
        if self.max_in_flight < 1:
            raise BrokerConfigError("max_in_flight must be >= 1")
        if self.in_flight_window < 1:
            raise BrokerConfigError("in_flight_window must be >= 1")
        if not 0.0 < self.switch_accel_fraction <= 1.0:
            raise BrokerConfigError("switch_accel_fraction must be in (0, 1]")
        if self.max_switch_steps < 1:
            raise BrokerConfigError("max_switch_steps must be >= 1")
        if self.hold_tolerance is not None:
            _positive("hold_tolerance", self.hold_tolerance, allow_zero=True)
        if self.paced_lead_rows < 0:
            raise BrokerConfigError("paced_lead_rows must be >= 0")
        if self.resume_steps < 1:
            raise BrokerConfigError("resume_steps must be >= 1")

    @property
    def lead(self) -> float:
        """:attr:`lead_s`, or its default: a tenth of the control period (a timer's wake-up jitter
        stays well inside it, and an action taken that early is still the one due)."""
        return self.lead_s if self.lead_s is not None else 0.1 * self.control_period_s
