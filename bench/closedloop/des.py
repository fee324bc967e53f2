"""Discrete-event mode: a robot, a network and a server on a simulated clock.

Time, network delay and inference time are injected: the robot ticks every control period,
requests and replies cross two :class:`~chunkline.bench.faultproxy.Direction` schedules (the
fault proxy's own core, so both modes share the scenarios), the server runs the policy in
this process and answers ``infer_s`` later. The strategy objects are the same ones the
real-time mode drives (for chunkline: the same :class:`~chunkline.broker.Broker`); only the
clock is simulated. Fast and deterministic: for sweeps and tests.

Events follow :mod:`chunkline.broker.sim`'s rules: each tick first delivers every event due
by then, at its own time (replies, timeouts, link changes), then observes, ticks the strategy,
sends the command and any request. A ``reset`` outage tells the strategy ``on_disconnect`` at
its start (what was in flight is lost; sends during it fail at once) and ``on_connect`` at its
end; a ``blackhole`` outage only delays (TCP retransmissions), so the client's timeouts are
what notice it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chunkline.broker import ActionChunk, BrokerConfig
from chunkline.policies.base import Policy, stack_observations, validate_observation
from chunkline.policies.prefix import ActionPrefix, PrefixBatch, stack_prefixes

from ..faultproxy import Direction, LinkFaults, Outage, Scenario
from .metrics import EpisodeMeter, EpisodeResult
from .strategies import ChunklineStrategy, Strategy, make_strategy
from .tasks import Task

__all__ = ["Conditions", "LocalServer", "default_broker_config", "run_des_episode", "run_des", "CLIENT_SLACK_S"]

#: the client waits this long past a request's deadline before giving up (broker.shells' default).
CLIENT_SLACK_S = 0.5


@dataclasses.dataclass(frozen=True)
class Conditions:
    """The network and the server between the robot and the policy.

    Args:
        delay_s: one-way delay, each direction.
        jitter_s: delay jitter (uniform +-), each direction, never reordering.
        bandwidth_mbps: a bandwidth cap, each direction (``None``: none).
        stall_rate_hz: random stalls (loss + retransmission) per second, each direction.
        stall_s: how long a stall holds the bytes.
        outages: outages of both directions (times from the episode's start).
        infer_s: the server's inference time per request (``None``: the policy's own, measured).
        label: a name for reports.
    """

    delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_mbps: float | None = None
    stall_rate_hz: float = 0.0
    stall_s: float = 0.2
    outages: tuple[Outage, ...] = ()
    infer_s: float | None = None
    label: str = ""

    def faults(self) -> LinkFaults:
        """One direction's faults."""
        return LinkFaults(delay_s=self.delay_s, jitter_s=self.jitter_s,
                          bandwidth_bps=None if self.bandwidth_mbps is None else self.bandwidth_mbps * 1e6,
                          stall_rate_hz=self.stall_rate_hz, stall_s=self.stall_s)

    @property
    def name(self) -> str:
        """The label, or one made from the settings."""
        if self.label:
            return self.label
        parts = [f"delay={self.delay_s * 1000:g}ms"]
        if self.jitter_s:
            parts.append(f"jitter={self.jitter_s * 1000:g}ms")
        for o in self.outages:
            parts.append(f"{o.mode}={o.duration:g}s@{o.start:g}s")
        return " ".join(parts)


