"""The tenants file's schema (pydantic): what an operator may write, checked strictly.

Unknown fields are refused (a typo in a limits table must fail loudly, not silently disable the
limit), and the whole-file rules (key ids and digests unique, reserved shares adding up to at most
1) are checked here, so every reader and writer of the file sees the same rules.
"""

from __future__ import annotations

import datetime as _dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "RequestClass",
    "REQUEST_CLASSES",
    "TENANT_NAME_PATTERN",
    "KeyEntry",
    "LimitsConfig",
    "RobotsConfig",
    "TenantConfig",
    "TenantsFile",
]

#: The request classes the serving core knows.
RequestClass = Literal["policy", "text", "plan"]
REQUEST_CLASSES: tuple[str, ...] = ("policy", "text", "plan")

#: What a tenant name may look like (a metrics label and a ledger column).
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class _Strict(BaseModel):
    # A typo in a limits table must fail loudly, not silently disable the limit.
    model_config = ConfigDict(extra="forbid")


class KeyEntry(_Strict):
    """One API key of a tenant, as stored (a digest, never the key).

    Args:
        id: short public id (``ck_`` + the key's first 8 random characters), for listing.
        hash: ``sha256:<64 hex>`` digest of the whole key.
        created: when it was issued (UTC).
        revoked: a revoked key no longer authenticates.
        revoked_at: when it was revoked.
        robot_weight: the service weight of the robot that uses this key, among its tenant's
            robots (at most the tenant's ``robots.max_weight``); ``None``: ``robots.weight``.
    """

    id: Annotated[str, Field(pattern=r"^ck_[A-Za-z0-9_-]{1,32}$")]
    hash: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    created: _dt.datetime
    revoked: bool = False
    revoked_at: _dt.datetime | None = None
    robot_weight: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] | None = None


class LimitsConfig(_Strict):
    """A tenant's limits; ``None`` means unlimited.

    Args:
        max_sessions: concurrent sessions (WebSocket connections).
        max_in_flight: requests admitted and not finished (queued + running), all models.
        rate_per_s: sustained request rate (token bucket refill).
        burst: token bucket depth; defaults to ``max(1, ceil(rate_per_s))``.
        text_tokens_per_window: text tokens (prompt + output) per ``text_window_s``; a text request
            reserves prompt + max_tokens at admission and is reconciled with actual usage after.
        text_window_s: the budget window.
    """

    max_sessions: Annotated[int, Field(ge=0)] | None = None
    max_in_flight: Annotated[int, Field(ge=0)] | None = None
    rate_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    burst: Annotated[int, Field(ge=1)] | None = None
    text_tokens_per_window: Annotated[int, Field(ge=1)] | None = None
    text_window_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 60.0

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> LimitsConfig:
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst needs rate_per_s")
        return self


class RobotsConfig(_Strict):
    """How a tenant's robots share what the tenant gets, under the fleet batch strategy.

    Args:
        weight: a robot's service weight when neither its key nor its ``hello`` sets one.
        max_weight: the most a key or a session's ``hello`` may set (a larger request is clamped).
        max_dry_in_ms: the furthest plan end (``urgency.dry_in_ms``) taken as told.
        max_rows: the most rows a request's urgency is credited with.
    """

    weight: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 1.0
    max_weight: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 1.0
    max_dry_in_ms: Annotated[float, Field(ge=0, le=3_600_000, allow_inf_nan=False)] = 5000.0
    max_rows: Annotated[int, Field(ge=1, le=65536)] = 256

    @model_validator(mode="after")
    def _weight_within_max(self) -> RobotsConfig:
        if self.weight > self.max_weight:
            raise ValueError(f"robots.weight {self.weight} is above robots.max_weight {self.max_weight}")
        return self


def _all_classes() -> list[RequestClass]:
    return ["policy", "text", "plan"]


class TenantConfig(_Strict):
    """One tenant.

    Args:
        weight: share of contended capacity relative to other tenants (weighted fair queueing).
        priority: higher is served first; ``class_priority`` overrides it per request class.
        reserved_share: fraction of each model's max concurrency held for this tenant.
        models: model names it may use; ``"*"`` for all.
        classes: request classes it may use (``policy``, ``text``, ``plan``).
        default_deadline_ms: deadline for its requests that carry none (openpi-compatible mode);
            ``None`` uses the policy's.
        limits: see :class:`LimitsConfig`.
        robots: its robots' service weights and urgency bounds (see :class:`RobotsConfig`).
        keys: its API keys (digests).
    """

    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    priority: int = 0
    class_priority: dict[RequestClass, int] = Field(default_factory=dict)
    reserved_share: Annotated[float, Field(ge=0, le=1)] = 0.0
    models: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(default_factory=lambda: ["*"])
    classes: list[RequestClass] = Field(default_factory=lambda: _all_classes())
    default_deadline_ms: Annotated[float, Field(gt=0, le=3_600_000)] | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    robots: RobotsConfig = Field(default_factory=RobotsConfig)
    keys: list[KeyEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _key_weights_within_max(self) -> TenantConfig:
        for key in self.keys:
            if key.robot_weight is not None and key.robot_weight > self.robots.max_weight:
                raise ValueError(f"key {key.id}: robot_weight {key.robot_weight} is above robots.max_weight {self.robots.max_weight}")
        return self


class TenantsFile(_Strict):
    """The whole tenants file.

    Args:
        version: format version (1).
        tenants: tenant name to its settings.
    """

    version: Literal[1] = 1
    tenants: dict[Annotated[str, Field(pattern=TENANT_NAME_PATTERN)], TenantConfig] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _unique_keys(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        ids: set[str] = set()
        hashes: set[str] = set()
        for name, tenant in tenants.items():
            for key in tenant.keys:
                if key.id in ids:
                    raise ValueError(f"key id {key.id} appears twice (tenant {name})")
                if key.hash in hashes:
                    raise ValueError(f"the same key digest appears twice (tenant {name}, id {key.id})")
                ids.add(key.id)
                hashes.add(key.hash)
        total = sum(t.reserved_share for t in tenants.values())
        if total > 1.0 + 1e-9:
            raise ValueError(f"reserved_share adds up to {total:.3f} > 1")
        return tenants
