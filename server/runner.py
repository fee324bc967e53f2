"""Per-model request queue and execution lane.

The event loop only moves work: a session submits a :class:`WorkItem`, the model's dispatcher
task picks the next item (earliest deadline first) and runs the policy in the model's lane
thread, so pings, health checks and new handshakes are answered during a long inference.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from chunkline.client.exceptions import ErrorCode
from chunkline.policies.base import Policy, stack_observations

__all__ = ["WorkItem", "Refusal", "InferenceResult", "ModelRunner"]

log = logging.getLogger("chunkline.server")


class Refusal(Exception):
    """A request was refused or failed with a wire error code.

    Args:
        code: the :class:`ErrorCode`.
        message: detail for the client (never observation content).
        retry_after_ms: when a retry may succeed (``overloaded``).
    """

    def __init__(self, code: ErrorCode, message: str, retry_after_ms: float | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


@dataclasses.dataclass
class InferenceResult:
    """One request's share of a batch: its actions and how the batch went."""

    actions: np.ndarray  # [H, A] float32
    queue_s: float
    infer_s: float
    batch_size: int
    late: bool


@dataclasses.dataclass(eq=False)
class WorkItem:
    """An admitted request waiting for, or in, the lane.

    Args:
        obs: the validated observation (fields the policy reads).
        deadline: absolute time on the runner's clock by which the reply must be sent.
        enqueued_at: when it entered the queue, on the runner's clock.
        future: resolved with an :class:`InferenceResult` or a :class:`Refusal`.
    """

    obs: dict[str, Any]
    deadline: float
    enqueued_at: float
    future: asyncio.Future[InferenceResult]
    cancelled: bool = False
    expiry: asyncio.TimerHandle | None = None


class ModelRunner:
    """Serves one policy: a bounded earliest-deadline-first queue and one execution lane.

    Args:
        name: the model name clients ask for.
        policy: the loaded policy.
        max_queue: most queued requests; more are refused with ``overloaded``.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, name: str, policy: Policy, *, max_queue: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.name = name
        self.policy = policy
        self.max_queue = max_queue
        self._clock = clock
        self._heap: list[tuple[float, int, WorkItem]] = []
        self._seq = itertools.count()
        self._lane = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lane-{name}")
        self._service_s = 0.0  # moving estimate of one inference, for retry hints
        self.running = 0

    @property
    def queued(self) -> int:
        """Requests waiting (cancelled and expired ones leave the heap lazily and are not counted)."""
        return sum(1 for _, _, item in self._heap if not item.cancelled)

    async def stop(self) -> None:
        """Fail queued work with ``shutting_down`` and release the lane thread."""
        for _, _, item in self._heap:
            if item.expiry is not None:
                item.expiry.cancel()
            if not item.future.done():
                item.future.set_exception(Refusal(ErrorCode.SHUTTING_DOWN, "server is shutting down"))
        self._heap.clear()
        self._lane.shutdown(wait=False, cancel_futures=True)

    def submit(self, obs: dict[str, Any], deadline: float) -> WorkItem:
        """Queue a validated observation.

        Raises:
            Refusal: ``overloaded`` when the queue is full, ``deadline_exceeded`` when the
                deadline has already passed.
        """
        now = self._clock()
        if deadline <= now:
            raise Refusal(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the request was queued")
        queued = self.queued
        if queued >= self.max_queue:
            retry = max(1.0, 1000.0 * self._service_s * (queued + self.running))
            raise Refusal(ErrorCode.OVERLOADED, f"queue for {self.name!r} is full", retry_after_ms=retry)
        loop = asyncio.get_running_loop()
        item = WorkItem(obs=obs, deadline=deadline, enqueued_at=now, future=loop.create_future())
        # Answer `deadline_exceeded` the moment the budget runs out while queued, not when the
        # item would have reached the lane: the robot must learn at once that nothing is coming.
        item.expiry = loop.call_later(deadline - now, self._expire, item)
        heapq.heappush(self._heap, (deadline, next(self._seq), item))
        self._kick()
        return item

    def _expire(self, item: WorkItem) -> None:
        item.cancelled = True  # lazily removed from the heap by _next
        if not item.future.done():
            item.future.set_exception(Refusal(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was queued"))

    def cancel(self, item: WorkItem) -> None:
        """Withdraw a request (client cancel or disconnect). Queued work never runs; running
        work finishes and its result is discarded."""
        item.cancelled = True
        if item.expiry is not None:
            item.expiry.cancel()
        if not item.future.done():
            item.future.set_exception(Refusal(ErrorCode.CANCELLED, "cancelled"))

    def _next(self) -> WorkItem | None:
        while self._heap:
            _, _, item = heapq.heappop(self._heap)
            if item.cancelled:
                continue
            if item.expiry is not None:
                item.expiry.cancel()
            if self._clock() >= item.deadline:
                item.future.set_exception(
                    Refusal(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was queued")
                )
                continue
            return item
        return None

    def _kick(self) -> None:
        """Start the next request if the lane is idle. Called on submit and when a batch ends;
        plain callbacks (no dispatcher task) keep the loop's share of each request small."""
        if self.running:
            return
        item = self._next()
        if item is None:
            return
        self.running = 1
        started = self._clock()
        future = asyncio.get_running_loop().run_in_executor(self._lane, self._run_batch, [item.obs])
        future.add_done_callback(functools.partial(self._finished, item, started))

    def _finished(self, item: WorkItem, started: float, future: asyncio.Future[tuple[np.ndarray, float]]) -> None:
        self.running = 0
        try:
            if future.cancelled():
                raise Refusal(ErrorCode.SHUTTING_DOWN, "server is shutting down")
            exc = future.exception()
            if exc is not None:  # the policy's failure fails this batch only; the lane lives on
                log.warning("policy %s failed: %s", self.name, type(exc).__name__, exc_info=exc)
                raise Refusal(ErrorCode.POLICY_FAILED, f"policy raised {type(exc).__name__}")
            actions, infer_s = future.result()
            self._service_s = infer_s if self._service_s == 0 else 0.8 * self._service_s + 0.2 * infer_s
            if not item.future.done():
                item.future.set_result(
                    InferenceResult(
                        actions=actions[0],
                        queue_s=started - item.enqueued_at,
                        infer_s=infer_s,
                        batch_size=1,
                        late=self._clock() > item.deadline,
                    )
                )
        except Refusal as refusal:
            if not item.future.done():
                item.future.set_exception(refusal)
        finally:
            self._kick()

    def _run_batch(self, items: list[dict[str, Any]]) -> tuple[np.ndarray, float]:
        """Lane thread: stack, infer, check the output shape."""
        spec = self.policy.spec
        batch = stack_observations(spec, items)
        t = time.perf_counter()
        actions = self.policy.infer_batch(batch)
        infer_s = time.perf_counter() - t
        expected = (len(items), spec.horizon, spec.action_dim)
        if not isinstance(actions, np.ndarray) or actions.shape != expected:
            got = getattr(actions, "shape", type(actions).__name__)
            raise ValueError(f"policy returned {got}, expected {expected}")
        return np.ascontiguousarray(actions, dtype=np.float32), infer_s
