"""How many replicas the fleet should run (sans-I/O).

:meth:`Autoscaler.observe` takes the replicas' states and returns a :class:`ScaleDecision`. Signals
from ready replicas: **utilisation** (load over raw capacity at the deadline; warming or requested
replicas count as capacity coming, so nothing is asked for twice) and **pressure** (load-weighted
queue-wait p99 or miss rate over their targets; adds a replica only while none is coming). Up needs
utilisation over the target (or pressure) for ``upscale_delay_s``, at most ``step`` at once; down
needs, for ``downscale_delay_s``, no pressure, nothing coming and utilisation without the drained
replica under ``target * (1 - hysteresis)``, one at a time. The band and the timer resets keep it
from flapping."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkline.server.cluster.placement import ReplicaState, capacity_rps

__all__ = ["AutoscaleConfig", "ScaleReason", "ScaleDecision", "Autoscaler"]


class AutoscaleConfig(BaseModel):
    """Autoscaling settings.

    Args:
        min_replicas: never fewer.
        max_replicas: never more.
        target_queue_wait_s: queue-wait p99 above which the fleet is under pressure.
        max_miss_rate: deadline-miss rate above which the fleet is under pressure.
        target_utilisation: load over raw capacity to plan for.
        upscale_delay_s: how long a reason to scale up must last.
        downscale_delay_s: how long a reason to scale down must last.
        step: most replicas added at once.
        hysteresis: scale down only below ``target_utilisation * (1 - hysteresis)``.
        deadline_s: the deadline capacity is computed for (the fleet's typical budget).
        stale_after_s: states older than this give no signal.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: Annotated[int, Field(ge=1)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 8
    target_queue_wait_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 0.02
    max_miss_rate: Annotated[float, Field(ge=0, le=1)] = 0.01
    target_utilisation: Annotated[float, Field(gt=0, le=1)] = 0.7
    upscale_delay_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 10.0
    downscale_delay_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 60.0
    step: Annotated[int, Field(ge=1)] = 2
    hysteresis: Annotated[float, Field(ge=0, lt=1)] = 0.15
    deadline_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 0.1
    stale_after_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        return self


class ScaleReason(str, enum.Enum):
    """Why the decision is what it is (stable strings, fit for a metrics label)."""

    STEADY = "steady"
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"
    UTILISATION = "utilisation"
    QUEUE_WAIT = "queue_wait"
    MISS_RATE = "miss_rate"
    UNDERUSED = "underused"
    NO_SIGNAL = "no_signal"

    def __str__(self) -> str:
        # The bare value in f-strings and logs, on every Python version.
        return self.value


@dataclasses.dataclass(frozen=True)
class ScaleDecision:
    """What the fleet should look like.

    Args:
        desired: replicas to run (not counting draining ones).
        reason: why.
        drain: the replica to drain, when scaling down.
        utilisation: load over the capacity of ready and coming replicas (``nan`` without signal).
    """

    desired: int
    reason: ScaleReason
    drain: str | None = None
    utilisation: float = math.nan


class Autoscaler:
    """Decides the replica count from replica states over time.

    Args:
        config: :class:`AutoscaleConfig`.
    """

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._desired: int | None = None
        self._up_since: float | None = None
        self._down_since: float | None = None

    @property
    def desired(self) -> int | None:
        """The count last decided (``None`` before the first observation)."""
        return self._desired

    def _change(self, desired: int, reason: ScaleReason, util: float, drain: str | None = None) -> ScaleDecision:
        self._desired = desired
        self._up_since = self._down_since = None
        return ScaleDecision(desired, reason, drain, util)

    def observe(self, states: list[ReplicaState], now: float) -> ScaleDecision:
        """Decide from the replicas' latest states.

        Args:
            states: every replica of the fleet (warming and draining ones included).
            now: the shell's clock (same as the states' ``updated``).
        """
        cfg = self.config
        live = [s for s in states if not s.draining]
        if self._desired is None:
            self._desired = len(live)
        if self._desired < cfg.min_replicas:
            return self._change(cfg.min_replicas, ScaleReason.BELOW_MIN, math.nan)
        if self._desired > cfg.max_replicas:
            return self._change(cfg.max_replicas, ScaleReason.ABOVE_MAX, math.nan)
        desired = self._desired

        fresh = [s for s in live if s.ready and 0.0 <= now - s.updated <= cfg.stale_after_s]
        caps = {s.name: capacity_rps(s, cfg.deadline_s, 1.0) for s in fresh}
        measured = [s for s in fresh if caps[s.name] > 0]
        if not measured:
            self._up_since = self._down_since = None
            return ScaleDecision(desired, ScaleReason.NO_SIGNAL)
        load = sum(s.load_rps for s in fresh)
        ready_cap = sum(caps.values())
        mean_cap = ready_cap / len(measured)
        coming = max(0, max(desired, len(live)) - len(fresh))
        util = load / (ready_cap + coming * mean_cap)

        weight = sum(s.load_rps for s in fresh)
        if weight > 0:
            wait = sum(s.queue_wait_p99_s * s.load_rps for s in fresh) / weight
            miss = sum(s.deadline_miss_rate * s.load_rps for s in fresh) / weight
        else:
            wait = miss = 0.0
        pressure: ScaleReason | None = None
        if miss > cfg.max_miss_rate:
            pressure = ScaleReason.MISS_RATE
        elif wait > cfg.target_queue_wait_s:
            pressure = ScaleReason.QUEUE_WAIT

        # ---- up
        up: ScaleReason | None = None
        if util > cfg.target_utilisation:
            up = ScaleReason.UTILISATION
        elif pressure is not None and coming == 0:
            up = pressure
        if up is not None and desired < cfg.max_replicas:
            self._down_since = None
            if self._up_since is None:
                self._up_since = now
            if now - self._up_since >= cfg.upscale_delay_s:
                needed = math.ceil(load / (mean_cap * cfg.target_utilisation) - 1e-9)
                target = min(cfg.max_replicas, desired + cfg.step, max(desired + 1, needed))
                return self._change(target, up, util)
            return ScaleDecision(desired, ScaleReason.STEADY, None, util)
        self._up_since = None

        # ---- down
        candidates = sorted((s for s in live if not s.canary), key=lambda s: (s.sessions, s.name))
        if desired > cfg.min_replicas and pressure is None and coming == 0 and candidates:
            victim = candidates[0]
            remaining = ready_cap - caps.get(victim.name, 0.0)
            after = load / remaining if remaining > 0 else math.inf
            if after < cfg.target_utilisation * (1.0 - cfg.hysteresis):
                if self._down_since is None:
                    self._down_since = now
                if now - self._down_since >= cfg.downscale_delay_s:
                    return self._change(desired - 1, ScaleReason.UNDERUSED, util, victim.name)
                return ScaleDecision(desired, ScaleReason.STEADY, None, util)
        self._down_since = None
        return ScaleDecision(desired, ScaleReason.STEADY, None, util)
