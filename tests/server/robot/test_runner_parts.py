"""The pieces the runner is built from, without an event loop: the lanes' watchdog, the arrival
tracker, the batch-size tuner and the per-session states (injected times throughout); and the
runner's stop, which waits for a lane's current call before the interpreter may exit."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policies_for_tests import CountingPolicy

from chunkline.policies.base import ArraySpec, PolicySpec
from chunkline.policies.embedded.noop import NoopPolicy
from chunkline.server.core.admission import AdmissionConfig, ServiceTimeModel
from chunkline.server.core.quotas import QuotaManager
from chunkline.server.core.tenants import TenantRegistry
from chunkline.server.robot.batching import ArrivalTracker, BatchPolicy
from chunkline.server.robot.lanes import LaneRun, LaneWatchdog
from chunkline.server.robot.runner import ModelRunner
from chunkline.server.robot.session_states import SessionStates
from chunkline.server.robot.sizing import BatchSizeTuner, BatchSizing, MemorySample

ANON = TenantRegistry.anonymous()
GIB = 1 << 30


class _Clock:
    """An injected clock the test sets."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class _Item:
    deadline: float
    done: bool = False


def _watchdog(hang_timeout: float = 10.0) -> LaneWatchdog[_Item]:
    return LaneWatchdog(lambda i: i.deadline, lambda i: i.done, hang_timeout)


# ----------------------------------------------------------------------------- watchdog


def test_the_watchdog_fails_each_request_at_its_own_deadline_then_declares_the_run_hung() -> None:
    dog = _watchdog()
    items = [_Item(3.0), _Item(1.0), _Item(2.0)]
    run = LaneRun(0, 0.0, dog.hang_at(0.0, 0.5), ["batch"], sorted(items, key=lambda i: -i.deadline))
    assert run.hang_at == 10.0  # the hang timeout: more than ten times the predicted 0.5 s
    assert dog.start(run) == 1.0 and dog.next_due() == 1.0
    assert dog.overdue(0.5).expired == []
    assert dog.overdue(2.0).expired == [items[1], items[2]]
    items[0].done = True  # answered (cancelled): no longer watched
    assert dog.next_due() == 10.0
    overdue = dog.overdue(10.0)
    assert overdue.expired == [] and overdue.hung == [run] and dog.hung == 1 and dog.next_due() is None
    assert dog.end(run) is False and dog.hung == 0  # the abandoned call returned at last: ignored


def test_a_timing_pass_is_watched_as_a_batch_is_and_a_run_that_ends_is_forgotten() -> None:
    dog = _watchdog(hang_timeout=1.0)
    timing: LaneRun[_Item] = LaneRun(1, 5.0, dog.hang_at(5.0, 0.3), [], [], timing=8, busy=7)
    assert timing.hang_at == 8.0  # ten times its predicted time, above the hang timeout
    batch = LaneRun(0, 5.0, dog.hang_at(5.0, math.inf), [], [_Item(6.0)])
    assert batch.hang_at == 6.0
    dog.start(timing)
    dog.start(batch)
    assert dog.next_due() == 6.0
    assert dog.end(batch) is True
    assert dog.next_due() == 8.0 and dog.overdue(7.9).hung == []
    assert dog.overdue(8.0).hung == [timing] and dog.hung == 1


# ----------------------------------------------------------------------------- arrivals


_ops = st.lists(st.tuples(st.sampled_from(["admit", "answer", "tick"]), st.integers(0, 5)), max_size=60)


@settings(max_examples=80, deadline=None)
@given(_ops)
def test_the_sessions_waiting_for_a_reply_are_counted_incrementally(ops: list[tuple[str, int]]) -> None:
    # The oracle recounts from scratch what the tracker keeps up to date: sessions with a request
    # pending wait; the others are idle until forgotten, silent 2 s or more at the first admission
    # a second or more after the last pruning.
    clock = _Clock(100.0)
    tracker = ArrivalTracker(clock)
    now, pruned_at = 100.0, 0.0
    pending: dict[str, int] = {}
    seen: dict[str, float] = {}
    for kind, n in ops:
        session = f"s{n}"
        if kind == "admit":
            tracker.admitted(session, now + 1.0, now)
            pending[session] = pending.get(session, 0) + 1
            seen[session] = now
            if now - pruned_at > 1.0:
                pruned_at = now
                seen = {s: t for s, t in seen.items() if s in pending or now - t < 2.0}
        elif kind == "answer" and pending:
            s = sorted(pending)[n % len(pending)]
            tracker.answered(s)
            pending[s] -= 1
            if not pending[s]:
                del pending[s]
        else:
            now += 0.7 * n
            clock.now = now
        assert tracker.waiting == len(pending)
        assert tracker.idle == sum(1 for s in seen if s not in pending)


