"""An event loop on a thread of its own, for the upstream planner's HTTP calls.

Invariant: the server's event loop never writes a plan's request body. A plan uploads megabytes
of base64 text; on the server's loop (uvloop) every socket write runs, with the kernel's copying
and, on loopback, the receiver's TCP processing, while that thread holds the GIL, so robots'
replies wait on it. This loop is asyncio's own selector loop, whose socket calls release the GIL,
so the copying runs beside the server's loop instead of in its turns.

A coroutine handed to :meth:`UpstreamLoop.run` runs here as a task; cancelling the caller cancels
that task, and ``finished`` is called once the task is over (done, failed or cancelled, started
or not), never before: whatever the coroutine reads (a plan's image texts) stays valid until then.
Submitting and stopping happen on one thread (the server's loop), so a coroutine is either
scheduled before the loop winds down (and cancelled by it) or refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from chunkline.server.planner.errors import PlannerFailed

__all__ = ["UpstreamLoop"]

T = TypeVar("T")

#: How long :meth:`UpstreamLoop.stop` waits for the thread once its tasks are cancelled.
_JOIN_S = 5.0


class UpstreamLoop:
    """A selector event loop on a daemon thread (see the module docstring)."""

    def __init__(self, name: str = "chunkline-upstream") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._loop is not None:
            return
        # Not the running policy's loop (uvloop in the server): the selector loop's writes release the GIL.
        loop = asyncio.SelectorEventLoop()
        # A daemon: a server that never reaches stop() (killed mid-start-up) must still exit.
        thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``'s result, run on this loop (set-up and tear-down work that owns no buffers)."""
        return await self.run(coro, _nothing)

    async def run(self, coro: Coroutine[Any, Any, T], finished: Callable[[], None]) -> T:
        """``coro``'s result, run on this loop; ``finished()`` is called on this loop's thread
        once ``coro`` is over (see the module docstring).

        Raises:
            PlannerFailed: the loop is stopped (or stops before ``coro`` ends).
        """
        return await asyncio.wrap_future(self._submit(coro, finished))

    def _submit(self, coro: Coroutine[Any, Any, T], finished: Callable[[], None]) -> concurrent.futures.Future[T]:
        loop = self._loop
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            if outcome.cancelled():  # the caller gave up before this loop came to it
                coro.close()
                finished()
                return
            task = loop.create_task(coro)  # type: ignore[union-attr]  # (set: start() ran on it)

            def over(task: asyncio.Task[T]) -> None:
                try:
                    finished()
                finally:  # the caller hears the outcome even if finished() failed
                    _deliver(task, outcome)

            task.add_done_callback(over)
            # Called at once if the caller cancelled just now: the task is then cancelled at its first await.
            outcome.add_done_callback(lambda f: _cancel_if(f, task))

        try:
            if loop is None or loop.is_closed():
                raise RuntimeError("not running")
            loop.call_soon_threadsafe(start)
        except RuntimeError:
            coro.close()
            finished()
            raise PlannerFailed("the upstream planner's client is not running") from None
        return outcome

    async def stop(self) -> None:
        """Cancel what still runs here, stop the loop and wait for its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        if not loop.is_closed():
            asyncio.run_coroutine_threadsafe(_wind_down(), loop)
        await asyncio.to_thread(thread.join, _JOIN_S)
        if not thread.is_alive():
            loop.close()


def _deliver(task: asyncio.Task[T], outcome: concurrent.futures.Future[T]) -> None:
    if not outcome.set_running_or_notify_cancel():
        return  # the caller cancelled: nobody reads the outcome
    if task.cancelled():
        outcome.set_exception(PlannerFailed("the upstream planner's client stopped"))
    elif (error := task.exception()) is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(task.result())


def _cancel_if(outcome: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """The caller cancelled ``outcome``: cancel ``task`` on its own loop (a no-op once that loop is closed)."""
    if outcome.cancelled():
        try:
            task.get_loop().call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop is closed: its tasks are over
            pass


async def _wind_down() -> None:
    """On the loop: cancel its other tasks, let them end, then stop it."""
    this = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not this]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()


def _nothing() -> None:
    return None
