"""The planner class's typed refusals; every one is a :class:`~chunkline.server.errors.Refusal`."""

from __future__ import annotations

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal

__all__ = ["PlanInvalid", "PlannerFailed"]


class PlanInvalid(Refusal):
    """The planner's output does not match its published schema, even after one repair attempt
    (or the model refused to answer). The robot keeps its current plan.

    Args:
        message: what was wrong (the validation error, never the model's text).
    """

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.PLAN_INVALID, message)


class PlannerFailed(Refusal):
    """The planner could not be reached or failed (an upstream error, a crash).

    Args:
        message: what failed.
        retry_after_ms: when a retry may succeed, if the upstream said.
    """

    def __init__(self, message: str, retry_after_ms: float | None = None) -> None:
        super().__init__(ErrorCode.POLICY_FAILED, message, retry_after_ms=retry_after_ms)
