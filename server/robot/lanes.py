"""The execution lanes of one policy: threads that run batches, off the event loop.

A lane is one dedicated thread fed by a queue; a policy has ``lanes`` of them, so that many
batches run at once. :class:`LanePool` tracks which lanes are idle, when each became free, and replaces a lane
whose call has hung (the stuck thread is abandoned, never killed: Python cannot kill a thread).
:func:`run_batch` is what a lane runs: one forward pass for a batch, and per-request isolation
when it fails, so that one robot's poisoned observation fails only its own request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from chunkline.policies.base import Policy, example_observation, stack_observations
from chunkline.policies.prefix import ActionPrefix, stack_prefixes
from chunkline.server.robot.timing import out_of_memory, release_device_memory

__all__ = ["LanePool", "LaneDone", "BatchOutcome", "infer_pass", "run_batch", "probe_pass"]

#: What a lane returns for a batch: per request its actions or the exception its own run raised,
#: the batch's time, the new session states (stateful policies), and the exception of the
#: batch's own pass when its requests had to be run one at a time (an out-of-memory caps the
#: batch size).
BatchOutcome = tuple[list[np.ndarray | BaseException], float, list[Any] | None, BaseException | None]


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
        return list(actions), time.perf_counter() - t, states, None
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
    return out, time.perf_counter() - t, new_states, batch_error


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


def _lane_main(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """A lane thread: run jobs in order until the stop marker (``None``).

    Each job's outcome goes back to the loop with one ``call_soon_threadsafe``: no future, no
    executor work item, no lock, and one loop wake-up per batch rather than one per request.
    (A job runs in its own frame, :func:`_run`, so that its arrays are freed as soon as it ends,
    not kept alive while the lane waits for the next one.)
    """
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


class LanePool:
    """The lanes of one policy: each a dedicated thread fed by its own queue.

    A plain thread and a :class:`queue.SimpleQueue` rather than a one-worker
    ``ThreadPoolExecutor``: the executor builds a future and a work item per call, takes its
    locks, and its done-callback hop adds nothing here, since the loop only needs the outcome.
    Lane threads are daemons: a policy call that hangs forever must not keep the process from
    exiting (an executor's threads are joined at interpreter exit).

    Args:
        name: the model's name (thread names say which policy a lane serves).
        count: how many lanes.
    """

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self._threads: dict[int, threading.Thread] = {}  # each lane's current thread (joined at shutdown)
        self._queues = [self._new_lane(i) for i in range(count)]
        #: idle lanes; the scheduler pops one to start a batch and appends it back when done
        self.idle = list(range(count))
        #: when each lane last became free (the split between queueing and batching waits)
        self.free_at = [0.0] * count
        #: abandoned calls still running (the policy is not healthy while any are)
        self.hung = 0

    def _new_lane(self, index: int) -> queue.SimpleQueue[_Job | None]:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        thread = threading.Thread(target=_lane_main, args=(jobs,), name=f"lane-{self.name}-{index}", daemon=True)
        thread.start()
        self._threads[index] = thread
        return jobs

    @property
    def count(self) -> int:
        """How many lanes the policy has."""
        return len(self._queues)

    def submit(self, lane: int, fn: Callable[..., Any], args: tuple[Any, ...], done: LaneDone) -> None:
        """Run ``fn(*args)`` on ``lane`` after what it already has; ``done(result, error)`` is
        then called on the running loop (the caller's)."""
        self._queues[lane].put((fn, args, asyncio.get_running_loop(), done))

    def replace(self, lane: int) -> None:
        """Abandon the lane's hung call and give the lane a fresh thread (idle again). Jobs queued
        behind the hung call move to the new thread; the old one exits if its call ever returns."""
        self.hung += 1
        old = self._queues[lane]
        waiting = _drain(old)
        old.put(None)  # the stuck thread is abandoned, not killed: it stops after its call
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

    def shutdown(self, join_s: float = 2.0) -> None:
        """Stop every lane after its current call; jobs not started are answered cancelled.

        Waits up to ``join_s`` in all for the lanes' current calls (a background timing pass):
        a daemon thread still inside native code (torch, BLAS) when the interpreter exits is
        killed by ``pthread_exit`` as it retakes the GIL, which aborts the process."""
        for jobs in self._queues:
            for _fn, _args, loop, done in _drain(jobs):
                _hand_back(loop, done, None, concurrent.futures.CancelledError())
            jobs.put(None)
        deadline = time.monotonic() + join_s
        for thread in self._threads.values():
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
