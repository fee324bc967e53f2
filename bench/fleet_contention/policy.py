"""The latency-curve policy: a batch takes the workload's measured latency for its size.

``chunkline serve --policy chunkline.bench.fleet_contention.policy:latency_curve --policy-arg
curve_ms=73,109.8,142.4 --policy-arg horizon=10``. Its chunk moves the robot: row ``k`` is the
observed ``state`` plus ``(k + 1) * step``, so a robot that runs a chunk leaves the state it was
planned from (hold-and-resume applies only to a robot that held still).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chunkline.policies.base import ArraySpec, Policy, PolicySpec, make_fingerprint
from chunkline.policies.exceptions import PolicyConfigError
from chunkline.policies.numpy_backend import batch_size_of
from chunkline.policies.prefix import PrefixBatch

__all__ = ["LatencyCurvePolicy", "latency_curve", "planned_rows", "STEP"]

#: how far one row moves each joint (action units)
STEP = 0.01


def planned_rows(state: np.ndarray, horizon: int, frozen: np.ndarray | None = None) -> np.ndarray:
    """A chunk ``[horizon, A]`` from the observed ``state`` ``[A]``: the ``frozen`` prefix rows
    ``[d, A]`` as they are, then a ramp of ``STEP`` per row from the last of them (from ``state``
    without a prefix)."""
    d = 0 if frozen is None else min(len(frozen), horizon)
    start = state if d == 0 or frozen is None else frozen[d - 1]
    rows = np.empty((horizon, state.shape[-1]), dtype=np.float64)
    if d and frozen is not None:
        rows[:d] = frozen[:d]
    rows[d:] = np.asarray(start, dtype=np.float64)[None, :] + STEP * np.arange(1, horizon - d + 1)[:, None]
    return rows


class LatencyCurvePolicy(Policy):
    """Takes ``curve_s[B - 1]`` for a batch of ``B`` (the last entry beyond the curve): it plans
    its rows, then sleeps what is left of that time (the planning is part of the latency, not
    added to it).

    Args:
        curve_s: seconds per batch size 1, 2, ...
        horizon: rows per chunk. dt: seconds between rows. action_dim: width of ``state`` and actions.
        sleep: the blocking call (injectable). clock: the clock its time is counted on (injectable).
    """

    def __init__(self, curve_s: Sequence[float], *, horizon: int, dt: float, action_dim: int = 2,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter) -> None:
        if not curve_s or not all(c >= 0 for c in curve_s) or horizon < 1 or not dt > 0:
            raise PolicyConfigError("a latency curve needs non-negative latencies, horizon >= 1 and dt > 0")
        self.name = "latency-curve"
        self.curve_s = tuple(float(c) for c in curve_s)
        self.spec = PolicySpec(observation={"state": ArraySpec((action_dim,), "float32")}, action_dim=action_dim,
                               horizon=horizon, dt=dt)
        self._sleep = sleep
        self._clock = clock
        self._fingerprint = make_fingerprint(weights="none", backend="latency-curve", versions={}, precision="float32",
                                             device="cpu", spec=self.spec, settings={"curve_s": list(self.curve_s)})

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    accepts_prefix = True

    def infer_batch_with_prefix(self, obs: Mapping[str, Any], prefix: PrefixBatch,
                                states: Sequence[Any] | None) -> tuple[np.ndarray, list[Any] | None]:
        started = self._clock()
        b = batch_size_of(obs)
        state = np.asarray(obs["state"], dtype=np.float64).reshape(b, -1)
        h = self.spec.horizon
        out = np.stack([planned_rows(state[i], h, prefix.actions[i, : int(prefix.delay[i])]) for i in range(b)]).astype(np.float32)
        self._take(b, started)
        return out, None if states is None else list(states)

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        started = self._clock()
        b = batch_size_of(obs)
        state = np.asarray(obs["state"], dtype=np.float32).reshape(b, 1, -1)
        ramp = (np.arange(1, self.spec.horizon + 1, dtype=np.float32) * STEP)[None, :, None]
        out = state + ramp
        self._take(b, started)
        return out

    def _take(self, b: int, started: float) -> None:
        """Sleep until a batch of ``b`` begun at ``started`` has taken its latency."""
        left = self.curve_s[min(b, len(self.curve_s)) - 1] - (self._clock() - started)
        if left > 0:
            self._sleep(left)

    def warmup(self) -> None:
        """Nothing to warm."""


def latency_curve(curve_ms: str = "73,109.8,142.4,177.5,211.1", horizon: int = 10, dt: float = 0.05,
                  action_dim: int = 2) -> LatencyCurvePolicy:
    """The ``module:factory`` entry: ``curve_ms`` comma-separated milliseconds per batch size."""
    curve = [float(x) / 1000.0 for x in str(curve_ms).split(",") if x.strip()]
    return LatencyCurvePolicy(curve, horizon=int(horizon), dt=float(dt), action_dim=int(action_dim))
