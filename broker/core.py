"""The sans-I/O broker core: timeline + prefetch + watchdog, driven by an injected clock.

One object, no sockets, no threads, no sleeps. The shells (:mod:`chunkline.broker.shells`,
:mod:`chunkline.broker.openpi_compat`) move data between it and a client::

    broker = Broker(BrokerConfig(control_period_s=0.02), limits=limits, initial_position=q0)
    every period:
        cmd = broker.tick(now, observation)        # exactly one command per tick
        actuators.send(cmd.action)
        if cmd.request: send it, then broker.on_sent(cmd.request.request_id, t_sent)
    on a reply:        broker.on_chunk(ActionChunk.from_reply(chunk, received_at=t, request_id=...), t)
    on a server error: broker.on_error(t, request_id=..., code=..., retry_after_s=...)
    on the link:       broker.on_disconnect(t) / broker.on_connect(t)

**Prefetch.** A request is wanted when the timeline's remaining valid time falls below the
expected round trip (the p95 of the last measured ones) plus a margin plus one control period
(the next tick would be too late), so that the next chunk lands at least the margin before
the current one runs out; or at once when the timeline is dry or the watchdog
waits for a fresh chunk. At most one request is in flight. A request that was issued but not
yet sent is superseded by a newer one (newer observation) at the next tick that still wants
one. Each request carries the deadline budget (the time until the timeline runs dry, or
``idle_deadline_s`` when it will run dry before any answer could come) and optionally the
prefix: the actions that will run while it is in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..safety.fallback import FallbackBehaviour
from ..safety.filter import Verdict
from ..safety.limits import ArrayLike, Limits
from ..safety.watchdog import FallbackReason, Mode, Watchdog
from .chunk import ActionChunk
from .config import BrokerConfig
from .exceptions import BrokerConfigError
from .latency import LatencyWindow
from .timeline import MergeOutcome, Timeline

__all__ = ["RequestIntent", "Command", "BrokerStats", "Broker"]

_META_KEEP = 64  # chunk metadata kept for the per-tick record (chunk id, round trip)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestIntent:
    """"Send this observation with this deadline and prefix": what the shell should send.

    Args:
        request_id: the broker's id for it (pass it back in :meth:`Broker.on_sent` and in the chunk).
        observation: the observation to send (as handed to :meth:`Broker.tick`).
        obs_time: when it was taken, robot clock (the chunk's ``t0`` derives from it).
        deadline_ms: the budget: how long the robot can wait for the answer.
        prefix: ``[P, A]`` float32 actions that will run while the request is in flight, or ``None``.
        created_at: the tick time that produced it.
        supersedes: the id of an unsent request this one replaces, if any.
        prefix_delay: how many of the prefix's first rows run before the answer is expected
            (frozen for a real-time-chunking policy); ``None`` without a prefix.
    """

    request_id: int
    observation: Mapping[str, Any]
    obs_time: float
    deadline_ms: float
    prefix: np.ndarray | None
    created_at: float
    supersedes: int | None = None
    prefix_delay: int | None = None

    def __repr__(self) -> str:
        prefix = None if self.prefix is None else list(self.prefix.shape)
        return (f"RequestIntent(request_id={self.request_id}, obs_time={self.obs_time:.6f}, deadline_ms={self.deadline_ms:.1f}, "
                f"observation=[{', '.join(self.observation)}], prefix={prefix}, supersedes={self.supersedes})")


@dataclasses.dataclass(slots=True)
class Command:
    """What one tick produced.

    Args:
        time: the tick time.
        action: the command to send to the actuators ``[A]`` (float64, read-only).
        mode: ``policy``, ``resuming`` (blending back in) or ``fallback``.
        reason: why the fallback runs (``None`` in policy mode).
        chunk_id: request id of the chunk whose action was used (``None`` in fallback).
        action_age_s: how late that action is (``now - due``).
        latency_s: measured round trip of that chunk.
        verdict: what the safety filter did with the policy action (``None`` in fallback).
        request: a request the shell should send now, if any.
        wants_observation: a request is due but no observation was given to this tick.
    """

    time: float
    action: np.ndarray
    mode: Mode
    reason: FallbackReason | None
    chunk_id: int | str | None
    action_age_s: float | None
    latency_s: float | None
    verdict: Verdict | None
    request: RequestIntent | None
    wants_observation: bool = False

    def __repr__(self) -> str:
        # Short on purpose: the request holds the whole observation, which a log line must not dump.
        action = np.array2string(np.asarray(self.action), precision=3, threshold=8, max_line_width=10_000)
        request = "None" if self.request is None else f"#{self.request.request_id}"
        reason = None if self.reason is None else getattr(self.reason, "value", self.reason)
        mode = getattr(self.mode, "value", self.mode)
        return (f"Command(time={self.time:.6f}, mode={mode}, reason={reason}, chunk_id={self.chunk_id!r}, "
                f"action={action}, request={request})")


@dataclasses.dataclass
class BrokerStats:
    """Counters of the broker core (mutable, updated in place)."""

    ticks: int = 0
    chunks_received: int = 0
    chunks_merged: int = 0
    chunks_late: int = 0
    chunks_expired: int = 0
    chunks_out_of_order: int = 0
    requests_issued: int = 0
    requests_superseded: int = 0
    requests_sent: int = 0
    requests_timed_out: int = 0
    errors: int = 0
    disconnects: int = 0
    #: chunks whose action was too far from the held command to hand back to the policy, and the
    #: fallback ticks that caused (the command's reason reads ``unreachable`` then)
    chunks_unreachable: int = 0
    unreachable_ticks: int = 0
    last_error_code: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict."""
        return dataclasses.asdict(self)


class Broker:
    """Timeline, prefetch and safety for one robot (sans-I/O; every method takes ``now``).

    Args:
        config: broker settings.
        initial_position: the actuators' position at start ``[A]``.
        limits: safety limits (``limits.dt`` must equal ``config.control_period_s``);
            ``None`` runs without limit enforcement (non-finite actions are still refused).
        fallback: the fallback behaviour (default: hold); verified at construction.
        verify_fallback: run start-up verification (leave on outside tests that build many brokers).
        connected: whether the link is up at start.
        first_request_id: the id of the first request (ids then count up); a shell that
            replaces its broker starts the new one past the old ids so late replies to the old
            one's requests cannot be mistaken for the new one's.

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
            lead_s=config.lead_s,
        )
        self.latency = LatencyWindow(config.latency_window, config.latency_quantile, config.initial_latency_s)
        self.stats = BrokerStats()
        self.connected = connected
        self._next_id = int(first_request_id)
        self._seq = 0
        self._queued: RequestIntent | None = None
        self._in_flight: int | None = None
        self._in_flight_since = 0.0
        self._sent_at: dict[int | str, float] = {}
        self._next_request_at = -math.inf
        self._error_pending = False
        self._unreachable_seq = 0  # the newest chunk refused as out of reach
        self._meta: dict[int, tuple[int | str | None, float | None]] = {}
        self._lead_base = config.prefetch_margin_s + config.control_period_s

    # ------------------------------------------------------------------ per tick

    def tick(self, now: float, observation: Mapping[str, Any] | None = None, obs_time: float | None = None) -> Command:
        """Produce this tick's command (exactly one) and, when due, a request to send.

        Args:
            now: the tick time, robot monotonic clock.
            observation: the latest observation; needed only when a request is due (a tick
                without one reports ``wants_observation`` instead).
            obs_time: when the observation was taken; defaults to ``now``.
        """
        self.stats.ticks += 1
        if self._in_flight is not None and now - self._in_flight_since > self.config.request_timeout_s:
            self._sent_at.pop(self._in_flight, None)
            self._in_flight = None
            self.stats.requests_timed_out += 1
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
        if mode is not Mode.FALLBACK and not isinstance(k, FallbackReason):
            chunk_id, latency = self._meta.get(timeline.row_seq(k), (None, None))
            age = now - timeline.due(k)
        request = None
        wants = False
        if self._wants_request(now):
            if observation is None:
                wants = True
            else:
                request = self._issue(now, observation, now if obs_time is None else obs_time)
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

    def _unreachable(self, now: float, seq: int) -> None:
        # The same observation would bring the same answer: ask again only after
        # unreachable_backoff_s (the watchdog wants a fresh chunk at once, every tick or two).
        self.stats.unreachable_ticks += 1
        if seq != self._unreachable_seq:
            self._unreachable_seq = seq
            self.stats.chunks_unreachable += 1
            self._next_request_at = max(self._next_request_at, now + self.config.unreachable_backoff_s)

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
        if self._in_flight is not None or now < self._next_request_at:
            return False
        if self.watchdog.needs_fresh_chunk:
            return True
        # Ticks are discrete: waiting for the next one would leave one period less, so ask at
        # the last tick from which the answer still lands with the margin to spare.
        return self.timeline.valid_until - now < self._lead_base + self.latency.estimate

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
        prefix = None
        if cfg.send_prefix:
            prefix = self.timeline.prefix(now, expected + cfg.prefetch_margin_s)
        superseded = self._queued.request_id if self._queued is not None else None
        if superseded is not None:
            self.stats.requests_superseded += 1
        intent = RequestIntent(self._next_id, observation, obs_time, budget * 1000.0, prefix, now, superseded)
        self._next_id += 1
        self._queued = intent
        self.stats.requests_issued += 1
        if not self.connected:
            # While disconnected each send is a reconnection attempt: pace them.
            self._next_request_at = now + cfg.reconnect_interval_s
        return intent

    # ------------------------------------------------------------------ events from the shell

    def on_sent(self, request_id: int, now: float) -> None:
        """The shell sent request ``request_id`` at ``now`` (starts its round-trip clock)."""
        if self._queued is not None and self._queued.request_id == request_id:
            self._queued = None
        self._in_flight = request_id
        self._in_flight_since = now
        self._sent_at[request_id] = now
        if len(self._sent_at) > _META_KEEP:
            self._sent_at.pop(next(iter(self._sent_at)))
        self.stats.requests_sent += 1

    def on_chunk(self, chunk: ActionChunk, now: float) -> MergeOutcome:
        """A chunk arrived at ``now``: measure the round trip and merge it into the timeline.

        Raises:
            ChunkError: the chunk's width differs from the broker's action dimension.
        """
        rid = chunk.request_id
        sent = self._sent_at.pop(rid, None) if rid is not None else None
        latency = None
        if sent is not None:
            latency = now - sent
            self.latency.add(latency)
        if self._in_flight is not None and self._in_flight == rid:
            self._in_flight = None
        self.connected = True  # a reply is proof of a working link
        self.stats.chunks_received += 1
        seq = self._seq + 1
        outcome = self.timeline.add(chunk, seq, now)
        if outcome is MergeOutcome.MERGED:
            self._seq = seq
            self.watchdog.note_chunk(seq)
            self._error_pending = False
            self._meta[seq] = (rid, latency)
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
        if request_id is None or request_id == self._in_flight:
            self._in_flight = None
        if request_id is not None:
            self._sent_at.pop(request_id, None)
        if self._queued is not None and self._queued.request_id == request_id:
            self._queued = None
        self._error_pending = True
        wait = self.config.error_backoff_s if retry_after_s is None else max(0.0, float(retry_after_s))
        self._next_request_at = max(self._next_request_at, now + wait)
        self.stats.errors += 1
        self.stats.last_error_code = None if code is None else str(getattr(code, "value", code))

    def on_disconnect(self, now: float) -> None:
        """The link went down: nothing is in flight any more; retry every ``reconnect_interval_s``."""
        if self.connected:
            self.stats.disconnects += 1
        self.connected = False
        self._in_flight = None
        self._queued = None
        self._sent_at.clear()
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

    # ------------------------------------------------------------------ introspection

    @property
    def next_request_id(self) -> int:
        """The id the next request will get."""
        return self._next_id

    @property
    def in_flight(self) -> int | None:
        """The id of the request in flight, if any."""
        return self._in_flight

    @property
    def queued(self) -> RequestIntent | None:
        """The request issued but not yet reported sent, if any."""
        return self._queued

    @property
    def mode(self) -> Mode:
        """The watchdog's current mode."""
        return self.watchdog.mode
