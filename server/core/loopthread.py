"""An asyncio event loop on its own thread, driven from synchronous code.

A replica runs its server this way inside a Ray actor (the actor's methods are synchronous);
tests and benchmarks run a fleet manager or a text service this way beside their own blocking
clients (the ``openai`` package, ``httpx``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """Starts a loop (uvloop where installed, unless ``uvloop=False``) on a daemon thread.

    Args:
        name: the thread's name.
        uvloop: use uvloop when it is installed.
    """

    def __init__(self, name: str = "chunkline-loop", uvloop: bool = True) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        if uvloop:
            try:
                import uvloop as _uvloop

                loop = _uvloop.new_event_loop()
            except ImportError:
                pass
        self.loop = loop or asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 120.0) -> T:
        """Run ``coro`` on the loop and wait for its result (raises what it raises)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = 120.0) -> T:
        """Call ``fn(*args)`` on the loop's thread (to read state the loop owns)."""
        async def go() -> T:
            return fn(*args)

        return self.run(go(), timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting; returns its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
