"""The upstream planner's own event loop: coroutines run on its thread, a cancelled caller cancels
them, and ``finished`` comes only once a coroutine is over, whatever happened to it."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvloop

from chunkline.server.planner.errors import PlannerFailed
from chunkline.server.planner.upstream_loop import UpstreamLoop

WAIT_S = 10.0  # bound on every cross-thread wait; none is reached when the code is right


@contextlib.asynccontextmanager
async def running(name: str = "chunkline-upstream") -> AsyncIterator[UpstreamLoop]:
    io = UpstreamLoop(name)
    io.start()
    try:
        yield io
    finally:
        await io.stop()


class Record:
    """What happened, in order, on either thread."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.over = threading.Event()

    def add(self, event: str) -> None:
        with self.lock:
            self.events.append(event)

    def finished(self) -> None:
        self.add("finished")
        self.over.set()


def test_a_coroutine_runs_on_the_loops_own_thread_on_asyncios_selector_loop_under_uvloop() -> None:
    async def where() -> tuple[str, type[Any]]:
        return threading.current_thread().name, type(asyncio.get_running_loop())

    async def main() -> tuple[str, type[Any], type[Any]]:
        async with running("test-upstream") as io:
            name, kind = await io.call(where())
            return name, kind, type(asyncio.get_running_loop())

    name, kind, callers = uvloop.run(main())
    assert name == "test-upstream" and issubclass(kind, asyncio.SelectorEventLoop)
    assert not issubclass(callers, asyncio.SelectorEventLoop)  # the caller's is uvloop's


def test_the_result_comes_back_and_finished_comes_after_the_coroutine_ended() -> None:
    record = Record()

    async def work() -> int:
        record.add("ran")
        return 7

    async def main() -> int:
        async with running() as io:
            return await io.run(work(), record.finished)

    assert asyncio.run(main()) == 7
    assert record.events == ["ran", "finished"]


def test_an_error_reaches_the_caller_after_finished() -> None:
    record = Record()

    async def work() -> None:
        raise ValueError("upstream said no")

    async def main() -> None:
        async with running() as io:
            await io.run(work(), record.finished)

    with pytest.raises(ValueError, match="upstream said no"):
        asyncio.run(main())
    assert record.events == ["finished"]


def test_a_cancelled_caller_cancels_the_coroutine_and_finished_waits_for_its_cleanup() -> None:
    record = Record()
    entered = threading.Event()
    cleanup_may_end = threading.Event()

    async def upload() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()  # an upload that never ends by itself
        except asyncio.CancelledError:
            record.add("cancelled")
            # still reading the body's buffers: finished must not come yet
            await asyncio.to_thread(cleanup_may_end.wait, WAIT_S)
            record.add("cleaned up")
            raise

    async def main() -> None:
        async with running() as io:
            caller = asyncio.ensure_future(io.run(upload(), record.finished))
            assert await asyncio.to_thread(entered.wait, WAIT_S)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            await asyncio.sleep(0)
            assert "finished" not in record.events  # the coroutine still holds what finished lets go
            cleanup_may_end.set()
            assert await asyncio.to_thread(record.over.wait, WAIT_S)

    asyncio.run(main())
    assert record.events == ["cancelled", "cleaned up", "finished"]


def test_a_caller_cancelled_before_its_coroutine_started_still_gets_finished_and_the_coroutine_never_runs() -> None:
    record = Record()
    gate = threading.Event()
    blocking = threading.Event()

    async def blocker() -> None:
        blocking.set()
        gate.wait(WAIT_S)  # holds the upstream loop itself: nothing else starts there meanwhile

    async def work() -> None:
        record.add("ran")

    async def main() -> None:
        async with running() as io:
            first = asyncio.ensure_future(io.call(blocker()))
            assert await asyncio.to_thread(blocking.wait, WAIT_S)
            caller = asyncio.ensure_future(io.run(work(), record.finished))
            await asyncio.sleep(0)  # submitted
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            gate.set()
            await first
            assert await asyncio.to_thread(record.over.wait, WAIT_S)

    asyncio.run(main())
    assert record.events == ["finished"]


def test_stop_cancels_what_runs_and_its_callers_get_a_typed_failure() -> None:
    record = Record()
    entered = threading.Event()

    async def upload() -> None:
        entered.set()
        await asyncio.Event().wait()

    async def main() -> None:
        io = UpstreamLoop()
        io.start()
        caller = asyncio.ensure_future(io.run(upload(), record.finished))
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        await io.stop()
        with pytest.raises(PlannerFailed, match="stopped"):
            await caller

    asyncio.run(main())
    assert record.events == ["finished"]


def test_after_stop_a_coroutine_is_refused_closed_and_finished() -> None:
    record = Record()

    async def work() -> None:
        record.add("ran")

    coro = work()

    async def main() -> None:
        io = UpstreamLoop()
        io.start()
        await io.stop()
        with pytest.raises(PlannerFailed, match="not running"):
            await io.run(coro, record.finished)

    asyncio.run(main())
    assert record.events == ["finished"] and inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
