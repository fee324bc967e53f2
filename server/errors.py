"""The one refusal type of the server, shared by the core, every request class and every entrypoint.

Whatever turns a request away -- the door (draining, permissions, the ledger), a tenant's quota,
admission (queue full, deadline unmeetable), a queued request dropped when its budget ran out, a
text request the engine cannot take -- raises or returns a :class:`Refusal`. Its ``code`` is the
wire :class:`~chunkline.client.wire.errors.ErrorCode` the native protocol sends; the HTTP API maps
the same code to a status with :func:`http_status_for`, so no front-end keeps its own table.

Admission returns a :class:`Refusal` as its decision (``Admitted | Refusal``) rather than raising
it: the decision is a value the caller inspects with ``isinstance``; the same object is raised
where an exception is the natural form (a request class's ``submit``).
"""

from __future__ import annotations

import enum

from chunkline.client.wire.errors import ErrorCode

__all__ = ["Refusal", "QuotaLimit", "HTTP_STATUS", "http_status_for"]


class QuotaLimit(str, enum.Enum):
    """Which tenant limit a ``quota_exceeded`` refusal hit (stable strings, safe as a metric label)."""

    MAX_SESSIONS = "max_sessions"
    MAX_IN_FLIGHT = "max_in_flight"
    RATE = "rate"
    TEXT_TOKENS = "text_tokens"


class Refusal(Exception):
    """A request refused, dropped or failed with a wire error code.

    Args:
        code: the wire error code (an :class:`ErrorCode`, or a class-specific code string such as
            the text class's ``context_length_exceeded``).
        message: detail for the client; names the limit or the field, never request content.
        retry_after_ms: when a retry may succeed, if known (``overloaded``, ``quota_exceeded``,
            ``deadline_unmeetable``, ``not_ready``, ``shutting_down``).
        limit: for ``quota_exceeded``, which tenant limit.
    """

    def __init__(self, code: ErrorCode | str, message: str, retry_after_ms: float | None = None,
                 limit: QuotaLimit | None = None) -> None:
        code_str = code.value if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"{code_str}: {message}")
        self.code_str = code_str
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.limit = limit

    @property
    def code(self) -> ErrorCode:
        """The wire code; class-specific codes map to ``invalid_message``."""
        try:
            return ErrorCode(self.code_str)
        except ValueError:
            return ErrorCode.INVALID_MESSAGE

    @property
    def reason(self) -> str:
        """The detail (the name admission decisions have always used for it)."""
        return self.message

    @property
    def http_status(self) -> int:
        return http_status_for(self.code_str)

    def __repr__(self) -> str:
        return f"Refusal({self.code_str!r}, {self.message!r}, retry_after_ms={self.retry_after_ms!r}, limit={self.limit!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Refusal) and (self.code_str, self.message, self.retry_after_ms, self.limit)
                == (other.code_str, other.message, other.retry_after_ms, other.limit))

    def __hash__(self) -> int:
        return hash((self.code_str, self.message))


#: HTTP status of each code on the HTTP API (codes not listed are 500).
HTTP_STATUS: dict[str, int] = {
    ErrorCode.UNAUTHENTICATED.value: 401,
    ErrorCode.FORBIDDEN.value: 403,
    ErrorCode.UNKNOWN_MODEL.value: 404,
    ErrorCode.INVALID_MESSAGE.value: 400,
    ErrorCode.INVALID_OBSERVATION.value: 400,
    ErrorCode.DUPLICATE_ID.value: 400,
    "context_length_exceeded": 400,
    "unsupported_parameter": 400,
    ErrorCode.QUOTA_EXCEEDED.value: 429,
    "rate_limited": 429,
    ErrorCode.OVERLOADED.value: 503,
    ErrorCode.DEADLINE_UNMEETABLE.value: 503,
    ErrorCode.NOT_READY.value: 503,
    ErrorCode.SHUTTING_DOWN.value: 503,
    ErrorCode.DEADLINE_EXCEEDED.value: 504,
    "upstream_timeout": 504,
    "upstream_error": 502,
    ErrorCode.CANCELLED.value: 499,  # nginx's "client closed request": only ever logged
    ErrorCode.POLICY_FAILED.value: 500,
    ErrorCode.INTERNAL.value: 500,
}


def http_status_for(code: str) -> int:
    """The HTTP status for a wire or class-specific code (500 for codes not in :data:`HTTP_STATUS`)."""
    return HTTP_STATUS.get(code, 500)