class LocalServer:
    """The policy run in this process, as the server would run it: validate, stack, infer.

    Args:
        policy: a loaded policy (e.g. ``load_policy("reach-expert")``).
        record: called with every request's stacked batch, its prefixes on the chunk's grid
            (``None`` for a policy without) and the answer ``[1, H, A]`` (training on what the
            broker asks: :func:`~.train_common.collect_served`).
    """

    def __init__(self, policy: Policy, record: Callable[[Mapping[str, Any], PrefixBatch | None, np.ndarray], None] | None = None) -> None:
        self.policy = policy
        self.spec = policy.spec
        self.record = record

    @property
    def accepts_prefix(self) -> bool:
        """Whether the policy takes the robot's prefix (real-time chunking)."""
        return self.policy.accepts_prefix

    def infer(self, observation: Mapping[str, Any], prefix: np.ndarray | None = None, prefix_delay: int | None = None,
              obs_time: float | None = None) -> np.ndarray:
        """The chunk ``[H, A]`` for one observation (and the robot's prefix, for a policy that
        takes one: checked and placed on the chunk's grid as the server does)."""
        obs = validate_observation(self.spec, observation)
        batch = stack_observations(self.spec, [obs])
        stacked = None
        if not self.policy.accepts_prefix:
            actions = self.policy.infer_batch(batch)
        else:
            spec = self.spec
            item = None if prefix is None else ActionPrefix.from_wire(
                prefix, t0=obs_time, dt=spec.dt, action_dim=spec.action_dim, horizon=spec.horizon, delay_steps=prefix_delay)
            stacked = stack_prefixes([item], horizon=spec.horizon, action_dim=spec.action_dim, action_offset=spec.action_offset)
            actions, _ = self.policy.infer_batch_with_prefix(batch, stacked, None)
        if self.record is not None:
            self.record(batch, stacked, np.asarray(actions))
        return np.asarray(actions[0], dtype=np.float32)


def default_broker_config(period: float, horizon: int, *, request_timeout_s: float = 2.0) -> BrokerConfig:
    """The chunkline broker's settings in the benchmark: the defaults (replace merge, prefetch
    when the timeline holds less than the p95 round trip plus 20 ms plus a period), with 25
    resume steps (0.5 s) instead of 10: a chunk that arrives while the robot waits in the
    fallback was planned from where the robot stood a round trip ago and has moved on (up to
    ~1.4 rad at 300 ms for these experts), more than 10 steps may cover within the limits.

    Re-planning as soon as each chunk lands (a prefetch margin of half a chunk) was tried and
    is worse: a new plan from a round-trip-old observation every round trip is delayed
    feedback at a high rate, and the arm oscillates (reach: 3/8 successes at 100 ms). ``rtc``
    re-plans that way and does not oscillate: the prefix keeps each chunk on the plan.

    Args:
        period: the control period.
        horizon: actions per chunk (unused by these settings; kept for other policies).
        request_timeout_s: a request unanswered this long is given up.
    """
    return BrokerConfig(control_period_s=period, request_timeout_s=request_timeout_s, reconnect_interval_s=0.25,
                        resume_steps=25)


def _nbytes(observation: Mapping[str, Any]) -> int:
    return 256 + sum(v.nbytes for v in observation.values() if isinstance(v, np.ndarray))


