"""The door's side of retry times: what one session was told to wait for, and what to do with a
request it sends before then (sans-I/O: every call takes ``now``).

A refusal that waiting can cure tells the session when to retry (``retry_after_ms``). Until
then the native session answers that model's ``infer`` messages at the door, from their small
header alone, with the same code and the time still to wait: no observation is decoded and
admission is not asked. A session that keeps sending inside its windows is closed (1013) once
it has sent more than ``close_after`` such messages in a row; one message sent after its time
ends the run. The first message sent inside a window is reported (:attr:`Held.first`): the
caller takes the session's place in the retry line away from it then (see
:mod:`.retry_line`).
"""

from __future__ import annotations

import dataclasses

from chunkline.client.wire.errors import ErrorCode

__all__ = ["Held", "RetryHolds", "HOLD_CODES"]

#: Refusals whose retry time a session must honour.
HOLD_CODES = frozenset({ErrorCode.OVERLOADED, ErrorCode.DEADLINE_UNMEETABLE, ErrorCode.QUOTA_EXCEEDED})


@dataclasses.dataclass(frozen=True)
class Held:
    """A request sent inside its session's retry window.

    Args:
        code: the code of the refusal that opened the window (the answer repeats it).
        wait_ms: how long the window still lasts.
        first: the first request sent inside this window.
        close: the session has now sent more than ``close_after`` requests inside its windows in
            a row: close it (1013) rather than answer.
    """

    code: ErrorCode
    wait_ms: float
    first: bool
    close: bool


class RetryHolds:
    """One session's retry windows, per model.

    Args:
        close_after: requests sent inside windows in a row that are answered; the next closes
            the session.
    """

    def __init__(self, close_after: int) -> None:
        if close_after < 0:
            raise ValueError("close_after must be >= 0")
        self.close_after = close_after
        self._windows: dict[str, tuple[float, ErrorCode, bool]] = {}  # model -> (until, code, sent inside)
        self._in_a_row = 0

    def __bool__(self) -> bool:
        """Whether any window is open (or ended but not yet noticed)."""
        return bool(self._windows)

    @property
    def in_a_row(self) -> int:
        """Requests sent inside windows since the last one sent outside."""
        return self._in_a_row

    def hold(self, model: str, code: ErrorCode, retry_after_ms: float | None, now: float) -> None:
        """A request for ``model`` was refused at ``now`` with ``code`` and ``retry_after_ms``:
        a window opens if the code is one a session must wait out (:data:`HOLD_CODES`)."""
        if retry_after_ms is not None and code in HOLD_CODES:
            self._windows[model] = (now + retry_after_ms / 1000.0, code, False)

    def check(self, model: str, now: float) -> Held | None:
        """A request for ``model`` arrived at ``now``: :class:`Held` if it is inside the
        window, else ``None`` (the window, if it has ended, is forgotten)."""
        window = self._windows.get(model)
        if window is None:
            return None
        until, code, sent = window
        if now >= until:
            del self._windows[model]
            self._in_a_row = 0
            return None
        self._in_a_row += 1
        if not sent:
            self._windows[model] = (until, code, True)
        return Held(code, (until - now) * 1000.0, not sent, self._in_a_row > self.close_after)
