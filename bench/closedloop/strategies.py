"""Three ways a robot consumes action chunks from a remote policy, as sans-I/O objects.

Each sees the same events (request sent, chunk arrived, request failed, link down or up) and
yields one :class:`Step` per control tick, so :mod:`.des` and :mod:`.realtime` drive all alike:
:class:`SyncStrategy` (openpi's ask-and-block ``ActionChunkBroker``), :class:`IndexStrategy`
(LeRobot's step-indexed queue, indices standing in for time) and :class:`ChunklineStrategy`
(chunkline's time-stamped :class:`~chunkline.broker.Broker` with its safety filter and
fallback). Every request is a :class:`~chunkline.broker.RequestIntent`; :class:`FilteredStrategy`
runs another strategy's commands through chunkline's safety filter, so comparisons measure
timing and merging alone. docs/closed_loop.md describes each pattern.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.broker import ActionChunk, Broker, BrokerConfig, RequestIntent
from chunkline.safety.fallback import FallbackBehaviour
from chunkline.safety.filter import FilterMode, SafetyFilter
from chunkline.safety.limits import Limits, MotionState
from chunkline.safety.watchdog import Mode

__all__ = [
    "STRATEGIES",
    "Step",
    "Strategy",
    "SyncStrategy",
    "IndexStrategy",
    "ChunklineStrategy",
    "FilteredStrategy",
    "FILTERED_INDEX",
    "make_strategy",
]

#: the strategy names, in the order reports list them.
STRATEGIES: tuple[str, ...] = ("sync", "index", "chunkline")
#: LeRobot's pattern with every command through chunkline's safety filter (clamp), so that a
#: comparison with chunkline measures timing and merging, not the filter.
FILTERED_INDEX = "index-filtered"


@dataclasses.dataclass(slots=True)
class Step:
    """What one tick produced.

    Args:
        action: the command for the actuators, or ``None`` for none (the servo holds).
        source: ``policy``, ``resuming``, ``fallback`` or ``hold`` (no command).
        due: the due time (``t0 + k dt``) of the policy action executed, if one was.
        chunk_id: the request id of that action's chunk.
        request: a request to send now, if any.
    """

    action: np.ndarray | None
    source: str
    due: float | None = None
    chunk_id: int | str | None = None
    request: RequestIntent | None = None


class Strategy(abc.ABC):
    """The common interface (sans-I/O: every method takes the time).

    Args:
        action_dim: ``A``.
        deadline_ms: the deadline budget sent with each request (the chunkline strategy
            computes its own).
        request_timeout_s: a request unanswered this long counts as lost.
        retry_s: wait after an error or a disconnection before asking again.
    """

    name: str = "strategy"

    def __init__(self, action_dim: int, *, deadline_ms: float = 1000.0, request_timeout_s: float = 2.0,
                 retry_s: float = 0.1) -> None:
        self.action_dim = action_dim
        self.deadline_ms = deadline_ms
        self.request_timeout_s = request_timeout_s
        self.retry_s = retry_s
        self._next_id = 1
        self.in_flight: int | None = None
        self._sent_at = 0.0
        self._queued: int | None = None
        self._retry_at = -math.inf
        self.connected = True
        self.requests = 0
        self.chunks = 0
        self.errors = 0

    def _request(self, now: float, observation: Mapping[str, Any]) -> RequestIntent:
        intent = RequestIntent(self._next_id, observation, now, self.deadline_ms, None, now)
        self._next_id += 1
        self._queued = intent.request_id
        self.requests += 1
        return intent

    def _can_ask(self, now: float) -> bool:
        if self.in_flight is not None and now - self._sent_at > self.request_timeout_s:
            self.in_flight = None  # lost: the client gave up on it
        return self.in_flight is None and self._queued is None and now >= self._retry_at

    @abc.abstractmethod
    def tick(self, now: float, observation: Mapping[str, Any]) -> Step:
        """This tick's step.

        Args:
            now: the tick time, robot clock.
            observation: the current observation (sent when a request is due).
        """

    def on_sent(self, request_id: int, now: float) -> None:
        """Request ``request_id`` went out at ``now``."""
        if self._queued == request_id:
            self._queued = None
        self.in_flight = request_id
        self._sent_at = now

    def on_chunk(self, chunk: ActionChunk, now: float) -> None:
        """A chunk arrived at ``now``."""
        if chunk.request_id == self.in_flight:
            self.in_flight = None
        self.connected = True
        self.chunks += 1
        self._accept(chunk, now)

    @abc.abstractmethod
    def _accept(self, chunk: ActionChunk, now: float) -> None:
        """Take a chunk in."""

    def on_error(self, now: float, *, request_id: int | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        """Request ``request_id`` failed."""
        if request_id is None or request_id == self.in_flight:
            self.in_flight = None
        if self._queued == request_id:
            self._queued = None
        self.errors += 1
        self._retry_at = now + (self.retry_s if retry_after_s is None else retry_after_s)

    def on_disconnect(self, now: float) -> None:
        """The link went down (what was in flight is lost)."""
        self.connected = False
        self.in_flight = None
        self._queued = None
        self._retry_at = now + self.retry_s

    def on_connect(self, now: float) -> None:
        """The link is up again."""
        self.connected = True
        self._retry_at = now

    @property
    def stats(self) -> dict[str, Any]:
        """Counters for reports."""
        return {"requests": self.requests, "chunks": self.chunks, "errors": self.errors}

    @property
    def interventions(self) -> int:
        """Commands a safety filter changed (0 for strategies without one)."""
        return 0


class SyncStrategy(Strategy):
    """openpi's pattern: block, execute ``action_horizon`` actions from the first, re-query.

    Args:
        action_dim: ``A``.
        action_horizon: actions of each chunk executed before asking again (openpi's ALOHA
            real-robot example: 25 of 50).
        **kwargs: see :class:`Strategy`.
    """

    name = "sync"

    def __init__(self, action_dim: int, *, action_horizon: int = 25, **kwargs: Any) -> None:
        super().__init__(action_dim, **kwargs)
        self.action_horizon = action_horizon
        self._chunk: ActionChunk | None = None
        self._k = 0

    def tick(self, now: float, observation: Mapping[str, Any]) -> Step:
        chunk = self._chunk
        if chunk is not None and self._k < min(self.action_horizon, chunk.horizon):
            k = self._k
            self._k += 1
            if self._k >= min(self.action_horizon, chunk.horizon):
                self._chunk = None  # used up: the next tick asks (and blocks)
            return Step(np.asarray(chunk.actions[k], dtype=np.float64), "policy", chunk.due_time(k), chunk.request_id)
        request = self._request(now, observation) if self._can_ask(now) else None
        return Step(None, "hold", request=request)

    def _accept(self, chunk: ActionChunk, now: float) -> None:
        self._chunk = chunk
        self._k = 0


class IndexStrategy(Strategy):
    """LeRobot's async pattern: a queue of step-indexed actions, re-query below a threshold.

    Args:
        action_dim: ``A``.
        horizon: actions per chunk (the queue's "chunk size").
        threshold: send a new observation when the queue holds at most this fraction of a chunk
            (LeRobot's ``chunk_size_threshold``, 0.5 by default).
        aggregate: ``weighted_average`` (0.3 old + 0.7 new) or ``latest_only``.
        **kwargs: see :class:`Strategy`.
    """

    name = "index"

    def __init__(self, action_dim: int, *, horizon: int = 50, threshold: float = 0.5,
                 aggregate: str = "weighted_average", **kwargs: Any) -> None:
        super().__init__(action_dim, **kwargs)
        if aggregate not in ("weighted_average", "latest_only"):
            raise ValueError(f"aggregate must be weighted_average or latest_only, got {aggregate!r}")
        self.horizon = horizon
        self.threshold = threshold
        self.aggregate = aggregate
        self.latest = -1  # index of the last executed action
        self._queue: dict[int, tuple[np.ndarray, float, int | str | None]] = {}
        self._obs_index: dict[int | str, int] = {}  # request id -> the observation's step index

    def tick(self, now: float, observation: Mapping[str, Any]) -> Step:
        # LeRobot's loop: perform the next action if there is one, then send an observation
        # if the queue is at or below the threshold.
        step = Step(None, "hold")
        if self._queue:
            index = min(self._queue)
            action, due, chunk_id = self._queue.pop(index)
            self.latest = index
            step = Step(action, "policy", due, chunk_id)
        if len(self._queue) / self.horizon <= self.threshold and self._can_ask(now):
            step.request = self._request(now, observation)
            self._obs_index[step.request.request_id] = max(self.latest, 0)
            if len(self._obs_index) > 64:
                self._obs_index.pop(next(iter(self._obs_index)))
        return step

    def _accept(self, chunk: ActionChunk, now: float) -> None:
        base = self._obs_index.pop(chunk.request_id, max(self.latest, 0)) if chunk.request_id is not None else max(self.latest, 0)
        for i in range(chunk.horizon):
            index = base + i
            if index <= self.latest:
                continue  # already executed: LeRobot drops it (by index, not by time)
            new = np.asarray(chunk.actions[i], dtype=np.float64)
            old = self._queue.get(index)
            if old is not None and self.aggregate == "weighted_average":
                new = 0.3 * old[0] + 0.7 * new
            self._queue[index] = (new, chunk.due_time(i), chunk.request_id)

    @property
    def queue_size(self) -> int:
        """Actions waiting."""
        return len(self._queue)


class ChunklineStrategy(Strategy):
    """chunkline's broker (the same :class:`~chunkline.broker.Broker` the robot runs).

    Args:
        action_dim: ``A``.
        broker: the broker (built by :func:`make_strategy`).
    """

    name = "chunkline"

    def __init__(self, action_dim: int, *, broker: Broker, **kwargs: Any) -> None:
        super().__init__(action_dim, **kwargs)
        self.broker = broker

    def tick(self, now: float, observation: Mapping[str, Any]) -> Step:
        cmd = self.broker.tick(now, observation)
        due = None if cmd.action_age_s is None else now - cmd.action_age_s
        request = cmd.request
        if request is not None and request.replaces is not None:
            # One robot: its request runs at once, nothing queues to refresh (the server answers replace_missed).
            self.broker.on_error(now, request_id=request.request_id, code="replace_missed")
            request = None
        if request is not None:
            self.requests += 1
        return Step(np.asarray(cmd.action), cmd.mode.value, due, cmd.chunk_id, request)

    def on_sent(self, request_id: int, now: float) -> None:
        self.broker.on_sent(request_id, now)

    def on_chunk(self, chunk: ActionChunk, now: float) -> None:
        self.chunks += 1
        self.broker.on_chunk(chunk, now)

    def _accept(self, chunk: ActionChunk, now: float) -> None:  # pragma: no cover - on_chunk overrides
        self.broker.on_chunk(chunk, now)

    def on_error(self, now: float, *, request_id: int | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        self.errors += 1
        self.broker.on_error(now, request_id=request_id, code=code, retry_after_s=retry_after_s)

    def on_disconnect(self, now: float) -> None:
        self.broker.on_disconnect(now)

    def on_connect(self, now: float) -> None:
        self.broker.on_connect(now)

    @property
    def interventions(self) -> int:
        counts = self.broker.watchdog.filter_counts
        return 0 if counts is None else int(counts.clamped + counts.rejected)

    @property
    def in_fallback(self) -> bool:
        """Whether the watchdog runs the fallback now."""
        return self.broker.mode is Mode.FALLBACK

    @property
    def stats(self) -> dict[str, Any]:
        out = super().stats
        counts = self.broker.watchdog.filter_counts
        out.update(broker=self.broker.stats.as_dict(), watchdog=self.broker.watchdog.counts.as_dict(),
                   filter=None if counts is None else counts.as_dict())
        return out


class FilteredStrategy(Strategy):
    """Another strategy with each of its commands through chunkline's :class:`SafetyFilter`
    (clamp mode; a tick without a command holds the last one, as the servo would).

    Args:
        inner: the strategy whose commands are filtered.
        limits: the robot's limits.
        initial_position: the first command state.
    """

    def __init__(self, inner: Strategy, limits: Limits, initial_position: np.ndarray) -> None:
        super().__init__(inner.action_dim)
        self.inner = inner
        self.name = f"{inner.name}-filtered"
        self.filter = SafetyFilter(limits, FilterMode.CLAMP)
        self.state = MotionState.at_rest(initial_position)
        self.dt = limits.dt

    def tick(self, now: float, observation: Mapping[str, Any]) -> Step:
        step = self.inner.tick(now, observation)
        target = self.state.position if step.action is None else np.asarray(step.action, dtype=np.float64)
        cmd, _ = self.filter.apply(target, self.state)
        if cmd is None:  # a non-finite action: hold
            cmd = self.state.position.copy()
        self.state = self.state.advanced(cmd, self.dt)
        step.action = None if step.action is None and np.array_equal(cmd, target) else cmd
        return step

    def on_sent(self, request_id: int, now: float) -> None:
        self.inner.on_sent(request_id, now)

    def on_chunk(self, chunk: ActionChunk, now: float) -> None:
        self.inner.on_chunk(chunk, now)

    def _accept(self, chunk: ActionChunk, now: float) -> None:  # pragma: no cover - on_chunk delegates
        self.inner.on_chunk(chunk, now)

    def on_error(self, now: float, *, request_id: int | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        self.inner.on_error(now, request_id=request_id, code=code, retry_after_s=retry_after_s)

    def on_disconnect(self, now: float) -> None:
        self.inner.on_disconnect(now)

    def on_connect(self, now: float) -> None:
        self.inner.on_connect(now)

    @property
    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats, "filter": self.filter.counts.as_dict()}

    @property
    def interventions(self) -> int:
        return int(self.filter.counts.clamped + self.filter.counts.rejected)


def make_strategy(
    name: str,
    *,
    action_dim: int,
    horizon: int,
    limits: Limits,
    initial_position: np.ndarray,
    config: BrokerConfig | None = None,
    fallback: FallbackBehaviour | None = None,
    action_horizon: int | None = None,
    threshold: float = 0.5,
    request_timeout_s: float = 2.0,
) -> Strategy:
    """Build one of :data:`STRATEGIES` for a robot.

    Args:
        name: ``sync``, ``index`` or ``chunkline``.
        action_dim: ``A``.
        horizon: actions per chunk.
        limits: the robot's limits (the chunkline broker enforces them).
        initial_position: where the robot starts.
        config: the chunkline broker's settings (default: ``BrokerConfig`` at the limits' period).
        fallback: the chunkline broker's fallback (default: hold).
        action_horizon: ``sync``: actions executed per chunk (default: half the chunk).
        threshold: ``index``: the queue fraction that triggers a request.
        request_timeout_s: a request unanswered this long is given up.

    Raises:
        KeyError: unknown strategy.
    """
    if name == "sync":
        return SyncStrategy(action_dim, action_horizon=action_horizon or max(1, horizon // 2), request_timeout_s=request_timeout_s)
    if name == "index":
        return IndexStrategy(action_dim, horizon=horizon, threshold=threshold, request_timeout_s=request_timeout_s)
    if name == FILTERED_INDEX:
        inner = IndexStrategy(action_dim, horizon=horizon, threshold=threshold, request_timeout_s=request_timeout_s)
        return FilteredStrategy(inner, limits, initial_position)
    if name == "chunkline":
        cfg = config or BrokerConfig(control_period_s=limits.dt, request_timeout_s=request_timeout_s)
        broker = Broker(cfg, initial_position=initial_position, limits=limits, fallback=fallback)
        return ChunklineStrategy(action_dim, broker=broker, request_timeout_s=request_timeout_s)
    raise KeyError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
