"""The runtime view of the tenants file: an immutable :class:`TenantRegistry` of :class:`TenantInfo`.

The registry is a value: the asyncio shell loads a new one on SIGHUP and swaps the reference it
hands to the authenticator and the quota manager; sessions already open keep their tenant name and
their counters, so a reload never drops them. Nothing here reads a file (see ``store``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from chunkline.server.core.tenants.schema import REQUEST_CLASSES, LimitsConfig, TenantConfig, TenantsFile

__all__ = ["TenantLimits", "TenantInfo", "KeyRecord", "TenantRegistry", "ANONYMOUS_TENANT"]


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits at runtime (``None``: unlimited). Fields as in :class:`LimitsConfig`.

    Not to be confused with :class:`chunkline.safety.limits.Limits`, a robot's joint limits.
    """

    max_sessions: int | None = None
    max_in_flight: int | None = None
    rate_per_s: float | None = None
    burst: float | None = None
    text_tokens_per_window: int | None = None
    text_window_s: float = 60.0

    @classmethod
    def from_config(cls, cfg: LimitsConfig) -> TenantLimits:
        burst: float | None = None
        if cfg.rate_per_s is not None:
            burst = float(cfg.burst if cfg.burst is not None else max(1, math.ceil(cfg.rate_per_s)))
        return cls(
            max_sessions=cfg.max_sessions,
            max_in_flight=cfg.max_in_flight,
            rate_per_s=cfg.rate_per_s,
            burst=burst,
            text_tokens_per_window=cfg.text_tokens_per_window,
            text_window_s=cfg.text_window_s,
        )


@dataclasses.dataclass(frozen=True)
class TenantInfo:
    """What the serving core needs to know about a tenant (immutable).

    Args:
        name: tenant name (a metrics label and ledger column; never secret).
        weight: fair-share weight.
        priority: default priority (higher first).
        class_priority: per request class overrides.
        reserved_share: fraction of each model's max concurrency held for it.
        models: allowed model names; ``None`` means all.
        classes: allowed request classes.
        default_deadline_ms: default deadline budget, or ``None``.
        limits: its :class:`TenantLimits`.
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    class_priority: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reserved_share: float = 0.0
    models: frozenset[str] | None = None
    classes: frozenset[str] = frozenset(REQUEST_CLASSES)
    default_deadline_ms: float | None = None
    limits: TenantLimits = TenantLimits()

    def may_use(self, model: str, cls: str) -> bool:
        """Whether this tenant may send ``cls`` requests to ``model``."""
        return cls in self.classes and (self.models is None or model in self.models)

    def priority_for(self, cls: str) -> int:
        """The priority of this tenant's requests of class ``cls``."""
        return self.class_priority.get(cls, self.priority)

    @classmethod
    def from_config(cls, name: str, cfg: TenantConfig) -> TenantInfo:
        return cls(
            name=name,
            weight=cfg.weight,
            priority=cfg.priority,
            class_priority={str(k): v for k, v in cfg.class_priority.items()},
            reserved_share=cfg.reserved_share,
            models=None if "*" in cfg.models else frozenset(cfg.models),
            classes=frozenset(cfg.classes),
            default_deadline_ms=cfg.default_deadline_ms,
            limits=TenantLimits.from_config(cfg.limits),
        )


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """An active key as the authenticator sees it: its digest and whose it is."""

    digest: bytes
    tenant: str
    key_id: str


ANONYMOUS_TENANT = TenantInfo(name="anonymous")


class TenantRegistry:
    """An immutable snapshot of the tenants file: tenants by name and the active key digests.

    Build it with ``load_registry``, :meth:`from_file` or :meth:`anonymous`. Swapping the
    registry (on SIGHUP) is replacing a reference; nothing in it ever changes.

    Args:
        tenants: tenant name to :class:`TenantInfo`.
        keys: the active (not revoked) keys.
        source: where it was loaded from (for logs).
    """

    __slots__ = ("_tenants", "_keys", "_key_ids", "source", "file")

    def __init__(self, tenants: Mapping[str, TenantInfo], keys: tuple[KeyRecord, ...] = (), source: str = "",
                 file: TenantsFile | None = None) -> None:
        self._tenants = dict(tenants)
        self._keys = tuple(keys)
        self._key_ids = frozenset((k.tenant, k.key_id) for k in self._keys)
        self.source = source
        #: the validated file it was built from (what request classes read beyond TenantInfo,
        #: e.g. the robots' weights); ``None`` when it was not built from one
        self.file = file

    @classmethod
    def from_file(cls, data: TenantsFile, source: str = "") -> TenantRegistry:
        """Build a registry from a validated tenants file."""
        tenants = {name: TenantInfo.from_config(name, cfg) for name, cfg in data.tenants.items()}
        keys = tuple(
            KeyRecord(digest=bytes.fromhex(k.hash.split(":", 1)[1]), tenant=name, key_id=k.id)
            for name, cfg in data.tenants.items()
            for k in cfg.keys
            if not k.revoked
        )
        return cls(tenants, keys, source, data)

    @classmethod
    def anonymous(cls) -> TenantRegistry:
        """The registry of ``--no-auth``: one tenant, ``anonymous``, without limits and without keys."""
        return cls({ANONYMOUS_TENANT.name: ANONYMOUS_TENANT}, (), "--no-auth")

    @property
    def keys(self) -> tuple[KeyRecord, ...]:
        """The active keys, in file order."""
        return self._keys

    @property
    def tenants(self) -> Mapping[str, TenantInfo]:
        """Tenant name to :class:`TenantInfo` (a copy)."""
        return dict(self._tenants)

    def get(self, name: str) -> TenantInfo | None:
        """The tenant named ``name``, or ``None`` (e.g. removed by a reload)."""
        return self._tenants.get(name)

    def key_active(self, tenant: str, key_id: str) -> bool:
        """Whether ``key_id`` of ``tenant`` still authenticates (a shell may re-check sessions after a reload)."""
        return (tenant, key_id) in self._key_ids

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    def __len__(self) -> int:
        return len(self._tenants)

    def __repr__(self) -> str:
        return f"TenantRegistry({len(self._tenants)} tenants, {len(self._keys)} active keys, source={self.source!r})"
