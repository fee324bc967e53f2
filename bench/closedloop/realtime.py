"""Real-time mode: the robot in this process, the policy in a ``chunkline serve`` process, and a
fault proxy process relaying the TCP stream between them.

The robot's control loop runs on the wall clock (:class:`~chunkline.broker.SyncRunner`); its
requests go out from a worker thread (:class:`~chunkline.broker.RequestWorker`) through a
blocking :class:`~chunkline.client.Client`, exactly as
:class:`~chunkline.broker.SyncBrokerLoop` does, so every strategy is driven the same way.
Physics advances one control period per tick (more when the loop overran), so simulated time
follows the wall clock. Outages are scheduled on the proxy relative to the episode's start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from chunkline.broker import BrokerConfig, RequestWorker, SyncRunner, TickInfo
from chunkline.broker.shells import client_request
from chunkline.client import Client

from ..faultproxy import FaultProxy
from .des import Conditions, default_broker_config
from .metrics import EpisodeMeter, EpisodeResult
from .strategies import ChunklineStrategy, Strategy, make_strategy
from .tasks import Task

__all__ = ["apply_worker_event", "run_realtime_episode", "run_realtime", "proxy_settings"]


def apply_worker_event(strategy: Strategy, event: tuple[Any, ...]) -> None:
    """Apply one :class:`~chunkline.broker.RequestWorker` event to a strategy, at its time."""
    kind, t = event[0], event[1]
    if kind == "sent":
        strategy.on_sent(event[2], t)
    elif kind == "chunk":
        strategy.on_chunk(event[2], t)
    elif kind == "error":
        strategy.on_error(t, request_id=event[2], code=event[3], retry_after_s=event[4])
    elif kind == "disconnect":
        strategy.on_disconnect(t)


def proxy_settings(conditions: Conditions) -> dict[str, Any]:
    """The proxy's per-direction settings for ``conditions`` (outages are scheduled apart)."""
    doc: dict[str, Any] = {"delay_ms": conditions.delay_s * 1000.0, "jitter_ms": conditions.jitter_s * 1000.0,
                           "stall_rate_hz": conditions.stall_rate_hz, "stall_ms": conditions.stall_s * 1000.0}
    if conditions.bandwidth_mbps is not None:
        doc["bandwidth_mbps"] = conditions.bandwidth_mbps
    return doc


def run_realtime_episode(
    task: Task,
    strategy: str,
    proxy: FaultProxy,
    conditions: Conditions,
    *,
    seed: int,
    broker_config: BrokerConfig | None = None,
    keep_timeline: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> EpisodeResult:
    """Run one episode over the real network through ``proxy``.

    Args:
        task: the simulated robot (reset here with ``seed``).
        strategy: ``sync``, ``index`` or ``chunkline``.
        proxy: a running fault proxy in front of the server (its faults are set here).
        conditions: the network conditions (``infer_s`` does not apply: the server is real).
        seed: the episode's seed.
        broker_config: the chunkline broker's settings (default: :func:`~.des.default_broker_config`).
        keep_timeline: keep per-tick arrays.
        clock: the robot's monotonic clock.
    """
    proxy.set(up=proxy_settings(conditions), down=proxy_settings(conditions))
    q0 = task.reset(seed)
    task.reaction_allowance_s = 2.0 * conditions.delay_s
    limits = task.limits()
    period = task.period
    config = broker_config or default_broker_config(period, task.horizon)
    strat = make_strategy(strategy, action_dim=task.action_dim, horizon=task.horizon, limits=limits,
                          initial_position=q0, config=config)
    meter = EpisodeMeter(limits, q0, keep_timeline=keep_timeline, hand_back_ticks=config.resume_steps)
    client = Client(proxy.uri, connect_timeout=1.0, open_timeout=1.0)
    worker = RequestWorker(client_request(client, clock), clock, name=f"closedloop-{strategy}")
    n = int(round(task.episode_s / period))
    started: list[float] = []

    def step(info: TickInfo) -> bool:
        if not started:
            started.append(info.started)
            for o in conditions.outages:
                proxy.outage(o.duration, o.mode, start_in=o.start)
        for event in worker.drain():
            apply_worker_event(strat, event)
        now = info.started
        valid_until = strat.broker.timeline.valid_until if isinstance(strat, ChunklineStrategy) else math.nan
        obs = task.observe()
        out = strat.tick(now, obs)
        meter.record(now, out, task.error(), valid_until)
        task.step(out.action, periods=1 + info.skipped)
        if out.request is not None:
            worker.submit(out.request)
        return not task.done

    try:
        stats = SyncRunner(period, clock=clock).run(step, max_ticks=n)
    finally:
        worker.close(timeout=3.0)
        client.close()
    interventions = 0
    if isinstance(strat, ChunklineStrategy):
        fc = strat.broker.watchdog.filter_counts
        interventions = 0 if fc is None else fc.clamped + fc.rejected
    result = meter.result(task=task.name, strategy=strat.name, mode="realtime", label=conditions.name, seed=seed,
                          outcome=task.outcome(), interventions=interventions, stats=strat.stats,
                          time_offset=started[0] if started else 0.0)
    result.details["jitter"] = stats.summary()
    return result


def run_realtime(task: Task, strategies: Sequence[str], proxy: FaultProxy, conditions: Conditions,
                 seeds: Sequence[int], **kwargs: Any) -> list[EpisodeResult]:
    """:func:`run_realtime_episode` for every strategy and seed."""
    return [run_realtime_episode(task, s, proxy, conditions, seed=seed, **kwargs) for s in strategies for seed in seeds]
