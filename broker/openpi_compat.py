"""A drop-in for openpi-client's ``ActionChunkBroker``, deadline-aware underneath.

Import it from ``chunkline.broker.openpi_compat`` instead of ``openpi_client.action_chunk_broker``
and keep ``ActionChunkBroker(policy, action_horizon)``, ``infer(obs) -> dict`` and ``reset()``.
Underneath, chunks are placed on the robot's clock (the step returned is the one due now, not
replayed from the past), the next chunk is asked for in a background thread before the current
one runs out, and when nothing valid is due ``infer`` returns the fallback (hold the last command,
or with ``limits`` a verified safe behaviour). As openpi's, only the first ``action_horizon`` steps
of a chunk are used and the first call blocks. ``dt`` comes from the argument, the limits, the
reply, or the interval between the first two calls."""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..safety.fallback import FallbackBehaviour
from ..safety.limits import ArrayLike, Limits
from .chunk import ActionChunk
from .config import BrokerConfig, MergeMode
from .core import Broker, Command, RequestIntent
from .exceptions import BrokerConfigError, ChunkError, FirstChunkTimeout
from .shells import RequestWorker, apply_event

__all__ = ["ActionChunkBroker"]


class ActionChunkBroker:
    """openpi's ``ActionChunkBroker`` interface with timeline, prefetch and fallback underneath.

    Its attributes are openpi's constructor arguments as given plus the broker and loop it drives
    underneath; openpi's interface fixes the arguments.

    Args:
        policy: an openpi-style policy: ``infer(obs) -> {"actions": [H, A], ...}`` (and
            optionally ``reset()``), e.g. ``WebsocketClientPolicy``.
        action_horizon: steps of each chunk that may be used (openpi's meaning).
        dt: seconds between steps; see the module docstring for the default.
        limits: safety limits (positions); enables the filter and the verified fallback.
            Requires ``initial_position`` or ``state_key``.
        initial_position: the robot's position at the first call.
        state_key: observation key holding the robot's current position (read at the first
            call and after :meth:`reset`).
        fallback: the fallback behaviour (default: hold).
        config: broker settings; ``control_period_s`` is set from ``dt``.
        clock: the robot's monotonic clock.
        first_chunk_timeout_s: how long the first call waits for the first chunk.
        info_key: key under which each result carries the broker's view of the step
            (mode, reason, age); ``None`` leaves the result exactly openpi-shaped.

    Raises:
        BrokerConfigError: ``limits`` without ``initial_position`` or ``state_key``.
    """

    def __init__(
        self,
        policy: Any,
        action_horizon: int,
        *,
        dt: float | None = None,
        limits: Limits | None = None,
        initial_position: ArrayLike | None = None,
        state_key: str | None = None,
        fallback: FallbackBehaviour | None = None,
        config: BrokerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_chunk_timeout_s: float = 60.0,
        info_key: str | None = "chunkline",
    ) -> None:
        if action_horizon < 1:
            raise BrokerConfigError("action_horizon must be >= 1")
        if limits is not None and initial_position is None and state_key is None:
            raise BrokerConfigError("with limits, give initial_position or state_key (the robot's position)")
        if dt is not None and limits is not None and not math.isclose(dt, limits.dt, rel_tol=1e-9):
            raise BrokerConfigError(f"dt ({dt}) differs from limits.dt ({limits.dt})")
        self._policy = policy
        self._action_horizon = int(action_horizon)
        self._dt = dt if dt is not None else (limits.dt if limits is not None else None)
        self._limits = limits
        self._initial = initial_position
        self._state_key = state_key
        self._fallback = fallback
        self._config = config
        self._clock = clock
        self._first_timeout = first_chunk_timeout_s
        self._info_key = info_key
        self._core: Broker | None = None
        self._first: tuple[float, dict[str, Any], np.ndarray | None] | None = None
        self._epoch_first_id = 1  # requests below this id belong to an earlier episode
        self._next_id = 1
        self._extras: dict[str, Any] = {}
        self._dtype: np.dtype[Any] = np.dtype(np.float32)
        self._raw_id: int | None = None  # the request whose raw result the first call waits for
        self._raw: Any = None
        self._first_rtt = math.nan
        self._lock = threading.Lock()
        self._worker = RequestWorker(self._request, clock, name="chunkline-openpi-requests")

    # ------------------------------------------------------------------ openpi interface

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Return the action due now (``{"actions": [A], ...}``), requesting chunks as needed.

        Raises:
            FirstChunkTimeout: the first chunk did not come within ``first_chunk_timeout_s``.
            Exception: whatever the policy raised for the first request.
        """
        now = self._clock()
        if self._core is None:
            first = self._first
            if first is None:
                result = self._fetch_first(obs, now)
                position = self._position(obs)
                self._first = first = (now, result, position)
                if self._dt is None and not _has_dt(result):
                    # dt is measured from the next call: serve step 0 now, as openpi does.
                    return self._output_raw(result, 0)
            self._start_core(now, first)
        core = self._core
        assert core is not None
        for event in self._worker.drain():
            if self._current(event):
                apply_event(core, event)
        cmd = core.tick(now, obs)
        if cmd.request is not None:
            self._worker.submit(cmd.request)
        return self._output(cmd)

    def reset(self) -> None:
        """Start a new episode: reset the policy; the next ``infer`` fetches a fresh chunk (blocking)."""
        reset = getattr(self._policy, "reset", None)
        if callable(reset):
            reset()
        with self._lock:
            if self._core is not None:
                self._next_id = max(self._next_id, self._core.next_request_id)
            self._core = None
            self._first = None
            self._epoch_first_id = self._next_id  # late replies to older requests are dropped
            self._extras = {}

    def close(self) -> None:
        """Stop the background request thread."""
        self._worker.close()

    @property
    def broker(self) -> Broker | None:
        """The broker core (``None`` until the first chunk is placed)."""
        return self._core

    # ------------------------------------------------------------------ internals

    def _take_id(self) -> int:
        if self._core is not None:
            self._next_id = max(self._next_id, self._core.next_request_id)
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            return rid

    def _current(self, event: tuple[Any, ...]) -> bool:
        rid = _event_id(event)
        return rid is None or (isinstance(rid, int) and rid >= self._epoch_first_id)

    def _request(self, intent: RequestIntent) -> ActionChunk:
        try:
            result = self._policy.infer(dict(intent.observation))
        except BaseException as exc:
            if intent.request_id == self._raw_id:
                self._raw = exc
            raise
        if intent.request_id == self._raw_id:
            self._raw = result
        return self._to_chunk(result, intent.obs_time, intent.request_id, self._clock())

    def _to_chunk(self, result: dict[str, Any], obs_time: float, request_id: int, received_at: float) -> ActionChunk:
        actions = np.asarray(result["actions"])
        if actions.ndim == 1:
            actions = actions[np.newaxis]
        actions = actions[: self._action_horizon]
        dt = float(result["dt"]) if _has_dt(result) else self._dt
        if dt is None:
            dt = 1.0  # only while dt is still being measured; the chunk is rebuilt once it is known
        # The chunk is due from the observation's capture time (the tick), which is what the
        # actions were computed for; a reply's own t0 may be a little later (stamped at send).
        t0 = obs_time
        expires = t0 + actions.shape[0] * dt
        r_t0, r_exp = result.get("t0"), result.get("expires")
        if isinstance(r_t0, (int, float)) and isinstance(r_exp, (int, float)) and math.isfinite(r_t0) and math.isfinite(r_exp):
            expires = min(expires, t0 + (r_exp - r_t0))
        self._dtype = actions.dtype if actions.dtype.kind == "f" else np.dtype(np.float32)
        self._extras = {k: v for k, v in result.items() if k not in _TIMELINE_KEYS and not _per_step(v)}
        return ActionChunk(actions, t0, dt, expires, request_id, received_at)

    def _fetch_first(self, obs: dict[str, Any], now: float) -> dict[str, Any]:
        # Through the worker thread like every request, so the policy is never used from two
        # threads at once (openpi's websocket client is not thread-safe).
        rid = self._take_id()
        self._raw_id, self._raw = rid, None
        self._worker.submit(RequestIntent(rid, obs, now, self._first_timeout * 1000.0, None, now))
        give_up = time.monotonic() + self._first_timeout
        while True:
            left = give_up - time.monotonic()
            try:
                event = self._worker.events.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise FirstChunkTimeout(f"no first chunk within {self._first_timeout} s") from None
            if _event_id(event) != rid or event[0] == "sent":
                continue  # a late event of an earlier episode, or the send itself
            raw, self._raw_id, self._raw = self._raw, None, None
            if isinstance(raw, BaseException):
                raise raw
            if event[0] != "chunk" or not isinstance(raw, dict):
                raise ChunkError(f"the first reply could not be used ({event[0]}: {event[3] if len(event) > 3 else ''})")
            self._first_rtt = event[1] - now
            return raw

    def _position(self, obs: dict[str, Any]) -> np.ndarray | None:
        if self._initial is not None:
            return np.asarray(self._initial, dtype=np.float64).reshape(-1)
        if self._state_key is not None:
            return np.asarray(obs[self._state_key], dtype=np.float64).reshape(-1)
        return None

    def _start_core(self, now: float, first: tuple[float, dict[str, Any], np.ndarray | None]) -> None:
        t_first, result, position = first
        if self._dt is None and not _has_dt(result):
            self._dt = max(now - t_first, 1e-4)  # measured: one control step
        chunk = self._to_chunk(result, t_first, self._next_id - 1, now)
        dt = chunk.dt
        if position is None:
            position = chunk.actions[0].astype(np.float64)  # position actions start where the robot is
        # An openpi policy plans from the observation alone (no prefix): ``replace``, one request
        # per chunk, as openpi's broker (rtc's continuous re-planning would call it every few steps).
        replace = MergeMode.REPLACE
        default = (BrokerConfig(control_period_s=dt, resume_steps=1, merge=replace) if self._limits is None
                   else BrokerConfig(control_period_s=dt, merge=replace))
        base = self._config or default
        # An openpi policy is called one request at a time and knows no replacement: never refreshed.
        config = dataclasses.replace(base, control_period_s=self._limits.dt if self._limits is not None else dt,
                                     refresh_queued=False)
        core = Broker(
            config,
            initial_position=position,
            limits=self._limits,
            fallback=self._fallback,
            first_request_id=self._next_id,
        )
        core.on_chunk(chunk, now)
        core.latency.add(self._first_rtt)
        self._core = core

    def _output_raw(self, result: dict[str, Any], k: int) -> dict[str, Any]:
        out = dict(self._extras)
        actions = np.asarray(result["actions"])
        out["actions"] = np.array(actions[k] if actions.ndim > 1 else actions)
        if self._info_key is not None:
            out[self._info_key] = {"mode": "policy", "reason": None, "action_age_s": 0.0, "chunk_id": None}
        return out

    def _output(self, cmd: Command) -> dict[str, Any]:
        out = dict(self._extras)
        out["actions"] = np.array(cmd.action, dtype=self._dtype)  # a writable copy, as openpi returns
        if self._info_key is not None:
            out[self._info_key] = {
                "mode": cmd.mode.value,
                "reason": None if cmd.reason is None else cmd.reason.value,
                "action_age_s": cmd.action_age_s,
                "chunk_id": cmd.chunk_id,
            }
        return out


_TIMELINE_KEYS = frozenset({"actions", "t0", "dt", "expires"})


def _has_dt(result: dict[str, Any]) -> bool:
    dt = result.get("dt")
    return isinstance(dt, (int, float)) and math.isfinite(dt) and dt > 0


def _per_step(value: Any) -> bool:
    # Per-step arrays other than the actions are not carried (the timeline holds actions only).
    return isinstance(value, np.ndarray) and value.ndim >= 1



def _event_id(event: tuple[Any, ...]) -> Any:
    kind = event[0]
    if kind == "chunk":
        return event[2].request_id
    return event[2] if len(event) > 2 else None
