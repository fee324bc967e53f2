"""CPU-heavy request preparation (image decode and encode) off the event loop, on a bounded
thread pool shared fairly between tenants.

Each tenant has its own queue of jobs; a free thread takes the oldest job of the next tenant in
turn (round robin over the tenants with work queued). A tenant already running a job never takes
the last free thread: it is kept for a tenant with none running, whose job so starts at once
instead of waiting for another tenant's running job. A tenant may have at most
``max_pending_per_tenant`` jobs queued or running: beyond that :meth:`FairPool.run` refuses with
``overloaded`` and a retry time from the measured job time. The threads run at background
priority (:mod:`.background`), so that a flood of preparation work gives way to the event loop
and the lanes at once. :class:`FairQueue` is the sans-I/O core; :class:`FairPool`
its asyncio shell.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from chunkline.client.wire.errors import ErrorCode
from chunkline.server.core.background import to_background
from chunkline.server.errors import Refusal

__all__ = ["FairQueue", "FairPool", "DEFAULT_CPU_THREADS", "DEFAULT_JOBS_PER_TENANT"]

T = TypeVar("T")

#: pool threads by default: the cores but one (the event loop's), at most four, and at least two
#: (one of them kept for a tenant with no job running)
DEFAULT_CPU_THREADS = max(2, min(4, (os.cpu_count() or 1) - 1))
#: jobs one tenant may have queued or running (an observation has a few cameras)
DEFAULT_JOBS_PER_TENANT = 32
#: the job time assumed before one is measured, seconds (a 224x224 JPEG decode is about 1 ms)
_FIRST_JOB_S = 0.002
_EWMA = 0.1


class FairQueue(Generic[T]):
    """Per-tenant FIFO queues served round robin (sans-I/O)."""

    def __init__(self) -> None:
        # Insertion order is the turn order: a served tenant with more work goes to the back.
        self._queues: dict[str, deque[T]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, tenant: str, item: T) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        queue.append(item)
        self._size += 1

    def pop(self, may_take: Callable[[str], bool] | None = None) -> tuple[str, T] | None:
        """The oldest item of the next tenant in turn (for which ``may_take`` holds, when given),
        or ``None`` when no such tenant has items queued. A tenant passed over keeps its turn."""
        for tenant in self._queues:
            if may_take is None or may_take(tenant):
                break
        else:
            return None
        queue = self._queues.pop(tenant)
        item = queue.popleft()
        if queue:
            self._queues[tenant] = queue
        self._size -= 1
        return tenant, item


@dataclasses.dataclass(slots=True)
class _Job:
    call: Callable[[], Any]
    future: asyncio.Future[Any]


class FairPool:
    """The process's pool for CPU-heavy preparation, fair between tenants.

    Args:
        threads: worker threads.
        max_pending_per_tenant: jobs one tenant may have queued or running.
        background: the threads run at background priority (else at the process's).
    """

    def __init__(self, threads: int = DEFAULT_CPU_THREADS, max_pending_per_tenant: int = DEFAULT_JOBS_PER_TENANT,
                 background: bool = True) -> None:
        if threads < 1 or max_pending_per_tenant < 1:
            raise ValueError("threads and max_pending_per_tenant must be at least 1")
        self.threads = threads
        self.max_pending_per_tenant = max_pending_per_tenant
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="chunkline-cpu", initializer=to_background if background else None)
        self._queue: FairQueue[_Job] = FairQueue()
        self._pending: dict[str, int] = {}
        self._running = 0
        self._running_by: dict[str, int] = {}
        # Threads a tenant already running a job may not take: with one thread, none is kept.
        self._kept = 1 if threads > 1 else 0
        self._job_s = _FIRST_JOB_S
        #: jobs refused for a tenant's bound (a metric)
        self.refused = 0

    def pending(self, tenant: str) -> int:
        """``tenant``'s jobs queued or running."""
        return self._pending.get(tenant, 0)

    def retry_after_ms(self, tenant: str) -> float:
        """When a refused job of ``tenant`` may find room: its pending jobs' measured time on the
        threads one tenant may take."""
        return max(1.0, 1000.0 * self._job_s * self.pending(tenant) / (self.threads - self._kept))

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on a pool thread in ``tenant``'s turn; a cancelled caller's job is
        skipped if it has not started.

        Raises:
            Refusal: ``overloaded`` (with ``retry_after_ms``) when ``tenant`` has
                ``max_pending_per_tenant`` jobs queued or running.
        """
        pending = self.pending(tenant)
        if pending >= self.max_pending_per_tenant:
            self.refused += 1
            raise Refusal(ErrorCode.OVERLOADED, f"{pending} image jobs of this tenant are queued; retry later",
                          retry_after_ms=self.retry_after_ms(tenant))
        loop = asyncio.get_running_loop()
        job = _Job(functools.partial(fn, *args), loop.create_future())
        self._pending[tenant] = pending + 1
        self._queue.push(tenant, job)
        self._start(loop)
        result: T = await job.future
        return result

    def running(self, tenant: str) -> int:
        """``tenant``'s jobs running now."""
        return self._running_by.get(tenant, 0)

    def _may_start(self, tenant: str) -> bool:
        return tenant not in self._running_by or self.threads - self._running > self._kept

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._running < self.threads:
            popped = self._queue.pop(self._may_start)
            if popped is None:
                return
            tenant, job = popped
            if job.future.done():  # its caller was cancelled while it waited
                self._done(tenant)
                continue
            self._running += 1
            self._running_by[tenant] = self._running_by.get(tenant, 0) + 1
            ran = loop.run_in_executor(self._executor, _timed, job.call)
            ran.add_done_callback(functools.partial(self._finished, loop, tenant, job))

    def _finished(self, loop: asyncio.AbstractEventLoop, tenant: str, job: _Job, ran: asyncio.Future[tuple[Any, float]]) -> None:
        self._running -= 1
        left = self._running_by[tenant] - 1
        if left:
            self._running_by[tenant] = left
        else:
            del self._running_by[tenant]
        self._done(tenant)
        if not job.future.done():
            exc = None if ran.cancelled() else ran.exception()
            if ran.cancelled():
                job.future.cancel()
            elif exc is not None:
                job.future.set_exception(exc)
            else:
                value, seconds = ran.result()
                self._job_s += _EWMA * (seconds - self._job_s)
                job.future.set_result(value)
        self._start(loop)

    def _done(self, tenant: str) -> None:
        left = self._pending[tenant] - 1
        if left:
            self._pending[tenant] = left
        else:
            del self._pending[tenant]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _timed(call: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    value = call()
    return value, time.perf_counter() - started
