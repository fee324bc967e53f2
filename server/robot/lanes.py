"""The execution lanes of one policy: threads that run batches, off the event loop, and their watchdog.

A lane is one dedicated thread fed by a queue. A call that hangs is abandoned, never killed (Python
cannot kill a thread): its lane gets a fresh thread. :class:`LaneWatchdog` is the one place that
decides when work on a lane is overdue (a request past its deadline, a call past its hang time).
:func:`run_batch` isolates a failed batch's requests, so one robot's poisoned observation fails only
its own request. :meth:`LanePool.join` waits for the lanes to finish their current call before the
interpreter exits: a thread still inside native code (BLAS) at exit can hang the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from chunkline.policies.base import Policy, example_observation, stack_observations
from chunkline.policies.prefix import ActionPrefix, stack_prefixes
from chunkline.server.robot.timing import out_of_memory, release_device_memory

__all__ = ["LanePool", "LaneDone", "LaneRun", "LaneWatchdog", "Overdue", "BatchOutcome", "infer_pass", "run_batch",
           "probe_pass"]

T = TypeVar("T")

log = logging.getLogger("chunkline.server")


@dataclasses.dataclass(slots=True)
class BatchOutcome:
    """What a lane returns for a batch.

    Args:
        actions: per request, its actions or the exception its own run raised: the batch's
            ``[B, H, A]`` array itself when the batch's own pass succeeded (indexed per request,
            never iterated: iterating an array ends on an ``IndexError`` numpy formats a message for).
        infer_s: the batch's time on the lane.
        states: the new session states (stateful policies), one per request.
        batch_error: the batch's own pass's exception when its requests had to be run one at a
            time (an out-of-memory caps the batch size).
    """

    actions: np.ndarray | list[np.ndarray | BaseException]
    infer_s: float
    states: list[Any] | None
    batch_error: BaseException | None


def infer_pass(policy: Policy, items: list[dict[str, Any]], states: list[Any] | None,
           prefixes: list[ActionPrefix | None] | None = None) -> tuple[np.ndarray, list[Any] | None]:
    """Stack, run the policy, check the output's shape. A policy that accepts a prefix gets every
    item's prefix on its chunk's grid (items without one: an all-false mask)."""
    spec = policy.spec
    batch = stack_observations(spec, items)
    if policy.accepts_prefix:
        stacked = stack_prefixes(prefixes or [None] * len(items), horizon=spec.horizon, action_dim=spec.action_dim,
                                 action_offset=spec.action_offset)
        actions, states = policy.infer_batch_with_prefix(batch, stacked, states)
        if states is not None and len(states) != len(items):
            raise ValueError(f"policy returned {len(states)} session states for {len(items)} requests")
    elif states is None:
        actions = policy.infer_batch(batch)
    else:
        actions, states = policy.infer_batch_with_state(batch, states)
        if len(states) != len(items):
            raise ValueError(f"policy returned {len(states)} session states for {len(items)} requests")
    expected = (len(items), spec.horizon, spec.action_dim)
    if not isinstance(actions, np.ndarray) or actions.shape != expected:
        got = getattr(actions, "shape", type(actions).__name__)
        raise ValueError(f"policy returned {got}, expected {expected}")
    return np.ascontiguousarray(actions, dtype=np.float32), states


def run_batch(policy: Policy, items: list[dict[str, Any]], states: list[Any] | None,
              prefixes: list[ActionPrefix | None] | None = None) -> BatchOutcome:
    """Lane thread: one forward pass for the batch. If it fails, each request is run alone."""
    t = time.perf_counter()
    try:
        actions, states = infer_pass(policy, items, states, prefixes)
        return BatchOutcome(actions, time.perf_counter() - t, states, None)
    except Exception as exc:
        if len(items) == 1:
            raise
        batch_error = exc
        if out_of_memory(exc):
            release_device_memory()  # the one-at-a-time passes below need what the batch held
    out: list[np.ndarray | BaseException] = []
    new_states: list[Any] | None = None if states is None else []
    for i, item in enumerate(items):
        try:
            one, state = infer_pass(policy, [item], None if states is None else [states[i]],
                                None if prefixes is None else [prefixes[i]])
            out.append(one[0])
            if new_states is not None and state is not None:
                new_states.append(state[0])
        except Exception as exc:  # this request's own failure
            out.append(exc)
            if new_states is not None and states is not None:
                new_states.append(states[i])
    return BatchOutcome(out, time.perf_counter() - t, new_states, batch_error)


def probe_pass(policy: Policy) -> float:
    """Lane thread: one pass on an example observation, timed as a batch is (seconds)."""
    obs = example_observation(policy.spec, np.random.default_rng(0))
    started = time.perf_counter()
    infer_pass(policy, [obs], None)
    return time.perf_counter() - started


#: What a lane hands back to the loop: ``done(result, error)``, exactly one of them set. A job
#: that never ran (the pool shut down first) gets a :class:`concurrent.futures.CancelledError`.
LaneDone = Callable[[Any, BaseException | None], None]
_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, LaneDone]


def _hand_back(loop: asyncio.AbstractEventLoop, done: LaneDone, result: Any, error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(done, result, error)
    except RuntimeError:  # the loop has closed (the server stopped): nobody is left to answer
        pass


def _run(job: _Job) -> None:
    fn, args, loop, done = job
    try:
        result = fn(*args)
    except BaseException as exc:  # the policy's own failure: the loop decides what it means
        _hand_back(loop, done, None, exc)
    else:
        _hand_back(loop, done, result, None)


def _lane_main(jobs: queue.SimpleQueue[_Job | None], init: Callable[[], None] | None) -> None:
    """A lane thread: ``init()`` first (per-thread settings such as torch's threads), then run
    jobs in order until the stop marker (``None``).

    Each job's outcome goes back to the loop with one ``call_soon_threadsafe``: no future, no
    executor work item, no lock, and one loop wake-up per batch rather than one per request.
    (A job runs in its own frame, :func:`_run`, so that its arrays are freed as soon as it ends,
    not kept alive while the lane waits for the next one.)
    """
    if init is not None:
        try:
            init()
        except Exception:  # the lane still serves, with the library's defaults
            log.exception("%s: setting up the lane thread failed", threading.current_thread().name)
    while (job := jobs.get()) is not None:
        _run(job)
        del job


def _drain(jobs: queue.SimpleQueue[_Job | None]) -> list[_Job]:
    out: list[_Job] = []
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return out
        if job is not None:
            out.append(job)


def _nothing() -> None:
    return None


def _resolver(future: asyncio.Future[None]) -> LaneDone:
    """A lane's answer that resolves ``future`` (on the loop), whatever the job's outcome."""

    def done(_result: Any, _error: BaseException | None) -> None:
        if not future.done():
            future.set_result(None)

    return done


class LanePool:
    """The lanes of one policy: each a dedicated daemon thread fed by its own queue.

    A plain thread and a :class:`queue.SimpleQueue` rather than a one-worker executor: no future
    or lock per call, and the loop only needs the outcome. Daemon threads, so that a call hung for
    good cannot keep the process alive; :meth:`stop` ends the others before exit.

    Args:
        name: the model's name (thread names say which policy a lane serves).
        count: how many lanes.
        init: run first on every lane thread, a replacement's too (see :mod:`.cpu_threads`).
    """

    def __init__(self, name: str, count: int, init: Callable[[], None] | None = None) -> None:
        self.name = name
        self._init = init
        self._threads: list[threading.Thread] = []
        self._queues = [self._new_lane(i) for i in range(count)]
        #: idle lanes; the scheduler pops one to start a batch and appends it back when done
        self.idle = list(range(count))
        #: when each lane last became free (the split between queueing and batching waits)
        self.free_at = [0.0] * count

    def _new_lane(self, index: int) -> queue.SimpleQueue[_Job | None]:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        thread = threading.Thread(target=_lane_main, args=(jobs, self._init), name=f"lane-{self.name}-{index}", daemon=True)
        thread.start()
        if index < len(self._threads):
            self._threads[index] = thread
        else:
            self._threads.append(thread)
        return jobs

    @property
    def count(self) -> int:
        """How many lanes the policy has."""
        return len(self._queues)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The lanes' current threads (not those abandoned to a hung call)."""
        return tuple(self._threads)

    def submit(self, lane: int, fn: Callable[..., Any], args: tuple[Any, ...], done: LaneDone) -> None:
        """Run ``fn(*args)`` on ``lane`` after what it already has; ``done(result, error)`` is
        then called on the running loop (the caller's)."""
        self._queues[lane].put((fn, args, asyncio.get_running_loop(), done))

    def replace(self, lane: int) -> None:
        """Abandon the lane's hung call and give the lane a fresh thread (idle again). Jobs queued
        behind the hung call move to the new thread; the old one exits if its call ever returns."""
        old = self._queues[lane]
        waiting = _drain(old)
        old.put(None)
        self._queues[lane] = self._new_lane(lane)
        for job in waiting:
            self._queues[lane].put(job)
        self.idle.append(lane)

    def release(self, lane: int, now: float) -> float:
        """The lane's batch finished at ``now``: it is idle again. Returns when it was last freed before."""
        previous = self.free_at[lane]
        self.idle.append(lane)
        self.free_at[lane] = now
        return previous

    def shutdown(self) -> None:
        """Stop every lane after its current call; jobs not started are answered cancelled."""
        for jobs in self._queues:
            for _fn, _args, loop, done in _drain(jobs):
                _hand_back(loop, done, None, concurrent.futures.CancelledError())
            jobs.put(None)

    async def stop(self, timeout: float) -> bool:
        """:meth:`shutdown`, then wait up to ``timeout`` seconds for every lane to finish its
        current call and its thread to end. Returns ``False`` when a lane was still busy then (it
        is left to finish on its own, as a hung call is)."""
        loop = asyncio.get_running_loop()
        ended: list[asyncio.Future[None]] = []
        for jobs in self._queues:
            for _fn, _args, job_loop, done in _drain(jobs):
                _hand_back(job_loop, done, None, concurrent.futures.CancelledError())
            marker: asyncio.Future[None] = loop.create_future()
            # Jobs run in order: the marker's answer comes once the current call has returned.
            jobs.put((_nothing, (), loop, _resolver(marker)))
            jobs.put(None)
            ended.append(marker)
        if not ended:
            return True
        _, busy = await asyncio.wait(ended, timeout=timeout)
        for thread, marker in zip(self._threads, ended, strict=True):
            if marker.done():
                thread.join(timeout=5.0)  # past the marker: only the stop marker is left to read
        return not busy


@dataclasses.dataclass(eq=False, slots=True)
class LaneRun(Generic[T]):
    """Work on a lane as its watchdog sees it: a batch of requests, or a pass of the runner's own
    (a timing pass: no requests, a worker token in admission).

    Args:
        lane: the lane it runs on.
        started: when it was handed to the lane.
        hang_at: when it is declared hung if it has not returned.
        batch: its requests (empty for a pass of the runner's own).
        watched: those whose deadline is watched, latest deadline first.
        timing: the batch size a timing pass times (``None`` for a batch).
        busy: admission's token for the worker a timing pass occupies.
    """

    lane: int
    started: float
    hang_at: float
    batch: list[Any]
    watched: list[T]
    timing: int | None = None
    busy: int | None = None


@dataclasses.dataclass(slots=True)
class Overdue(Generic[T]):
    """What a watchdog firing found: requests past their deadline, runs past their hang time."""

    expired: list[T]
    hung: list[LaneRun[T]]


class LaneWatchdog(Generic[T]):
    """When work on the lanes is overdue (sans-I/O: the caller brings the time and the timer).

    Each request of a running batch is failed at its own deadline; a run past its hang time is
    declared hung (its lane is to be replaced) and, if its call ever returns, :meth:`end` says so
    once. A run that ends leaves the caller's timer armed: a spare firing finds nothing due.

    Args:
        deadline_of: a watched request's deadline.
        answered: whether a watched request has been answered already (it needs no watching).
        hang_timeout: a run this long, and longer than ten times its predicted time, is hung.
    """

    def __init__(self, deadline_of: Callable[[T], float], answered: Callable[[T], bool], hang_timeout: float) -> None:
        self.hang_timeout = hang_timeout
        self._deadline_of = deadline_of
        self._answered = answered
        self._running: dict[int, LaneRun[T]] = {}
        #: calls declared hung that have not returned (the policy is not healthy while any are)
        self.hung = 0

    @property
    def running(self) -> tuple[LaneRun[T], ...]:
        return tuple(self._running.values())

    def hang_at(self, started: float, predicted_s: float) -> float:
        """When a run started at ``started`` and predicted to take ``predicted_s`` is hung."""
        # (compared rather than by max(): once per batch)
        if math.isfinite(predicted_s) and 10 * predicted_s > self.hang_timeout:
            return started + 10 * predicted_s
        return started + self.hang_timeout

    def start(self, run: LaneRun[T]) -> float:
        """Watch ``run``, whose watched requests are not answered yet (they were queued until it
        started); returns when it is next due (arm the timer for it)."""
        self._running[run.lane] = run
        watched = run.watched
        if watched:
            first = self._deadline_of(watched[-1])
            if first < run.hang_at:
                return first
        return run.hang_at

    def end(self, run: LaneRun[T]) -> bool:
        """``run`` returned. ``False`` when it had been declared hung (its outcome is to be
        ignored: its requests were answered and its lane replaced then)."""
        if self._running.get(run.lane) is run:
            del self._running[run.lane]
            return True
        self.hung -= 1
        return False

    def overdue(self, now: float) -> Overdue[T]:
        """The requests whose deadline has come by ``now`` and the runs whose hang time has (these
        stop being watched)."""
        out: Overdue[T] = Overdue([], [])
        for lane, run in list(self._running.items()):
            watched = run.watched
            while watched and self._deadline_of(watched[-1]) <= now:
                out.expired.append(watched.pop())
            if run.hang_at <= now:
                del self._running[lane]
                self.hung += 1
                out.hung.append(run)
        return out

    def next_due(self) -> float | None:
        """The earliest time a watched run is due, ``None`` when nothing runs."""
        return min((self._due(run) for run in self._running.values()), default=None)

    def _due(self, run: LaneRun[T]) -> float:
        watched = run.watched
        while watched and self._answered(watched[-1]):
            watched.pop()  # answered already (cancelled): nothing to watch
        return min(self._deadline_of(watched[-1]), run.hang_at) if watched else run.hang_at

