"""Waiting on an event loop for a condition that other threads or callbacks make true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], object], what: str) -> None:
    """Yield to the loop (lanes, transports and callbacks run meanwhile) until ``condition()``
    holds; bounded at 2,000 turns of 5 ms (10 s), then fails naming ``what``."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")
