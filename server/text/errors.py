"""Every error of the text request class, each a named exception.

A :class:`TextError` is a :class:`~chunkline.server.errors.Refusal` (the server's one refusal
type) with what is specific to text: a class-specific code where the OpenAI API has one
(``context_length_exceeded``, ``upstream_error``, ...; :attr:`Refusal.code_str`), the request
field at fault (``param``), and the native protocol's :class:`~chunkline.client.wire.errors.ErrorCode`
for that code (:attr:`TextError.code`). Its HTTP status comes from the shared table
(:func:`chunkline.server.errors.http_status_for`); refusals that are not text-specific (quota,
overloaded, shutting down, ...) are plain :class:`Refusal` objects.
"""

from __future__ import annotations

import math

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.errors import Refusal

__all__ = [
    "TextError",
    "InvalidTextRequest",
    "ContextLengthExceeded",
    "UnsupportedParameter",
    "UnknownTextModel",
    "GenerationFailed",
    "UpstreamError",
    "UpstreamTimeout",
]


class TextError(Refusal):
    """A text request failed or was refused for a text-specific reason.

    Args:
        code: the code clients see in ``error.code`` (HTTP): a chunkline ``ErrorCode`` value or
            a text-specific one (``context_length_exceeded``, ``upstream_error``, ...).
        message: detail for the client (never prompt content).
        retry_after_ms: when a retry may succeed (dropped unless finite).
        param: the request field at fault, if one is.
        wire_code: the native protocol's code (defaults to ``code`` when it is an ``ErrorCode``,
            else ``internal``).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after_ms: float | None = None,
        param: str | None = None,
        wire_code: ErrorCode | None = None,
    ) -> None:
        finite = retry_after_ms if retry_after_ms is None or math.isfinite(retry_after_ms) else None
        super().__init__(code, message, retry_after_ms=finite)
        self.param = param
        if wire_code is None:
            try:
                wire_code = ErrorCode(self.code_str)
            except ValueError:
                wire_code = ErrorCode.INTERNAL
        self._wire_code = wire_code

    @property
    def code(self) -> ErrorCode:
        """The native protocol's code for this error."""
        return self._wire_code


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
