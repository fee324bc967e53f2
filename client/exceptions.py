"""Every error chunkline raises on the client side, each a named class.

The wire error codes (``ErrorCode``) are stable strings; a :class:`ServerError`
carries one of them back to the caller.
"""

from __future__ import annotations

import enum

__all__ = [
    "ChunklineError",
    "CodecError",
    "CodecErrorReason",
    "ProtocolError",
    "ErrorCode",
    "ServerError",
    "ConnectionLost",
    "RequestTimeout",
    "MappingError",
    "MappingErrorReason",
]


class ChunklineError(Exception):
    """Base class of every chunkline error."""


class _CodedError(ChunklineError):
    """An error with a stable cause to count and branch on (an enum member or, from a newer
    server, a plain string) and an explanation: its text is ``"<cause>: <explanation>"``."""

    def __init__(self, cause: enum.Enum | str, explanation: str) -> None:
        super().__init__(f"{cause.value if isinstance(cause, enum.Enum) else cause}: {explanation}")


class CodecErrorReason(str, enum.Enum):
    """Why the codec refused a payload. Stable strings, safe to log and count."""

    MESSAGE_TOO_LARGE = "message_too_large"
    MALFORMED = "malformed"  # not valid msgpack, truncated, trailing bytes
    TOO_DEEP = "too_deep"
    TOO_MANY_ARRAYS = "too_many_arrays"
    UNSUPPORTED_DTYPE = "unsupported_dtype"  # object, void, complex, str, datetime, ...
    BAD_SHAPE = "bad_shape"
    TOO_MANY_DIMS = "too_many_dims"
    TOO_MANY_ELEMENTS = "too_many_elements"
    LENGTH_MISMATCH = "length_mismatch"  # len(data) != prod(shape) * itemsize
    UNSUPPORTED_TYPE = "unsupported_type"  # ext types, timestamps, non-string keys, ...
    UNENCODABLE = "unencodable"  # encode side: a value msgpack cannot carry safely
    BAD_ENCODING = "bad_encoding"  # a compressed field (jpeg, png) refused before or while decoding it


class CodecError(_CodedError, ValueError):
    """A payload was refused by the codec.

    Args:
        reason: machine-readable reason.
        detail: human-readable explanation (never contains payload bytes).
    """

    def __init__(self, reason: CodecErrorReason, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


class ProtocolError(ChunklineError):
    """A well-formed msgpack message that is not a valid chunkline message."""


class ErrorCode(str, enum.Enum):
    """Stable error codes carried by ``error`` messages (docs/protocol.md)."""

    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    INVALID_MESSAGE = "invalid_message"
    INVALID_OBSERVATION = "invalid_observation"
    UNKNOWN_MODEL = "unknown_model"
    OVERLOADED = "overloaded"
    QUOTA_EXCEEDED = "quota_exceeded"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    POLICY_FAILED = "policy_failed"
    CANCELLED = "cancelled"
    NOT_READY = "not_ready"
    SHUTTING_DOWN = "shutting_down"
    DUPLICATE_ID = "duplicate_id"
    INTERNAL = "internal"
    PLAN_INVALID = "plan_invalid"  # a planner's output failed its published schema (after one repair)


class ServerError(_CodedError, RuntimeError):
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


class MappingError(_CodedError, ValueError):
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
