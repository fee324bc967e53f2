"""Errors on the OpenAI-compatible API: OpenAI's body shape and the server's one status table.

Every refusal is a :class:`~chunkline.server.errors.Refusal` (text-specific ones are its
:class:`~chunkline.server.text.errors.TextError` subclass, which names the ``param`` at fault);
its status comes from :func:`chunkline.server.errors.http_status_for`, its body is
``{"error": {"message", "type", "param", "code"}}`` and a known retry time is a ``Retry-After``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from starlette.responses import JSONResponse

from chunkline.server.errors import Refusal

__all__ = ["openai_type_for", "error_body", "retry_after", "refusal_response", "plain_error"]


def openai_type_for(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(exc: Refusal) -> dict[str, dict[str, str | None]]:
    """The OpenAI-style body of a refusal."""
    return {"error": {"message": exc.message, "type": openai_type_for(exc.http_status),
                      "param": getattr(exc, "param", None), "code": exc.code_str}}


def retry_after(ms: float | None) -> dict[str, str]:
    """``Retry-After`` in whole seconds (at least 1) when a retry time is known."""
    if ms is None or not math.isfinite(ms):
        return {}
    return {"Retry-After": str(max(1, math.ceil(ms / 1000.0)))}


def refusal_response(exc: Refusal) -> JSONResponse:
    """A refusal as a complete response."""
    return JSONResponse(error_body(exc), exc.http_status, retry_after(exc.retry_after_ms))


def plain_error(status: int, message: str, code: str | None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An error that is not a request-class refusal (authentication, routing, framing)."""
    body = {"error": {"message": message, "type": openai_type_for(status), "param": None, "code": code}}
    return JSONResponse(body, status, headers)
