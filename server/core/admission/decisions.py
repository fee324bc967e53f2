"""What admission decides and the values it passes around (sans-I/O, no clock, no I/O).

A request is admitted (:class:`Admitted`) or refused (a :class:`~chunkline.server.errors.Refusal`,
returned as a value, never raised here); a queued request removed without running is
:class:`Dropped`. :func:`resolve_deadline` turns a request's budget into an absolute deadline.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Hashable
from typing import Any

from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import MAX_DEADLINE_MS
from chunkline.server.core.quotas import Cost
from chunkline.server.core.tenants import TenantInfo

__all__ = [
    "Request",
    "Admitted",
    "Dropped",
    "CancelOutcome",
    "UnknownRequest",
    "DuplicateRequest",
    "resolve_deadline",
    "REFUSAL_CODES",
    "MAX_DEADLINE_MS",
]


#: Every code a refusal or a drop may carry.
REFUSAL_CODES = frozenset(
    {
        ErrorCode.OVERLOADED,
        ErrorCode.DEADLINE_UNMEETABLE,
        ErrorCode.DEADLINE_EXCEEDED,
        ErrorCode.QUOTA_EXCEEDED,
        ErrorCode.FORBIDDEN,
    }
)


class UnknownRequest(KeyError):
    """``complete`` was called for a request that is not running in this controller."""


class DuplicateRequest(ValueError):
    """``offer`` got a request id that is already queued or running (ids must be server-unique)."""


def resolve_deadline(
    now: float,
    deadline_ms: float | None,
    *,
    tenant: TenantInfo | None = None,
    policy_default_ms: float | None = None,
    server_default_ms: float = 1000.0,
) -> float:
    """The absolute deadline of a request received at ``now``.

    The budget is the request's own ``deadline_ms``; failing that the tenant's
    ``default_deadline_ms``, then the policy's, then the server's; always capped at
    :data:`MAX_DEADLINE_MS` so that nothing waits unbounded.

    Args:
        now: receipt time (server clock, seconds).
        deadline_ms: the request's budget, or ``None`` (openpi-compatible requests).
        tenant: the tenant, for its default.
        policy_default_ms: the policy's default budget.
        server_default_ms: the last resort.
    """
    for budget in (deadline_ms, tenant.default_deadline_ms if tenant else None, policy_default_ms, server_default_ms):
        if budget is not None and math.isfinite(budget) and budget > 0:
            return now + min(float(budget), MAX_DEADLINE_MS) / 1000.0
    return now + server_default_ms / 1000.0


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One unit of work as the core sees it (never its content). Nothing changes it once made
    (not frozen: a frozen dataclass's construction, one per request, is slower).

    Args:
        id: server-unique id (the shell maps each session's client ids to these).
        session: the session it came on (for ``cancel_session``).
        tenant: the tenant's name.
        cls: request class, ``"policy"`` or ``"text"``.
        cost: its :class:`~chunkline.server.core.quotas.Cost`.
        deadline: absolute deadline on the server clock (see :func:`resolve_deadline`).
        priority: higher is served first (usually ``tenant.priority_for(cls)``).
        payload: the shell's own data (decoded observation, reply future); never inspected.
    """

    id: Hashable
    session: str
    tenant: str
    cls: str
    cost: Cost
    deadline: float
    priority: int = 0
    payload: Any = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(slots=True)
class Admitted:
    """The request is queued. Nothing changes it once made (not frozen: one is made per request,
    and a frozen dataclass's construction is slower).

    Args:
        request: it.
        predicted_start: when it is expected to start running.
        predicted_completion: when it is expected to finish (``<= deadline``).
    """

    request: Request
    predicted_start: float
    predicted_completion: float


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A queued request removed without running; answer it with ``code``.

    Args:
        request: it.
        code: ``deadline_exceeded`` (budget ran out in the queue) or ``overloaded`` (evicted).
        reason: human-readable detail.
        retry_after_ms: for ``overloaded``, when a retry may succeed.
    """

    request: Request
    code: ErrorCode
    reason: str
    retry_after_ms: float | None = None


class CancelOutcome(enum.Enum):
    """What :meth:`AdmissionController.cancel` found."""

    QUEUED = "queued"  # removed from the queue; answer it ``cancelled``
    RUNNING = "running"  # already running; tell the backend if it can stop; ``complete`` still follows
    UNKNOWN = "unknown"  # not here (finished, dropped, or never admitted)

