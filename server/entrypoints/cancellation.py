"""The answer a native-protocol request gets when its task is cancelled (a ``cancel`` message or
a disconnect): one place, so every request class words and logs it the same way."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from chunkline.client.wire.errors import ErrorCode
from chunkline.client.wire.protocol import error_message

__all__ = ["answer_cancelled"]

log = logging.getLogger("chunkline.server")


async def answer_cancelled(send: Callable[[dict[str, Any]], Awaitable[None]], request_id: Any) -> None:
    """Send ``error`` ``cancelled`` for ``request_id`` if the connection still stands; a connection
    already gone is not an error here (the caller re-raises the ``CancelledError`` either way)."""
    try:
        await send(error_message(ErrorCode.CANCELLED, "cancelled by the client", request_id))
    except Exception as exc:
        log.debug("could not send the cancellation of %r: %s", request_id, type(exc).__name__)
