"""The sans-I/O broker core: timeline + prefetch + watchdog, driven by an injected clock.

One object, no sockets, threads or sleeps: the robot-side state machine of one control loop
(which chunk plays, when to ask for the next, how to switch). Merges live in :mod:`.timeline`,
switches in :mod:`.switching`, the latency model in :mod:`.latency`, the in-flight window in
:mod:`.cadence`, load-aware pacing in :mod:`.pacing`, hold-and-resume in :mod:`.hold`; the rules
are in ``docs/broker.md``. The shells (:mod:`.shells`, :mod:`.openpi_compat`) move data::

    every period:   cmd = broker.tick(now, observation); actuators.send(cmd.action)
                    if cmd.request: send it, then broker.on_sent(cmd.request.request_id, t_sent)
    on a reply:     broker.on_chunk(ActionChunk.from_reply(chunk, received_at=t, request_id=...), t)
    on an error:    broker.on_error(t, request_id=..., code=..., retry_after_s=...)
    on the link:    broker.on_disconnect(t) / broker.on_connect(t)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..safety.fallback import FallbackBehaviour
from ..safety.limits import ArrayLike, Limits
from ..safety.watchdog import FallbackReason, Mode, Watchdog
from .cadence import Cadence, plan_cadence
from .chunk import ActionChunk
from .config import BrokerConfig, MergeMode
from .exceptions import BrokerConfigError
from .hold import HoldTracker
from .latency import LatencyWindow
from .messages import BrokerStats, Command, RequestIntent
from .pacing import LoadPacer, paced_ahead_s, urgency_for
from .refresh import REFRESH_CODES, Refresher
from .switching import AT_ONCE, SwitchKind, SwitchPlan, SwitchState, plan_switch
from .timeline import MergeOutcome, Timeline

__all__ = ["RequestIntent", "Command", "BrokerStats", "Broker"]

_META_KEEP = 64  # chunk metadata kept for the per-tick record (chunk id, round trip, observation time)
_NO_META: tuple[None, None, None] = (None, None, None)
#: rtc overlaps requests every this share of a typical round trip (within the execution horizon
#: and ``max_in_flight``). A change in the scene is seen by the next observation sent, so it waits
#: up to this long before its round trip even starts: at 300 ms one way, a whole round trip (the
#: share was 1) put ~0.6 s before the reaction to reach-jump's jump and made episodes diverge.
#: Half, not less: every request overlapping another is a chunk whose frozen rows may be a stale
#: copy of the plan (faded in at its frozen end), and two in flight at a typical round trip leave
#: room within max_in_flight for fresh requests while a stalled link holds the older ones.
_RTC_PACE_SHARE = 0.5


class Broker:
    """Timeline, prefetch and safety for one robot (sans-I/O; every method takes ``now``).

    Over 20 attributes: its parts (each an object of its own) and the request schedule each tick
    reads and writes (in flight, asked, queued, frozen, when to ask next).

    Args:
        config: broker settings.
        initial_position: the actuators' position at start ``[A]``.
        limits: safety limits (``limits.dt`` must equal ``config.control_period_s``);
            ``None`` runs without limit enforcement (non-finite actions are still refused).
        fallback: the fallback behaviour (default: hold); verified at construction.
        verify_fallback: run start-up verification (leave on outside tests that build many brokers).
        connected: whether the link is up at start.
        first_request_id: the id of the first request (ids then count up); a shell replacing its
            broker starts past the old ids, so late replies to the old one's cannot be mistaken.

    Raises:
        BrokerConfigError: limits and config disagree on the control period.
        FallbackVerificationError: the fallback failed verification.
    """

    def __init__(
        self,
        config: BrokerConfig | None = None,
        *,
        initial_position: ArrayLike,
        limits: Limits | None,
        fallback: FallbackBehaviour | None = None,
        verify_fallback: bool = True,
        connected: bool = True,
        first_request_id: int = 1,
    ) -> None:
        self.config = config = config if config is not None else BrokerConfig()
        if limits is not None and not math.isclose(limits.dt, config.control_period_s, rel_tol=1e-9):
            raise BrokerConfigError(f"limits.dt ({limits.dt}) differs from control_period_s ({config.control_period_s})")
        self.watchdog = Watchdog(
            limits,
            initial_position,
            fallback=fallback,
            filter_mode=config.filter_mode,
            resume_steps=config.resume_steps,
            verify=verify_fallback,
        )
        self.action_dim = self.watchdog.action_dim
        self.timeline = Timeline(
            self.action_dim,
            merge=config.merge,
            blend_weights=config.blend_weights,
            ensemble_decay=config.ensemble_decay,
            max_age_s=config.max_age_s,
            lead_s=config.lead,
        )
        self.latency = LatencyWindow(config.latency_window, config.latency_quantile, config.initial_latency_s,
                                     config.latency_spread_k, config.rtc_delay_quantile)
        self.limits = limits
        self.stats = BrokerStats()
        self.connected = connected
        self._next_id = int(first_request_id)
        self._seq = 0
        self._queued: RequestIntent | None = None
        #: requests in flight: id -> (sent at, observation time)
        self._flights: dict[int, tuple[float, float]] = {}
        #: the newest observation time among them (-inf: none), kept when they change so that
        #: the per-tick prefetch decision does not walk them
        self._flights_obs = -math.inf
        self._rtc = config.merge is MergeMode.RTC
        #: rtc: request id -> (its frozen rows: a late chunk?; the newest chunk when it took its prefix:
        #: did the plan change since?; its first row's due time and the prefix: resume after a hold)
        self._frozen: dict[int, tuple[int, int, float, np.ndarray | None]] = {}
        self._queued_seq = (0, math.nan)  # when the queued request took its prefix: newest chunk, row due
        self._ask_again = False  # a far chunk was refused: ask from the current observation
        self._last_sent = -math.inf
        self._last_tick = -math.inf
        #: how long after its observation a chunk stays valid (learned from the chunks)
        self._coverage: float | None = None
        #: request id -> (sent at, NaN once its round trip no longer counts; observation time)
        self._asked: dict[int, tuple[float, float]] = {}
        #: the server's load as its replies tell it, and since when the robot holds still
        resumes_ahead = self._rtc and config.send_prefix and config.hold_tolerance is not None
        ahead = paced_ahead_s(config.paced_lead_rows, None, self.latency, config.control_period_s) if resumes_ahead else 0.0
        self._fleet = (LoadPacer(config.control_period_s, saturated=config.pace_under_load), HoldTracker(config.hold_tolerance, ahead),
                       Refresher(config.control_period_s, config.refresh_queued and config.pace_under_load, self.stats))
        self._next_request_at = -math.inf
        self._error_pending = False
        self._unreachable_seq = 0  # the newest chunk refused as out of reach
        self._meta: dict[int, tuple[int | str | None, float | None, float | None]] = {}
        self._lead_base = config.prefetch_margin_s + config.control_period_s
        # Tick times are sums of float periods: a horizon of exactly N periods must count as met.
        self._min_replan = max(0.0, config.rtc_min_replan_s - 1e-9)
        self._pace = 0.0
        # The in-flight window and the fallback's pace, in one attribute: CPython 3.11 keeps an
        # instance's attributes in a shared-key layout (the fast path of every attribute read on
        # the tick path) only up to 30 of them, and a 31st made every tick 10-15 % slower.
        self._overlap = (min(config.in_flight_window, config.max_in_flight), 0.0)
        self._update_pace()

    def tick(self, now: float, observation: Mapping[str, Any] | None = None, obs_time: float | None = None,
             state: np.ndarray | None = None) -> Command:
        """Produce this tick's command (exactly one) and, when due, a request to send.

        Args:
            now: the tick time, robot monotonic clock.
            observation: the latest observation; needed only when a request is due (a tick
                without one reports ``wants_observation`` instead).
            obs_time: when the observation was taken; defaults to ``now``.
            state: the robot's measured positions ``[A]`` (hold-and-resume checks it has held
                still); ``None``: the command stands for it.
        """
        self.stats.ticks += 1
        self._last_tick = now
        flights = self._flights
        # Flights are kept in send order: only when the oldest is overdue is any (O(1) per tick).
        if flights and now - next(iter(flights.values()))[0] > self.config.request_timeout_s:
            self._time_out(now)
        timeline = self.timeline
        k = timeline.lookup(now)
        dog = self.watchdog
        if isinstance(k, FallbackReason):
            action = dog.step(None, 0, self._cause(k))
        else:
            seq = timeline.row_seq(k)
            action = dog.step(timeline.row(k), seq, None)
            if dog.reason is FallbackReason.UNREACHABLE:
                self._unreachable(now, seq)
        # The watchdog's mode after the step says where this command came from (a resume that
        # completed this tick already reads POLICY: its last blend step is the policy action).
        mode = dog.mode
        chunk_id = latency = age = None
        due = math.nan
        if mode is not Mode.FALLBACK and not isinstance(k, FallbackReason):
            chunk_id, latency, _ = self._meta.get(timeline.row_seq(k), _NO_META)
            due = timeline.due(k)
            age = now - due
        self._fleet[1].update(now, dog.state.position if state is None else state, mode is Mode.FALLBACK, due)
        request = None
        wants = False
        if self._wants_request(now):
            if observation is None:
                wants = True
            else:
                request = self._issue(now, observation, now if obs_time is None else obs_time)
        elif observation is not None and (old := self._fleet[2].due(now, self._flights, self._fleet[0].saturated,
                                                                    self.latency.median)) is not None:
            intent = self._issue(now, observation, now if obs_time is None else obs_time)  # in the queued one's place
            request = self._queued = self._fleet[2].issued(now, intent, old)
        return Command(
            now,
            action,
            mode,
            dog.reason if mode is Mode.FALLBACK else None,
            chunk_id,
            age,
            latency,
            dog.verdict,
            request,
            wants,
        )

    def _time_out(self, now: float) -> None:
        limit = self.config.request_timeout_s
        for rid, (sent, _) in list(self._flights.items()):
            if now - sent > limit:
                del self._flights[rid]
                self._forget_round_trip(rid)
                self.stats.requests_timed_out += 1
        self._flights_changed()

    def _forget_round_trip(self, request_id: int) -> None:
        # A late answer still tells its observation time (the chunk's coverage), not a round trip.
        asked = self._asked.get(request_id)
        if asked is not None:
            self._asked[request_id] = (math.nan, asked[1])

    def _flights_changed(self) -> None:
        self._flights_obs = max((obs for _, obs in self._flights.values()), default=-math.inf)

    def _unreachable(self, now: float, seq: int) -> None:
        # The same observation would bring the same answer: ask again only unreachable_backoff_s
        # after the observation that brought this one (the watchdog wants a fresh chunk at once,
        # every tick or two). Counted from that observation, not from now: an answer asked a round
        # trip ago, before the fallback stopped the arm (a stall held it up), came from another
        # state than the one a request now would show, and waiting a backoff after it left the arm
        # held for nothing (at 300 ms one way: two such answers in a row, 0.5 s with no request).
        self.stats.unreachable_ticks += 1
        if seq != self._unreachable_seq:
            self._unreachable_seq = seq
            self.stats.chunks_unreachable += 1
            asked = self._meta.get(seq, _NO_META)[2]
            since = now if asked is None else min(now, asked)
            self._next_request_at = max(self._next_request_at, since + self.config.unreachable_backoff_s)

    def _cause(self, k: FallbackReason) -> FallbackReason:
        # The timeline says *what* is wrong (nothing due, stale, expired); when the link or the
        # server is why nothing fresh came, that is the more useful reason to report.
        if not self.connected:
            return FallbackReason.DISCONNECTED
        if self._error_pending:
            return FallbackReason.SERVER_ERROR
        return k

    def remaining(self, now: float) -> float:
        """Seconds until the timeline runs dry (negative or ``-inf`` when it already has)."""
        return self.timeline.valid_until - now

    def _wants_request(self, now: float) -> bool:
        flights = self._flights
        if now < self._next_request_at:
            return False
        if self._fleet[0].saturated:
            return self._wants_paced(now)
        window, dry_pace = self._overlap
        room = len(flights) < window
        if self._ask_again and room:
            return True
        replan = self.config.replan_interval_s
        if (replan is not None and room and now - self._last_sent >= replan
                and self.watchdog.mode is not Mode.FALLBACK):
            return True  # re-plan from a fresh observation at a steady cadence (reacts to the scene)
        if not flights:
            if self.watchdog.needs_fresh_chunk:
                return True
            if self._rtc and now - self._last_sent >= self._min_replan:
                # rtc re-plans continuously: the prefix keeps each chunk on the plan, so the next
                # request goes out as soon as the last answer is in and the execution horizon
                # (rtc_min_replan_s) since the last one has passed.
                return True
            # Ticks are discrete: waiting for the next one would leave one period less, so ask at
            # the last tick from which the answer still lands with the margin to spare.
            return self.timeline.valid_until - now < self._lead_base + self.latency.estimate
        coverage = self._coverage
        lead = self._lead_base + self.latency.estimate
        if self._rtc and room and self.watchdog.mode is not Mode.FALLBACK and now - self._last_sent >= self._pace:
            return True
        if room and self.watchdog.needs_fresh_chunk and len(self.latency) and now - self._last_sent >= dry_pace:
            # The fallback waits on requests in flight: on a stalled link (a lost segment holds
            # every byte behind it) their answers come late, planned from observations the stall
            # made old, often expired on arrival. Ask again from where the robot now stands, at a
            # typical round trip shared among the in-flight window (not before one is measured:
            # the same observation would fill every slot at start-up).
            return True
        # Overlapping requests keep the plan full only when a chunk covers more than a round
        # trip; otherwise they would go out every tick and not help: one at a time then.
        if len(flights) >= window or coverage is None or coverage <= lead:
            return False
        # The cadence follows: once a request is out, the plan counted ends at its observation
        # plus a chunk's coverage, so the next one goes out (coverage - round trip) later.
        planned = max(self.timeline.valid_until, self._flights_obs + coverage)
        return planned - now < lead

    def _wants_paced(self, now: float) -> bool:
        # The server is saturated: every request costs the fleet a batch slot. One in flight, never
        # re-asked while it may still arrive (a timeout or the server's refusal frees the slot).
        # Holding (the plan ran dry), ask from the held state: the answer resumes from its first
        # row (hold-and-resume), every row of it used. While the plan runs, prefetch only when
        # a chunk outlasts twice the lead: otherwise most of its rows are past when it lands.
        if self._flights:
            return False
        if self._ask_again or self.watchdog.needs_fresh_chunk:
            return True
        ahead = self._fleet[1].ahead_s  # its last rows (ticks jitter): the answer, planned after them, resumes
        if ahead and self.timeline.valid_until - now < ahead + 0.5 * self.config.control_period_s:
            return True
        coverage, lead = self._coverage, self._lead_base + self.latency.estimate
        return coverage is not None and coverage >= 2.0 * lead and self.timeline.valid_until - now < lead

    def _update_pace(self) -> None:
        # Their inputs change only when a chunk arrives: computed then, read on every tick (less a
        # round-off allowance: tick times are sums of float periods, and a pace of exactly N
        # periods must count as met at the Nth tick).
        cadence = self._cadence(self._coverage)
        if self._rtc:
            self._pace = cadence.rtc_pace - 1e-9
        if (hold := self._fleet[1]).ahead_s:  # how far ahead a paced request goes follows the round trip
            hold.ahead_s = paced_ahead_s(self.config.paced_lead_rows, self._coverage, self.latency, self.config.control_period_s)
        # The fallback's overlap (see _wants_request): a typical round trip shared among the window.
        self._overlap = (cadence.window, cadence.dry_pace - 1e-9)

    def _cadence(self, coverage: float | None) -> Cadence:
        """The in-flight window and the paces for the latency model now (:func:`.cadence.plan_cadence`)."""
        cfg = self.config
        lat = self.latency
        return plan_cadence(typical=lat.typical, expected=lat.estimate, coverage=coverage, lead=self._lead_base,
                            period=cfg.control_period_s, min_replan=self._min_replan if self._rtc else 0.0,
                            window=cfg.in_flight_window, max_window=cfg.max_in_flight, pace_share=_RTC_PACE_SHARE)

    def _issue(self, now: float, observation: Mapping[str, Any], obs_time: float) -> RequestIntent:
        cfg = self.config
        remaining = self.timeline.valid_until - now
        expected = self.latency.estimate
        if remaining >= expected and remaining > 0:
            budget = max(remaining, cfg.min_deadline_s)
        else:
            # It will run dry before any answer can come: a late chunk still ends the fallback
            # sooner than none, so give the server room instead of a budget it must refuse.
            budget = cfg.idle_deadline_s
        prefix = delay = None
        ahead = 0
        if cfg.send_prefix:
            in_flight_s = expected + cfg.prefetch_margin_s
            if self._rtc:
                # The whole rest of the plan: the policy freezes the rows that run while a typical
                # request is in flight and steers the rest of its chunk towards the others. Counted
                # from the typical round trip, not the tail: every frozen row is one the new
                # observation cannot change, and an answer later than that is faded in. In the
                # fallback the robot does not run the plan (it ran dry, or its action is out of
                # reach of the held command): no prefix, the policy plans from the observed state
                # (the plan as a prefix would ask it to continue what does not run, and, out of
                # reach, to stay out of reach: every answer refused in turn).
                running = self.watchdog.mode is not Mode.FALLBACK
                prefix = self.timeline.prefix(now, max(self.remaining(now), in_flight_s)) if running else None
                if prefix is not None:
                    typical_s = self.latency.typical + cfg.prefetch_margin_s
                    delay = min(len(prefix), max(1, math.ceil(typical_s / self.timeline.dt - 1e-9)))
                    ah = self._fleet[1].ahead_s  # asked ahead while paced: _wants_paced's rule, not a row count
                    if self._fleet[0].saturated and ah and remaining < ah + 0.5 * cfg.control_period_s:  # (ticks jitter)
                        delay = ahead = len(prefix)  # asked ahead while paced: all run before the answer
            else:
                prefix = self.timeline.prefix(now, in_flight_s)
                delay = None if prefix is None else len(prefix)
        self._ask_again = False
        # It will resume a hold: asked from one, or ahead of one while paced (after its frozen rows).
        holding = (self.watchdog.mode is Mode.FALLBACK or ahead > 0) and cfg.hold_tolerance is not None
        urgency = urgency_for(self._coverage, remaining, expected, cfg.control_period_s, holding, ahead)
        superseded = self._queued.request_id if self._queued is not None else None
        if superseded is not None:
            self.stats.requests_superseded += 1
        intent = RequestIntent(self._next_id, observation, obs_time, budget * 1000.0, prefix, now, superseded, delay, urgency)
        self._next_id += 1
        self._queued = intent
        k = self.timeline.lookup(now)  # the prefix's first row, when it has one
        self._queued_seq = (self._seq, self.timeline.due(k) if prefix is not None and isinstance(k, int) else math.nan)
        self.stats.requests_issued += 1
        if not self.connected:
            # While disconnected each send is a reconnection attempt: pace them.
            self._next_request_at = now + cfg.reconnect_interval_s
        return intent

    def on_sent(self, request_id: int, now: float) -> None:
        """The shell sent request ``request_id`` at ``now`` (starts its round-trip clock)."""
        obs_time = now
        delay = prefix = None
        if self._queued is not None and self._queued.request_id == request_id:
            obs_time, delay, prefix = self._queued.obs_time, self._queued.prefix_delay, self._queued.prefix
            self._queued = None
        self._flights[request_id] = (now, obs_time)
        self._flights_obs = max(self._flights_obs, obs_time)
        if self._rtc and delay is not None:
            self._frozen[request_id] = (delay, *self._queued_seq, prefix)
            if len(self._frozen) > _META_KEEP:
                self._frozen.pop(next(iter(self._frozen)))
        self._last_sent = now
        self._asked[request_id] = (now, obs_time)
        if len(self._asked) > _META_KEEP:
            self._asked.pop(next(iter(self._asked)))
        self.stats.requests_sent += 1

    def on_chunk(self, chunk: ActionChunk, now: float) -> MergeOutcome:
        """A chunk arrived at ``now``: measure the round trip and merge it into the timeline.

        Raises:
            ChunkError: the chunk's width differs from the broker's action dimension.
        """
        rid = chunk.request_id
        latency = obs_time = None
        if isinstance(rid, int):
            asked = self._asked.pop(rid, None)
            if asked is not None:
                obs_time = asked[1]
                if asked[0] == asked[0]:
                    latency = now - asked[0]
                    self.latency.add(latency)
            if self._flights.pop(rid, None) is not None:
                self._flights_changed()
            if obs_time is not None and math.isfinite(chunk.expiry):
                self._coverage = chunk.expiry - obs_time
        pacer, hold, refresher = self._fleet
        if self.config.pace_under_load:
            pacer.on_reply(chunk.timing)
            refresher.on_reply(chunk.timing)
        self._update_pace()
        self.connected = True  # a reply is proof of a working link
        self.stats.chunks_received += 1
        frozen_at = self._frozen.pop(rid, None) if isinstance(rid, int) else None
        late = False
        take_from = 0
        t_next = max(now, self._last_tick + self.config.control_period_s)
        if pacer.saturated and self.watchdog.mode is Mode.FALLBACK:
            # Hold-and-resume: nothing it planned from has changed on the robot's side (held since its
            # observation or its frozen prefix). With room the time-based rule stands (_wants_paced).
            frozen, _, prefix_due, sent = frozen_at if frozen_at is not None else (0, 0, math.nan, None)
            resumed = hold.resume(chunk, obs_time, frozen, sent, prefix_due, t_next)
            if resumed is not None:
                chunk, frozen_at = resumed, None  # not late: it starts where it was planned to
                self.stats.chunks_resumed += 1
        if frozen_at is not None and obs_time is not None:
            frozen, prefix_seq, _, _ = frozen_at
            # The prefix's row j runs at obs_time + j dt: the first row this chunk can play (at the
            # next tick) lies past the first one it planned itself when the answer took longer
            # than its frozen rows last (landing just as they end is on time: its own rows start
            # there, where they were planned to).
            first = math.floor((t_next - obs_time) / chunk.dt + 1e-9)
            late = first > frozen
            self.stats.rtc_late += late
            if not late and self.watchdog.mode is not Mode.FALLBACK:
                if self._seq != prefix_seq:
                    # Another chunk landed since the request took its prefix (requests overlap):
                    # its frozen rows are the plan as it was then and carry nothing new, while the
                    # plan now holds a newer observation's there. The plan runs on through them;
                    # this chunk takes over where its own planning starts. (When nothing landed
                    # since, its frozen rows are the plan's: taking it now or there gives the same
                    # commands.)
                    take_from = frozen
                    self.stats.rtc_deferred += 1
                elif first == frozen:
                    take_from = frozen  # its own rows start now: it agrees when its last frozen one is the plan's
        switch = self._switch_steps(chunk, now, late, take_from)
        if switch.kind is SwitchKind.FAR:
            # The policy changed its mind further than a smooth switch can follow: keep the plan
            # and ask again from where the robot now is (an answer from then agrees with it).
            self.stats.chunks_far += 1
            self._ask_again = True
            return MergeOutcome.FAR
        if switch.kind is SwitchKind.JOIN:
            self.stats.chunks_joined += 1
        elif switch.kind is SwitchKind.FADE:
            self.stats.chunks_faded += 1
        seq = self._seq + 1
        outcome = self.timeline.add(chunk, seq, now, switch.transition, tick=t_next, take_from=take_from)
        if outcome is MergeOutcome.MERGED:
            self._seq = seq
            self.watchdog.note_chunk(seq)
            self._error_pending = False
            self._meta[seq] = (rid, latency, obs_time)
            if len(self._meta) > _META_KEEP:
                self._meta.pop(next(iter(self._meta)))
            self.stats.chunks_merged += 1
        elif outcome is MergeOutcome.LATE:
            self.stats.chunks_late += 1
        elif outcome is MergeOutcome.EXPIRED:
            self.stats.chunks_expired += 1
        else:
            self.stats.chunks_out_of_order += 1
        return outcome

    def _switch_steps(self, chunk: ActionChunk, now: float, late: bool = False, take_from: int = 0) -> SwitchPlan:
        """How a switch to ``chunk`` goes (see :func:`.switching.plan_switch`), from the command
        state the watchdog holds before the next tick."""
        limits = self.limits
        if limits is None or self.watchdog.mode is Mode.FALLBACK or chunk.action_dim != self.action_dim:
            return AT_ONCE  # nothing to switch from, or nothing to keep within
        period = self.config.control_period_s
        state = self.watchdog.state
        at = SwitchState(t_next=max(now, self._last_tick + period), position=state.position, velocity=state.velocity,
                         resuming=self.watchdog.ramping, rtc=self._rtc,
                         expected_rtt=self.latency.estimate, remaining=self.remaining(now), reach=self.watchdog.reach)
        return plan_switch(chunk, at, self.timeline, limits, self.config, late=late, take_from=take_from)

    def on_error(
        self,
        now: float,
        *,
        request_id: int | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        """Request ``request_id`` failed (server error, timeout): back off, then ask again.

        Args:
            now: when the error arrived.
            request_id: the failed request (``None``: whichever is in flight).
            code: the server's error code, for the stats.
            retry_after_s: the server's hint for when to retry (overloaded, quota).
        """
        if (code := getattr(code, "value", code)) in REFRESH_CODES and request_id is not None:
            self._fleet[2].settle(str(code), request_id, self._flights, self._asked)  # a refresh settled: no error
            self._queued = None if self._queued is not None and self._queued.request_id == request_id else self._queued
            return self._flights_changed()
        if request_id is None:
            self._flights.clear()
        else:
            self._flights.pop(request_id, None)
            self._forget_round_trip(request_id)
        self._flights_changed()
        if self._queued is not None and self._queued.request_id == request_id:
            self._queued = None
        self._error_pending = True
        if self.config.pace_under_load:
            self._fleet[0].on_refusal(None if code is None else str(getattr(code, "value", code)), retry_after_s)
        wait = self.config.error_backoff_s if retry_after_s is None else max(0.0, float(retry_after_s))
        self._next_request_at = max(self._next_request_at, now + wait)
        self.stats.errors += 1
        self.stats.last_error_code = None if code is None else str(getattr(code, "value", code))

    def on_disconnect(self, now: float) -> None:
        """The link went down: nothing is in flight any more; retry every ``reconnect_interval_s``."""
        if self.connected:
            self.stats.disconnects += 1
        self.connected = False
        self._flights.clear()
        self._flights_changed()
        self._queued = None
        self._asked = {rid: (math.nan, obs) for rid, (_, obs) in self._asked.items()}
        self._next_request_at = max(self._next_request_at, now + self.config.reconnect_interval_s)

    def on_connect(self, now: float) -> None:
        """The link is up (again): requests may go out at once."""
        self.connected = True
        self._next_request_at = now

    def reset(self, position: ArrayLike) -> None:
        """Start a new episode at rest at ``position``: drop every action; the fallback holds
        until a chunk requested from now on arrives."""
        self.timeline.clear()
        self.watchdog.reset(position)
        self._queued = None
        self._error_pending = False

    @property
    def next_request_id(self) -> int:
        """The id the next request will get."""
        return self._next_id

    @property
    def in_flight(self) -> int | None:
        """The id of the newest request in flight, if any."""
        return next(reversed(self._flights), None) if self._flights else None

    @property
    def in_flight_window(self) -> int:
        """How many requests may be in flight now (widened from ``in_flight_window`` towards
        ``max_in_flight`` while the expected round trip nears a chunk's coverage)."""
        return self._overlap[0]

    @property
    def in_flight_ids(self) -> tuple[int, ...]:
        """The ids of every request in flight, oldest first."""
        return tuple(self._flights)

    @property
    def queued(self) -> RequestIntent | None:
        """The request issued but not yet reported sent, if any."""
        return self._queued

    @property
    def mode(self) -> Mode:
        """The watchdog's current mode."""
        return self.watchdog.mode
