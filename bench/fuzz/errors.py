"""The one error the fuzzers raise: a broken rule of the protocol or the codec."""

from __future__ import annotations

__all__ = ["FuzzFailure"]


class FuzzFailure(AssertionError):
    """The server broke a rule of the protocol for one fuzzed frame.

    Args:
        message: what went wrong.
        frame: the frame that caused it (shown shortened).
    """

    def __init__(self, message: str, frame: bytes | None = None) -> None:
        shown = "" if frame is None else f" (frame of {len(frame)} bytes: {frame[:64]!r}...)"
        super().__init__(message + shown)
        self.frame = frame
