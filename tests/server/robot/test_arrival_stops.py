"""A closed-loop session judged against its own reply-to-next-request time: one that has stopped
is no company to wait for, while steady fleets decide exactly as when no session ever stops
(a side-by-side simulation of the batching rule on an injected clock)."""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

import pytest

from chunkline.server.robot.batching import STOPPED_AFTER_GAPS, ArrivalTracker, BatchPolicy, dispatch_time


class _Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _closed_loop(tracker: ArrivalTracker, clock: _Clock, session: str, start: float, gap: float, n: int) -> float:
    """``n`` requests of ``session``, each answered at once and the next sent ``gap`` later;
    returns when the last was answered."""
    t = start
    for _ in range(n):
        clock.now = t
        tracker.admitted(session, t + 1.0, t)
        tracker.answered(session)
        t += gap
    return t - gap


def test_a_session_quiet_for_many_of_its_usual_gaps_has_stopped() -> None:
    clock = _Clock()
    tracker = ArrivalTracker(clock)
    last = _closed_loop(tracker, clock, "robot", 10.0, 0.001, 30)
    assert tracker.expected_rate(last + 0.0005) > 0  # due about now
    stops = tracker.stops_at(last + 0.0005)
    assert stops == pytest.approx(last + STOPPED_AFTER_GAPS * 0.001)
    assert tracker.expected_rate(stops - 1e-6) > 0
    assert tracker.expected_rate(stops + 1e-6) == 0.0
    assert tracker.stops_at(stops + 1e-6) == math.inf
    # it sends again: expected once more, on its new rhythm
    _closed_loop(tracker, clock, "robot", stops + 0.5, 0.001, 1)
    assert tracker.expected_rate(stops + 0.5) > 0


def test_a_session_not_seen_back_yet_or_waiting_for_its_reply_never_stops() -> None:
    clock = _Clock(1.0)
    tracker = ArrivalTracker(clock)
    tracker.admitted("a", 9.0, 1.0)
    assert tracker.stops_at(1.0) == math.inf  # waiting for its reply
    tracker.answered("a")
    assert tracker.stops_at(1.0) == math.inf  # no reply-to-request time of its own yet


def test_company_from_a_session_that_moved_on_is_not_waited_for_past_its_stop() -> None:
    # A robot in closed loop (a reply every millisecond, its next request a millisecond later)
    # ends; another session's request lands a millisecond after the robot's last reply.
    clock = _Clock()
    tracker = ArrivalTracker(clock)
    policy = BatchPolicy(max_batch_size=8, max_batch_wait=0.002)
    last = _closed_loop(tracker, clock, "robot", 5.0, 0.001, 50)
    now = last + 0.001
    tracker.admitted("other", now + 1.0, now)
    rate = tracker.expected_rate(now, enough=policy.rate_worth_waiting)
    at = dispatch_time(now, queued=1, oldest_arrival=now, earliest_deadline=now + 1.0, policy=policy,
                       predict=lambda n: 0.0001, arrival_rate=rate)
    assert at == pytest.approx(now + policy.max_batch_wait)  # the robot is due: waiting may pay
    assert min(at, tracker.stops_at(now)) == pytest.approx(last + STOPPED_AFTER_GAPS * 0.001)  # until it is overdue


@dataclasses.dataclass(order=True)
class _Event:
    at: float
    kind: int  # 0: a batch ends, 1: a request arrives, 2: the dispatch timer
    robot: int = 0


def _simulate(robots: int, hz: float, stopped_after: float, seconds: float, seed: int) -> list[tuple[float, int]]:
    """A fleet in closed loop at ``hz`` (each robot sends at its tick, or when its reply comes if
    later, with send jitter) on one lane; the runner's rule: wait while ``dispatch_time`` says so,
    judged again at ``stops_at``. Returns every batch's start and size."""
    rng = random.Random(seed)
    clock = _Clock()
    tracker = ArrivalTracker(clock, stopped_after=stopped_after)
    policy = BatchPolicy(max_batch_size=8, max_batch_wait=0.002)

    def predict(n: int) -> float:
        return 0.002 + 0.0005 * n

    events: list[_Event] = [_Event(rng.uniform(0, 1 / hz), 1, i) for i in range(robots)]
    queue: list[tuple[int, float]] = []
    busy, timer, decisions = False, math.inf, []
    queue_done: list[tuple[int, float]] = []
    next_tick = [e.at for e in events]
    while events:
        ev = heapq.heappop(events)
        if ev.at > seconds:
            break
        clock.now = now = ev.at
        if ev.kind == 0:
            busy = False
            for robot, _ in queue_done:
                tracker.answered(f"r{robot}")
                next_tick[robot] += 1 / hz
                heapq.heappush(events, _Event(max(next_tick[robot], now) + rng.expovariate(2000), 1, robot))
        elif ev.kind == 1:
            tracker.admitted(f"r{ev.robot}", now + 0.1, now)
            queue.append((ev.robot, now))
        elif ev.at != timer:
            continue  # a timer replaced by an earlier one
        if busy or not queue:
            continue
        rate = tracker.expected_rate(now, enough=policy.rate_worth_waiting)
        at = dispatch_time(now, queued=len(queue), oldest_arrival=min(a for _, a in queue),
                           earliest_deadline=min(a for _, a in queue) + 0.1, policy=policy, predict=predict, arrival_rate=rate)
        if at > now:
            at = min(at, tracker.stops_at(now))
            if at < timer or timer <= now:
                timer = at
                heapq.heappush(events, _Event(at, 2))
            continue
        queue_done, queue = queue[:policy.max_batch_size], queue[policy.max_batch_size:]
        if not queue:
            tracker.queue_emptied()
        decisions.append((now, len(queue_done)))
        busy, timer = True, math.inf
        heapq.heappush(events, _Event(now + predict(len(queue_done)), 0))
    return decisions


@pytest.mark.parametrize(("robots", "hz"), [(8, 10.0), (16, 50.0)])
def test_steady_fleets_decide_as_when_no_session_ever_stops(robots: int, hz: float) -> None:
    judged = _simulate(robots, hz, STOPPED_AFTER_GAPS, 5.0, seed=robots)
    never = _simulate(robots, hz, math.inf, 5.0, seed=robots)
    assert len(judged) > 5 * hz  # the fleet was served throughout
    assert judged == never