def test_a_busy_robot_does_not_make_quiet_sessions_look_like_company() -> None:
    # One robot in closed loop (a request every millisecond) while four others went quiet a
    # second ago: its requests have nobody to wait for, however high the overall rate.
    clock = _Clock()
    tracker, policy = ArrivalTracker(clock), BatchPolicy(max_batch_size=8, max_batch_wait=0.002)
    now = 10.0
    for quiet in ("q1", "q2", "q3", "q4"):
        for k in range(20):
            clock.now = now + k * 0.001
            tracker.admitted(quiet, 99.0, clock.now)
            tracker.answered(quiet)
    now += 1.0
    for _ in range(50):
        now += 0.001
        clock.now = now
        tracker.admitted("busy", 99.0, now)
        tracker.answered("busy")
    tracker.admitted("busy", 99.0, now + 0.001)
    assert tracker.expected_rate(now + 0.001) < policy.rate_worth_waiting
    # the same robots all streaming: waiting for company pays
    for k in range(20):
        for quiet in ("q1", "q2", "q3", "q4"):
            clock.now = now + k * 0.001
            tracker.admitted(quiet, 99.0, clock.now)
            tracker.answered(quiet)
    assert tracker.expected_rate(now + 0.02) >= policy.rate_worth_waiting


def test_a_session_that_ended_sends_nothing_more_and_the_sum_stops_once_enough() -> None:
    clock = _Clock()
    tracker = ArrivalTracker(clock)
    for k in range(10):
        for s in ("a", "b"):
            clock.now = 1.0 + k * 0.01
            tracker.admitted(s, 99.0, clock.now)
            tracker.answered(s)
    both = tracker.expected_rate(1.1)
    assert both == pytest.approx(2 * tracker.expected_rate(1.1, enough=1.0))  # one session's rate reaches 1/s
    tracker.admitted("a", 99.0, 1.1)
    tracker.forget("a")
    tracker.answered("a")  # its request's answer, after the session ended: ignored
    assert tracker.idle == 1 and tracker.waiting == 0
    assert tracker.expected_rate(1.1) == pytest.approx(both / 2)


def test_the_window_opens_with_the_first_request_queued_and_closes_when_the_queue_empties() -> None:
    clock = _Clock(2.0)
    tracker = ArrivalTracker(clock)
    tracker.admitted("a", 5.0, 1.0)
    tracker.admitted("b", 3.0, 2.0)
    assert (tracker.window_start, tracker.window_deadline, tracker.last_arrival) == (1.0, 3.0, 2.0)
    tracker.queue_emptied()
    assert tracker.window_start == tracker.window_deadline == math.inf
    # two robots each waiting for its own reply: nobody else could join a batch
    assert tracker.waiting == 2 and tracker.expected_rate(2.0) == 0.0
    tracker.answered("a")
    assert tracker.expected_rate(2.0) == 0.0  # one arrival: no rate of its own yet
    tracker.admitted("a", 5.0, 2.5)
    clock.now = 2.5
    tracker.answered("a")
    assert tracker.expected_rate(2.5) > 0


# ----------------------------------------------------------------------------- batch sizes


def test_the_tuner_grows_under_backlog_caps_on_failure_and_says_when_every_size_is_timed() -> None:
    tuner = BatchSizeTuner("m", BatchPolicy(max_batch_size=8), BatchSizing(8, (1,)))
    assert tuner.batching_now(0).max_batch_size == 1
    assert tuner.next_timing(-math.inf, lambda n: 0.01) is None  # not serving yet
    assert tuner.serving(10.0)
    size, at = tuner.next_timing(10.0, lambda n: 0.01) or (0, 0.0)
    assert size == 2 and at == 10.5  # a quiet spell of at least quiet_s
    assert tuner.batching_now(5).max_batch_size == 2  # one rung more under a backlog
    tuner.ran(2)
    tuner.start(4)
    assert tuner.timing and tuner.timed(4, 0.02, None, 11.0) is None and not tuner.timing
    assert tuner.failed(8, "ran out of memory", 12.0) == 4  # admission must follow the cap
    assert tuner.max_batch_size == 4 and tuner.sizes_timed_at == 12.0  # 1, 2 and 4 timed: done
    assert tuner.batching_now(100).max_batch_size == 4
    assert tuner.timing_left  # not asked since: the next ask finds nothing and stops the asking
    assert tuner.next_timing(13.0, lambda n: 0.01) is None and not tuner.timing_left


