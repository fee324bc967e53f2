"""What holds a connection's reading back: a hold until a time (a retry window, :class:`ReadingHold`)
and the body gate, which reads a large frame's first bytes and may hold the rest unread.

The frame reader stops a large frame's payload after its first :data:`PEEK_BYTES` and hands them
to the connection's gate (:class:`BodyGate`): the frame's header gave its length, these bytes the
message's type, id and target (:func:`peek_header`). A gate that answers a time holds reading
from then on, so a message its session may not send yet stays in the peer's buffers (TCP flow
control), not in the server's, and costs no read beyond its first bytes; reading goes on, the same
frame first, once the hold ends. Only out-of-band frames are peeked at: their header comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from chunkline.client.wire.codec import CodecLimits
from chunkline.client.wire.format import OOB_MAGIC, OOB_PREFIX
from chunkline.server.robot.peek import peek_map

__all__ = ["BodyGate", "PEEK_BYTES", "ReadingHold", "peek_header"]

#: The payload bytes read before a large frame's gate is asked: an out-of-band header of a few
#: fields and arrays fits with room to spare.
PEEK_BYTES = 4096


class BodyGate(Protocol):
    """Asked with a large frame's first bytes (unmasked; ``length``: the whole payload's): the
    seconds to hold reading before the rest, or 0 to read on."""

    def __call__(self, head: memoryview, length: int) -> float: ...


def peek_header(head: memoryview, limits: CodecLimits) -> dict[str, Any] | None:
    """The scalar fields of an out-of-band message's header (:func:`~chunkline.server.robot.peek.peek_map`)
    from its first bytes, or ``None`` when they are not such a header, or not all of it."""
    if len(head) < OOB_PREFIX or head[:4] != OOB_MAGIC:
        return None
    end = OOB_PREFIX + int.from_bytes(head[4:OOB_PREFIX], "little")
    if end > len(head):
        return None
    return peek_map(head[OOB_PREFIX:end], limits)


class ReadingHold:
    """A hold of a connection's reading until a time; ``changed`` is called when it starts or ends
    (the connection then pauses or resumes its transport)."""

    __slots__ = ("_changed", "_loop", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, changed: Callable[[], None]) -> None:
        self._loop = loop
        self._changed = changed
        self._timer: asyncio.TimerHandle | None = None

    @property
    def active(self) -> bool:
        return self._timer is not None

    def hold(self, seconds: float) -> None:
        """Hold for ``seconds`` from now; a longer hold under way is kept."""
        until = self._loop.time() + seconds
        timer = self._timer
        if timer is not None:
            if timer.when() >= until:
                return
            timer.cancel()
        self._timer = self._loop.call_at(until, self._release)
        self._changed()

    def cancel(self) -> None:
        """End the hold now, without ``changed`` (the caller updates the transport)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release(self) -> None:
        self._timer = None
        self._changed()
