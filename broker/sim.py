"""Discrete-event simulation of a robot control loop, a broker and a scripted fake server.

Everything runs on a simulated clock: ticks every control period, replies arriving after
scripted round trips, errors and outages at chosen times. It drives the sans-I/O
:class:`~chunkline.broker.Broker` exactly as a shell would, so it answers questions such as
"with this latency trace, how often does the robot run on a valid policy action?" in a
fraction of the real time, deterministically. The tests and ``bench/broker_bench.py`` use it.

The fake server is a :class:`ScriptedServer`: a policy function (observation, time, prefix
-> ``[H, A]`` actions), a round-trip function, and lists of outages and failing requests.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..safety.watchdog import Mode
from .chunk import ActionChunk
from .core import Broker, Command

__all__ = ["ReferencePolicy", "ScriptedServer", "SimResult", "simulate"]


class ReferencePolicy:
    """A stand-in policy: from the observed position, converge onto a reference trajectory.

    Action ``k`` of a chunk for an observation at ``obs_time`` is due at ``t_k = obs_time + k dt``;
    it moves from the observed command position towards ``reference(t_k)`` by at most
    ``step`` per action, so the first action is always near where the robot is (as a real
    policy's would be), and later ones follow the reference.

    Args:
        reference: ``reference(t) -> [A]`` target position at time ``t``.
        dt: spacing of the chunk's actions.
        horizon: actions per chunk.
        step: largest move per action towards the reference.
        state_key: the observation field holding the current position.
    """

    def __init__(self, reference: Callable[[float], np.ndarray], dt: float, horizon: int, step: float, state_key: str = "state") -> None:
        self.reference = reference
        self.dt = dt
        self.horizon = horizon
        self.step = step
        self.state_key = state_key

    def __call__(self, obs: Mapping[str, Any], obs_time: float, prefix: np.ndarray | None) -> np.ndarray:
        pos = np.asarray(obs[self.state_key], dtype=np.float64)
        out = np.empty((self.horizon, pos.shape[0]))
        for k in range(self.horizon):
            goal = np.asarray(self.reference(obs_time + k * self.dt), dtype=np.float64)
            pos = pos + np.clip(goal - pos, -self.step, self.step)
            out[k] = pos
        return out.astype(np.float32)


@dataclasses.dataclass
class ScriptedServer:
    """The fake server: what it answers, after how long, and when it fails.

    Args:
        policy: ``policy(obs, obs_time, prefix) -> [H, A]`` actions.
        dt: the chunks' ``dt``.
        latency: ``latency(i, t) -> seconds``: round trip of the ``i``-th request sent at ``t``.
        valid_for: seconds a chunk stays valid after its ``t0`` (``expires = t0 + valid_for``);
            ``None`` for ``H * dt``.
        outages: ``(start, end)`` intervals with the link down: replies due then are lost, the
            broker is told ``on_disconnect`` at ``start`` and ``on_connect`` at ``end``.
        fail: request indices (0-based) answered with a server error instead of a chunk.
        corrupt: ``corrupt(i, actions) -> actions`` to tamper with request ``i``'s chunk
            (inject NaN, huge values...); ``None`` leaves them alone.
    """

    policy: Callable[[Mapping[str, Any], float, np.ndarray | None], np.ndarray]
    dt: float
    latency: Callable[[int, float], float]
    valid_for: float | None = None
    outages: Sequence[tuple[float, float]] = ()
    fail: frozenset[int] | set[int] = frozenset()
    corrupt: Callable[[int, np.ndarray], np.ndarray] | None = None

    def down(self, t: float) -> bool:
        """Whether the link is down at ``t``."""
        return any(a <= t < b for a, b in self.outages)


@dataclasses.dataclass
class SimResult:
    """Per-tick arrays of one simulation, and the broker after it.

    Args:
        times: tick times ``[N]``.
        actions: commands sent ``[N, A]``.
        modes: the command's mode per tick.
        reasons: the fallback reason per tick (``None`` in policy mode).
        ages: action age per tick (NaN in fallback).
        requests: ticks that issued a request.
        broker: the broker (its stats, latency window, watchdog counters).
    """

    times: np.ndarray
    actions: np.ndarray
    modes: list[Mode]
    reasons: list[str | None]
    ages: np.ndarray
    requests: np.ndarray
    broker: Broker

    @property
    def policy_fraction(self) -> float:
        """Fraction of ticks whose command was a valid policy action (policy or blending in)."""
        return sum(m is not Mode.FALLBACK for m in self.modes) / max(1, len(self.modes))

    def fallback_ticks(self, start: float = -math.inf, end: float = math.inf) -> int:
        """Ticks in ``[start, end)`` on the fallback."""
        return sum(1 for t, m in zip(self.times, self.modes, strict=False) if start <= t < end and m is Mode.FALLBACK)


def simulate(
    broker: Broker,
    server: ScriptedServer,
    *,
    duration_s: float,
    start_s: float = 0.0,
    observe: Callable[[float, np.ndarray], Mapping[str, Any]] | None = None,
    on_tick: Callable[[Command], None] | None = None,
) -> SimResult:
    """Run ``broker`` against ``server`` for ``duration_s`` simulated seconds.

    Each period: deliver every event due by now (replies, link changes) at its own time,
    then tick the broker with an observation of the current command position, and send the
    request it asks for.

    Args:
        broker: the broker (its config's ``control_period_s`` sets the tick rate).
        server: the scripted fake server.
        duration_s: simulated seconds.
        start_s: simulated clock at the first tick.
        observe: ``observe(t, last_command) -> observation``; default ``{"state": last_command}``.
        on_tick: called with every command (for extra checks).
    """
    period = broker.config.control_period_s
    n = int(round(duration_s / period))
    a = broker.action_dim
    times = np.empty(n)
    actions = np.empty((n, a))
    ages = np.full(n, math.nan)
    requests = np.zeros(n, dtype=bool)
    modes: list[Mode] = []
    reasons: list[str | None] = []
    events: list[tuple[float, int, str, Any]] = []
    order = 0
    for lo, hi in server.outages:
        heapq.heappush(events, (lo, order, "down", None))
        heapq.heappush(events, (hi, order + 1, "up", None))
        order += 2
    sent_count = 0
    last = broker.watchdog.state.position.copy()
    for i in range(n):
        now = start_s + i * period
        while events and events[0][0] <= now:
            t, _, kind, payload = heapq.heappop(events)
            if kind == "down":
                broker.on_disconnect(t)
            elif kind == "up":
                broker.on_connect(t)
            elif server.down(t):
                continue  # the reply was lost with the link
            elif kind == "chunk":
                broker.on_chunk(payload, t)
            elif kind == "error":
                broker.on_error(t, request_id=payload, code="policy_failed")
        obs = observe(now, last) if observe is not None else {"state": last}
        cmd = broker.tick(now, obs)
        last = np.array(cmd.action)
        times[i] = now
        actions[i] = cmd.action
        modes.append(cmd.mode)
        reasons.append(None if cmd.reason is None else cmd.reason.value)
        if cmd.action_age_s is not None:
            ages[i] = cmd.action_age_s
        if on_tick is not None:
            on_tick(cmd)
        intent = cmd.request
        if intent is None:
            continue
        if intent.replaces is not None:
            # Every request runs at once here (its latency is the whole round trip): none is queued to refresh.
            broker.on_error(now, request_id=intent.request_id, code="replace_missed")
            continue
        requests[i] = True
        if server.down(now):
            broker.on_disconnect(now)  # the send itself fails: the link is still down
            continue
        broker.on_sent(intent.request_id, now)
        idx = sent_count
        sent_count += 1
        arrival = now + float(server.latency(idx, now))
        if idx in server.fail:
            heapq.heappush(events, (arrival, order, "error", intent.request_id))
        else:
            acts = np.asarray(server.policy(intent.observation, intent.obs_time, intent.prefix), dtype=np.float32)
            if server.corrupt is not None:
                acts = np.asarray(server.corrupt(idx, acts.copy()), dtype=np.float32)
            h = acts.shape[0]
            valid_for = server.valid_for if server.valid_for is not None else h * server.dt
            chunk = ActionChunk(acts, intent.obs_time, server.dt, intent.obs_time + valid_for, intent.request_id, arrival)
            heapq.heappush(events, (arrival, order, "chunk", chunk))
        order += 1
    return SimResult(times, actions, modes, reasons, ages, requests, broker)