def test_the_tuner_applies_the_memory_guard_from_a_timing_pass() -> None:
    tuner = BatchSizeTuner("m", BatchPolicy(max_batch_size=16), BatchSizing(16, (1,)))
    tuner.serving(0.0)
    tuner.start(2)
    # 1 GiB per robot over a 2 GiB base, 10 GiB available at 90%: 7 robots fit
    assert tuner.timed(2, 0.01, MemorySample(base=2 * GIB, peak=4 * GIB, limit=10 * GIB), 1.0) == 7


def test_without_sizing_every_size_runs_and_nothing_is_timed() -> None:
    tuner = BatchSizeTuner("m", BatchPolicy(max_batch_size=8), None)
    assert tuner.batching_now(1).max_batch_size == 8 and not tuner.serving(0.0)
    assert tuner.failed(8, "hung", 1.0) is None and tuner.next_timing(0.0, lambda n: 0.0) is None
    assert not tuner.timing_left


# ----------------------------------------------------------------------------- session states


@dataclasses.dataclass
class _Req:
    session: str
    obs: dict[str, Any]
    prefix: Any = None


def test_each_session_keeps_its_own_state_and_a_released_one_starts_afresh() -> None:
    policy = CountingPolicy()
    policy.stateful = True
    states = SessionStates(policy)
    args = states.batch_args([_Req("a", {"x": 1}), _Req("b", {"x": 2})])
    assert args.observations == [{"x": 1}, {"x": 2}] and args.prefixes is None
    assert args.states == [policy.new_session_state()] * 2
    states.store("a", "after one")
    assert states.batch_args([_Req("a", {})]).states == ["after one"] and len(states) == 1
    states.release("a")
    assert states.batch_args([_Req("a", {})]).states == [policy.new_session_state()] and len(states) == 0


# ----------------------------------------------------------------------------- stop


class _Blocking(NoopPolicy):
    """Its batches of ``blocks_at`` robots and more wait for ``release`` (as a BLAS call would run)."""

    def __init__(self, blocks_at: int) -> None:
        super().__init__("blocking", PolicySpec(observation={"state": ArraySpec((4,), "float32")}, action_dim=2,
                                                horizon=3, dt=0.05))
        self.blocks_at = blocks_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def infer_batch(self, obs: Mapping[str, Any]) -> np.ndarray:
        if len(obs["state"]) >= self.blocks_at:
            self.entered.set()
            self.release.wait(30)
            self.returned.set()
        return super().infer_batch(obs)


def _blocking_runner(policy: _Blocking, clock: list[float]) -> ModelRunner:
    return ModelRunner("m", policy, quotas=QuotaManager(ANON), admission=AdmissionConfig(max_batch_size=4),
                       batching=BatchPolicy(max_batch_size=4, max_batch_wait=0.0), service=ServiceTimeModel(initial={1: 1e-4}),
                       sizing=BatchSizing(4, (1,), quiet_s=0.0), clock=lambda: clock[0])


def test_stop_waits_for_a_running_timing_pass_and_its_lane_thread_to_end() -> None:
    policy = _Blocking(blocks_at=2)  # the background timing of batch 2 blocks
    clock = [100.0]

    async def go() -> tuple[bool, list[threading.Thread]]:
        runner = _blocking_runner(policy, clock)
        runner.start_background_timing()  # idle and quiet: the pass of batch 2 starts at once
        assert await asyncio.to_thread(policy.entered.wait, 10)
        threads = [t for t in threading.enumerate() if t.name.startswith("lane-m-")]
        stopping = asyncio.ensure_future(runner.stop(timeout_s=30))
        for _ in range(20):
            await asyncio.sleep(0)
        waited = not stopping.done()  # still inside the pass: stop has not returned
        policy.release.set()
        await stopping
        return waited, threads

    waited, threads = asyncio.run(go())
    assert waited and policy.returned.is_set()
    assert threads and not any(t.is_alive() for t in threads)  # every lane thread has ended


def test_stop_gives_up_on_a_lane_past_its_bound_and_starts_no_timing_pass_once_stopped() -> None:
    policy = _Blocking(blocks_at=2)
    clock = [100.0]

    async def go() -> bool:
        runner = _blocking_runner(policy, clock)
        runner.start_background_timing()
        assert await asyncio.to_thread(policy.entered.wait, 10)
        threads = [t for t in threading.enumerate() if t.name.startswith("lane-m-")]
        await runner.stop(timeout_s=0.0)  # bounded: a lane still busy is left to finish
        abandoned = not policy.returned.is_set()
        policy.release.set()
        await asyncio.to_thread(lambda: [t.join(10) for t in threads])  # its outcome is handed back before it ends
        for _ in range(3):
            await asyncio.sleep(0)  # the pass's outcome comes back to a stopped runner: nothing new starts
        sizing = runner.sizing
        assert sizing is not None and sizing.timing is None and 4 in sizing.pending and runner.running == 0
        return abandoned

    assert asyncio.run(go())
