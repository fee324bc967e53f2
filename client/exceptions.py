"""The client's own errors, each a named class (the wire's are in :mod:`chunkline.client.wire.errors`).

A :class:`ServerError` carries one of the wire's ``ErrorCode`` strings back to the caller.
"""

from __future__ import annotations

import enum

from .wire.errors import ChunklineError, CodedError, ErrorCode

__all__ = [
    "ServerError",
    "Superseded",
    "ReplaceMissed",
    "server_error",
    "ConnectionLost",
    "RequestTimeout",
    "MappingError",
    "MappingErrorReason",
]


class ServerError(CodedError, RuntimeError):
    """The server answered a request with a structured error.

    Also a ``RuntimeError``: openpi-client raises that when its server answers with an error, so
    openpi code that catches it keeps working with :mod:`chunkline.client.openpi`.

    Args:
        code: the stable error code.
        message: the server's explanation.
        retry_after_ms: for ``overloaded`` / ``quota_exceeded``, when to retry.
        request_id: the id of the request that failed, if any.
    """

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        retry_after_ms: float | None = None,
        request_id: int | str | None = None,
    ) -> None:
        try:
            code = ErrorCode(code)
        except ValueError:
            pass  # an unknown code from a newer server stays a plain string
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.request_id = request_id


class Superseded(ServerError):
    """Error ``superseded``: a newer ``infer`` of this session (``replaces``) took this queued
    request's place; that one's answer is the chunk for both."""


class ReplaceMissed(ServerError):
    """Error ``replace_missed``: the request an ``infer`` would replace was no longer queued
    (running, answered, or unknown to the session); its own answer stands."""


_BY_CODE: dict[str, type[ServerError]] = {ErrorCode.SUPERSEDED.value: Superseded, ErrorCode.REPLACE_MISSED.value: ReplaceMissed}


def server_error(code: ErrorCode | str, message: str, retry_after_ms: float | None = None,
                 request_id: int | str | None = None) -> ServerError:
    """The :class:`ServerError` (or its subclass for ``code``) an ``error`` message raises."""
    cls = _BY_CODE.get(getattr(code, "value", code), ServerError)
    return cls(code, message, retry_after_ms, request_id)


class ConnectionLost(ChunklineError, ConnectionError):
    """The connection closed while a request was in flight, and reconnecting did not help."""


class RequestTimeout(ChunklineError, TimeoutError):
    """A wait exceeded its timeout."""


class MappingErrorReason(str, enum.Enum):
    """Why a robot's observation, action or features do not fit a policy's LeRobot mapping."""

    #: the policy's metadata publishes no motor names (serve it with ``dataset=`` or ``state_names=``/``action_names=``)
    NO_NAMES = "no_names"
    MISSING_MOTORS = "missing_motors"
    EXTRA_MOTORS = "extra_motors"
    MISSING_CAMERA = "missing_camera"
    EXTRA_CAMERA = "extra_camera"
    CAMERA_SHAPE = "camera_shape"
    CAMERA_DTYPE = "camera_dtype"
    #: a motor's value is not a finite real number
    BAD_VALUE = "bad_value"
    #: an action chunk's width is not the number of action motors
    ACTION_SHAPE = "action_shape"


class MappingError(CodedError, ValueError):
    """A robot's observation, action or features do not fit the policy's mapping.

    Args:
        reason: what is wrong.
        message: the explanation (which motors or cameras, what was expected).
        names: the motors or cameras concerned.
    """

    def __init__(self, reason: MappingErrorReason, message: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.names = names
