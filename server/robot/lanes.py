"""The execution lanes of one policy: threads that run batches, off the event loop.

A lane is a single-thread executor; a policy has ``lanes`` of them, so that many batches run at
once. :class:`LanePool` tracks which lanes are idle, when each became free, and replaces a lane
whose call has hung (the stuck thread is abandoned, never killed: Python cannot kill a thread).
:func:`run_batch` is what a lane runs: one forward pass for a batch, and per-request isolation
when it fails, so that one robot's poisoned observation fails only its own request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from chunkline.policies.base import Policy, example_observation, stack_observations
from chunkline.policies.prefix import ActionPrefix, stack_prefixes
from chunkline.server.robot.timing import out_of_memory, release_device_memory

__all__ = ["LanePool", "BatchOutcome", "run_batch", "probe_pass", "call_on_loop"]

#: What a lane returns for a batch: per request its actions or the exception its own run raised,
#: the batch's time, the new session states (stateful policies), and the exception of the
#: batch's own pass when its requests had to be run one at a time (an out-of-memory caps the
#: batch size).
BatchOutcome = tuple[list[np.ndarray | BaseException], float, list[Any] | None, BaseException | None]


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], future: concurrent.futures.Future[Any]) -> None:
    """A lane future's done-callback (it runs in the lane thread): hand ``fn(future)`` to the loop."""
    try:
        loop.call_soon_threadsafe(fn, future)
    except RuntimeError:  # the loop has closed (the server stopped): nobody is left to answer
        pass


def _infer(policy: Policy, items: list[dict[str, Any]], states: list[Any] | None,
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
        actions, states = _infer(policy, items, states, prefixes)
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
            one, state = _infer(policy, [item], None if states is None else [states[i]],
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
    _infer(policy, [obs], None)
    return time.perf_counter() - started


class LanePool:
    """The lanes of one policy.

    Args:
        name: the model's name (thread names say which policy a lane serves).
        count: how many lanes.
    """

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self._lanes = [self._new_lane(i) for i in range(count)]
        #: bumped when a hung lane is replaced: a call that returns from an older generation is stale
        self.generation = [0] * count
        #: idle lanes; the scheduler pops one to start a batch and appends it back when done
        self.idle = list(range(count))
        #: when each lane last became free (the split between queueing and batching waits)
        self.free_at = [0.0] * count
        #: abandoned calls still running (the policy is not healthy while any are)
        self.hung = 0

    def _new_lane(self, index: int) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lane-{self.name}-{index}")

    def submit(self, lane: int, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        return self._lanes[lane].submit(fn, *args)

    def replace(self, lane: int) -> None:
        """Abandon the lane's hung call and give the lane a fresh thread (idle again)."""
        self.hung += 1
        self.generation[lane] += 1
        self._lanes[lane].shutdown(wait=False)  # the stuck thread is abandoned, not killed
        self._lanes[lane] = self._new_lane(lane)
        self.idle.append(lane)

    def release(self, lane: int, now: float) -> float:
        """The lane's batch finished at ``now``: it is idle again. Returns when it was last freed before."""
        previous = self.free_at[lane]
        self.idle.append(lane)
        self.free_at[lane] = now
        return previous

    def shutdown(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)
