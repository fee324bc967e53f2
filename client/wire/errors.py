"""The wire's error vocabulary: error codes, close codes and the codec's and protocol's refusals.

Stable strings and numbers (docs/protocol.md); client and server both import them from here.
"""

from __future__ import annotations

import enum

__all__ = [
    "ChunklineError",
    "CodedError",
    "CodecError",
    "CodecErrorReason",
    "ProtocolError",
    "ErrorCode",
    "CloseCode",
]


class ChunklineError(Exception):
    """Base class of every chunkline error."""


class CodedError(ChunklineError):
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


class CodecError(CodedError, ValueError):
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
    SUPERSEDED = "superseded"  # a queued infer was replaced by a newer one of its session (``replaces``)
    REPLACE_MISSED = "replace_missed"  # the infer it would replace was no longer queued: that one's answer stands


class CloseCode(enum.IntEnum):
    """WebSocket close codes chunkline uses (RFC 6455 section 7.4.1)."""

    NORMAL = 1000
    GOING_AWAY = 1001  # server shutting down: reconnect elsewhere or later
    PROTOCOL_ERROR = 1002  # the session itself broke the protocol
    UNSUPPORTED_DATA = 1003  # a text frame where binary msgpack is expected (native mode)
    INVALID_DATA = 1007  # a text frame that is not UTF-8 (sent by the WebSocket layer itself)
    POLICY_VIOLATION = 1008  # authentication or authorisation lost mid-session
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011  # openpi-compatible mode: the request failed (openpi's behaviour)
    TRY_AGAIN_LATER = 1013  # not ready yet (policy still loading)
