"""Every error of the text request class, each a named exception, and its wire forms.

One :class:`TextError` carries what both front-ends need: the chunkline wire code for the native
protocol (an :class:`~chunkline.client.exceptions.ErrorCode`), the OpenAI-style ``code`` and
``type`` and the HTTP status for the HTTP API, and ``retry_after_ms`` where a retry may succeed.
"""

from __future__ import annotations

import math
from typing import Any

from chunkline.client.exceptions import ErrorCode

__all__ = [
    "TextError",
    "InvalidTextRequest",
    "ContextLengthExceeded",
    "UnsupportedParameter",
    "UnknownTextModel",
    "TextRefused",
    "GenerationFailed",
    "UpstreamError",
    "UpstreamTimeout",
    "ClientGone",
    "HTTP_STATUS",
    "http_status_for",
    "openai_type_for",
]

#: HTTP status of each chunkline code on the OpenAI-compatible API.
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
    """The HTTP status for a code (500 for codes not in :data:`HTTP_STATUS`).

    Args:
        code: a chunkline or text-specific error code.
    """
    return HTTP_STATUS.get(code, 500)


def openai_type_for(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status.

    Args:
        status: the HTTP status.
    """
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error")


class TextError(Exception):
    """A text request failed or was refused.

    Args:
        code: the code clients see in ``error.code`` (HTTP) — a chunkline ``ErrorCode`` value or
            a text-specific one (``context_length_exceeded``, ``upstream_error``, ...).
        message: detail for the client (never prompt content).
        retry_after_ms: when a retry may succeed.
        param: the request field at fault, if one is.
        wire_code: the native protocol's code (defaults to ``code`` when it is an ``ErrorCode``).
        limit: for ``quota_exceeded``, which limit (a metrics label).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after_ms: float | None = None,
        param: str | None = None,
        wire_code: ErrorCode | None = None,
        limit: str | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = str(code.value if isinstance(code, ErrorCode) else code)
        self.message = message
        self.retry_after_ms = retry_after_ms if retry_after_ms is None or math.isfinite(retry_after_ms) else None
        self.param = param
        if wire_code is None:
            try:
                wire_code = ErrorCode(self.code)
            except ValueError:
                wire_code = ErrorCode.INTERNAL
        self.wire_code = wire_code
        self.limit = limit

    @property
    def http_status(self) -> int:
        """The HTTP status for this error."""
        return http_status_for(self.code)

    def openai_body(self) -> dict[str, Any]:
        """The OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": openai_type_for(self.http_status), "param": self.param, "code": self.code}}

    def http_headers(self) -> list[tuple[str, str]]:
        """``Retry-After`` (whole seconds, at least 1) when a retry time is known."""
        if self.retry_after_ms is None:
            return []
        return [("Retry-After", str(max(1, math.ceil(self.retry_after_ms / 1000.0))))]


class InvalidTextRequest(TextError):
    """The request is malformed or asks for something out of range (400).

    Args:
        message: what is wrong.
        param: the field at fault.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(ErrorCode.INVALID_MESSAGE.value, message, param=param)


class ContextLengthExceeded(TextError):
    """Prompt plus ``max_tokens`` does not fit the model's context (400 ``context_length_exceeded``).

    Args:
        message: the lengths involved.
        param: ``messages``, ``prompt`` or ``max_tokens``.
    """

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__("context_length_exceeded", message, param=param, wire_code=ErrorCode.INVALID_MESSAGE)


class UnsupportedParameter(TextError):
    """A request field this backend cannot honour; refused rather than silently dropped (400).

    Args:
        param: the field.
        message: why.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__("unsupported_parameter", message, param=param, wire_code=ErrorCode.INVALID_MESSAGE)


class UnknownTextModel(TextError):
    """No such text model (or the tenant may not use it: tenants do not learn others' models) (404).

    Args:
        model: the name asked for.
    """

    def __init__(self, model: str | None) -> None:
        super().__init__(ErrorCode.UNKNOWN_MODEL.value, f"the model {model!r} does not exist", param="model")


class TextRefused(TextError):
    """Admission refused or dropped the request (quota 429, overloaded 503, deadlines 503/504, ...)."""


class GenerationFailed(TextError):
    """The backend failed while generating (500).

    Args:
        message: what failed (an exception type, never content).
    """

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.POLICY_FAILED.value, message)


class UpstreamError(TextError):
    """The upstream engine failed, answered malformed data, or refused in a way we pass on (502 by default).

    Args:
        message: what went wrong.
        code: ``upstream_error`` or, for an upstream refusal passed through, its mapped code.
        retry_after_ms: from the upstream's ``Retry-After``.
        param: the field the upstream blamed.
    """

    def __init__(self, message: str, code: str = "upstream_error", retry_after_ms: float | None = None, param: str | None = None) -> None:
        wire = {
            "upstream_error": ErrorCode.POLICY_FAILED,
            "context_length_exceeded": ErrorCode.INVALID_MESSAGE,
            "rate_limited": ErrorCode.OVERLOADED,
            "upstream_timeout": ErrorCode.DEADLINE_EXCEEDED,
        }.get(code)
        super().__init__(code, message, retry_after_ms=retry_after_ms, param=param, wire_code=wire)


class UpstreamTimeout(TextError):
    """The upstream did not produce a first token before the request's deadline (504).

    Args:
        message: which deadline.
    """

    def __init__(self, message: str) -> None:
        super().__init__("upstream_timeout", message, wire_code=ErrorCode.DEADLINE_EXCEEDED)


class ClientGone(Exception):
    """The client disconnected or closed the stream; the request is cancelled."""
