"""Per-robot service weights within a tenant, bounded by the tenant's policy (sans-I/O).

A robot's weight is what its session's ``hello`` asked for, else its key's ``robot_weight``, else
its tenant's ``robots.weight``; never above ``robots.max_weight`` (a larger request is clamped, not
refused: a weight is a wish). One that cannot be a weight (not a number, not finite, not above
zero) is refused (``invalid_message``). The weight orders a tenant's robots; between tenants the
tenant's own weight still holds (see :mod:`.strategy`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.tenants.schema import RobotsConfig, TenantsFile
from chunkline.server.errors import Refusal
from chunkline.server.robot.fleet.urgency import Urgency, UrgencyBounds, urgency_from_wire

__all__ = ["RobotPolicy", "RobotPolicies", "WeightError"]


class WeightError(Refusal):
    """A requested robot weight that cannot be one (``invalid_message``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_MESSAGE, f"robot weight: {message}")


@dataclasses.dataclass(frozen=True, slots=True)
class RobotPolicy:
    """One tenant's rules for its robots (its ``robots`` table).

    Args:
        weight: a robot's weight when neither its key nor its session sets one.
        max_weight: the most a key or a session may set.
        urgency: what its robots' urgencies are clamped to.
    """

    weight: float = 1.0
    max_weight: float = 1.0
    urgency: UrgencyBounds = UrgencyBounds()

    @classmethod
    def from_config(cls, cfg: RobotsConfig) -> RobotPolicy:
        return cls(cfg.weight, cfg.max_weight, UrgencyBounds(max_dry_in_s=cfg.max_dry_in_ms / 1000.0, max_rows=cfg.max_rows))

    def weight_for(self, key_weight: float | None = None, requested: object = None) -> float:
        """A session's weight (see the module's docstring).

        Raises:
            WeightError: ``requested`` is given and is not a finite number above zero.
        """
        if requested is not None:
            if isinstance(requested, bool) or not isinstance(requested, (int, float)):
                raise WeightError("must be a number")
            w = float(requested)
            if not math.isfinite(w) or w <= 0:
                raise WeightError("must be a finite number above zero")
            return min(w, self.max_weight)
        return min(key_weight if key_weight is not None else self.weight, self.max_weight)


@dataclasses.dataclass(frozen=True, slots=True)
class RobotPolicies:
    """Every tenant's :class:`RobotPolicy` and every key's robot weight, from a tenants file
    (rebuilt with the registry on a reload)."""

    tenants: Mapping[str, RobotPolicy]
    key_weights: Mapping[tuple[str, str], float]

    @classmethod
    def from_file(cls, data: TenantsFile) -> RobotPolicies:
        return cls(
            {name: RobotPolicy.from_config(t.robots) for name, t in data.tenants.items()},
            {(name, k.id): k.robot_weight for name, t in data.tenants.items() for k in t.keys if k.robot_weight is not None},
        )

    def policy(self, tenant: str) -> RobotPolicy:
        """``tenant``'s policy (the defaults for a tenant the file does not name, e.g. ``--no-auth``)."""
        return self.tenants.get(tenant, _DEFAULT)

    def weight_for(self, tenant: str, key_id: str | None, requested: object = None) -> float:
        """The weight of a session of ``tenant`` on key ``key_id`` that asked for ``requested``.

        Raises:
            WeightError: see :meth:`RobotPolicy.weight_for`.
        """
        key_weight = self.key_weights.get((tenant, key_id)) if key_id is not None else None
        return self.policy(tenant).weight_for(key_weight, requested)

    def urgency_for(self, tenant: str, fields: Mapping[str, object] | None) -> Urgency | None:
        """The urgency of an ``infer`` of ``tenant`` (its ``urgency`` map, ``None`` if it sent
        none), checked and clamped to the tenant's bounds.

        Raises:
            UrgencyError: see :func:`~.urgency.urgency_from_wire`.
        """
        return None if fields is None else urgency_from_wire(fields, self.policy(tenant).urgency)


_DEFAULT = RobotPolicy()