def run_des_episode(
    task: Task,
    strategy: str | Strategy,
    server: LocalServer,
    conditions: Conditions,
    *,
    seed: int,
    broker_config: BrokerConfig | None = None,
    keep_timeline: bool = False,
    infer_s: float | None = None,
) -> EpisodeResult:
    """Run one episode of ``task`` driven through ``strategy`` by ``server``'s policy.

    Args:
        task: the simulated robot (reset here with ``seed``).
        strategy: a strategy name (built here for the robot) or an instance.
        server: the policy.
        conditions: network and server conditions.
        seed: the episode's seed (the task's randomisation and the network's draws).
        broker_config: the chunkline broker's settings (default: :func:`default_broker_config`).
        keep_timeline: keep per-tick arrays in the result.
        infer_s: the server's inference time when ``conditions.infer_s`` is ``None``
            (default: 5 ms).
    """
    q0 = task.reset(seed)
    task.reaction_allowance_s = 2.0 * conditions.delay_s
    limits = task.limits()
    period = task.period
    # The served policy's chunk: what the index pattern's queue and sync's half chunk count.
    spec = getattr(server, "spec", None)
    horizon = int(spec.horizon) if spec is not None else task.horizon
    config = broker_config or default_broker_config(period, horizon)
    if isinstance(strategy, str):
        strat = make_strategy(strategy, action_dim=task.action_dim, horizon=horizon, limits=limits,
                              initial_position=q0, config=config)
    else:
        strat = strategy
    scenario = Scenario(conditions.outages)
    up = Direction(conditions.faults(), scenario, seed=2 * seed + 1)
    down = Direction(conditions.faults(), scenario, seed=2 * seed + 2)
    service = conditions.infer_s if conditions.infer_s is not None else (0.005 if infer_s is None else infer_s)
    meter = EpisodeMeter(limits, q0, keep_timeline=keep_timeline, scene_changes=tuple(getattr(task, "scene_changes", ())),
                         switches_from_s=getattr(task, "acquire_s", 0.0), hand_back_ticks=config.resume_steps)
    events: list[tuple[float, int, str, Any]] = []
    order = 0
    for o in scenario.outages:
        if o.mode == "reset":
            heapq.heappush(events, (o.start, order, "down", None))
            heapq.heappush(events, (o.end, order + 1, "up", None))
            order += 2
    pending: dict[int, float] = {}  # request id -> client timeout; replies to others are dropped
    server_free = -math.inf
    n = int(round(task.episode_s / period))
    for i in range(n):  # bounded: one pass per control tick
        now = i * period
        while events and events[0][0] <= now:
            t, _, kind, payload = heapq.heappop(events)
            if kind == "down":
                pending.clear()  # the connection and everything on it is gone
                strat.on_disconnect(t)
            elif kind == "up":
                strat.on_connect(t)
            elif kind == "chunk":
                if payload.request_id in pending:
                    del pending[payload.request_id]
                    strat.on_chunk(payload, t)
            elif kind == "error":
                rid, code = payload
                if rid in pending:
                    del pending[rid]
                    strat.on_error(t, request_id=rid, code=code)
            elif kind == "timeout":
                if payload in pending:
                    del pending[payload]
                    strat.on_error(t, request_id=payload, code="timeout")
        valid_until = strat.broker.timeline.valid_until if isinstance(strat, ChunklineStrategy) else math.nan
        obs = task.observe()
        step = strat.tick(now, obs)
        meter.record(now, step, task.error(), valid_until)
        intent = step.request
        task.step(step.action)
        if intent is None:
            continue
        active = scenario.active(now)
        if active is not None and active.mode == "reset":
            strat.on_disconnect(now)  # the send fails: the connection is refused
            continue
        strat.on_sent(intent.request_id, now)
        timeout = now + intent.deadline_ms / 1000.0 + CLIENT_SLACK_S
        pending[intent.request_id] = timeout
        heapq.heappush(events, (timeout, order, "timeout", intent.request_id))
        order += 1
        arrive = up.schedule(now, _nbytes(intent.observation))
        if arrive is None:
            continue  # lost with a reset connection: the "down" event tells the strategy
        if service * 1000.0 > intent.deadline_ms:
            # The server predicts it cannot meet the deadline and refuses at once.
            back = down.schedule(arrive, 128)
            if back is not None:
                heapq.heappush(events, (back, order, "error", (intent.request_id, "deadline_unmeetable")))
                order += 1
            continue
        start = max(arrive, server_free)
        done = start + service
        server_free = done
        if intent.prefix is not None and getattr(server, "accepts_prefix", False):
            actions = server.infer(intent.observation, intent.prefix, intent.prefix_delay, intent.obs_time)
        else:
            actions = server.infer(intent.observation)
        back = down.schedule(done, actions.nbytes + 256)
        if back is None:
            continue
        spec = server.spec
        t0 = intent.obs_time + spec.action_offset
        chunk = ActionChunk(actions, t0, spec.dt, t0 + spec.validity, intent.request_id, back)
        heapq.heappush(events, (back, order, "chunk", chunk))
        order += 1
    outcome = task.outcome()
    interventions = strat.interventions
    return meter.result(task=task.name, strategy=strat.name, mode="des", label=conditions.name, seed=seed,
                        outcome=outcome, interventions=interventions, stats=strat.stats)


def run_des(
    task: Task,
    strategies: Sequence[str],
    server: LocalServer,
    conditions: Conditions,
    seeds: Sequence[int],
    **kwargs: Any,
) -> list[EpisodeResult]:
    """:func:`run_des_episode` for every strategy and seed (same seeds: same episodes)."""
    return [run_des_episode(task, s, server, conditions, seed=seed, **kwargs) for s in strategies for seed in seeds]
