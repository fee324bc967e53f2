"""The batch start rule: never waits past max_batch_wait, never puts the earliest deadline at risk."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.robot.batching import ArrivalRate, BatchPolicy, dispatch_time, stackable


def linear(base: float, per_item: float):
    return lambda n: base + per_item * n


def test_empty_queue_never_dispatches() -> None:
    assert dispatch_time(0.0, queued=0, oldest_arrival=0.0, earliest_deadline=1.0, policy=BatchPolicy(),
                         predict=linear(0.01, 0.001)) == math.inf


def test_full_batch_starts_at_once() -> None:
    p = BatchPolicy(max_batch_size=4, max_batch_wait=0.05)
    assert dispatch_time(1.0, queued=4, oldest_arrival=1.0, earliest_deadline=9.0, policy=p, predict=linear(0.01, 0)) == 1.0


def test_waits_for_more_up_to_max_wait() -> None:
    p = BatchPolicy(max_batch_size=8, max_batch_wait=0.005)
    t = dispatch_time(1.0, queued=2, oldest_arrival=0.999, earliest_deadline=9.0, policy=p, predict=linear(0.01, 0))
    assert t == pytest.approx(1.004)


def test_a_tight_deadline_cuts_the_wait_short() -> None:
    p = BatchPolicy(max_batch_size=8, max_batch_wait=0.050, margin=0.001)
    # Deadline at 1.020, a batch of 3 takes 13 ms: must start by 1.006.
    t = dispatch_time(1.0, queued=2, oldest_arrival=1.0, earliest_deadline=1.020, policy=p, predict=linear(0.010, 0.001))
    assert t == pytest.approx(1.006)


def test_batching_off_means_no_wait() -> None:
    p = BatchPolicy(max_batch_size=1, max_batch_wait=0.05)
    assert dispatch_time(2.0, queued=1, oldest_arrival=2.0, earliest_deadline=9.0, policy=p, predict=linear(0.01, 0)) == 2.0


@settings(max_examples=300, deadline=None)
@given(
    now=st.floats(0, 100),
    queued=st.integers(1, 64),
    age=st.floats(0, 1),
    budget=st.floats(0, 1),
    size=st.integers(1, 32),
    wait=st.floats(0, 0.1),
    base=st.floats(0, 0.05),
    per=st.floats(0, 0.01),
    rate=st.floats(0, 1e5),
    hand_off=st.floats(0, 0.001),
)
def test_properties(now, queued, age, budget, size, wait, base, per, rate, hand_off) -> None:
    p = BatchPolicy(max_batch_size=size, max_batch_wait=wait, margin=0.001)
    predict = linear(base, per)
    oldest = now - age
    deadline = now + budget
    t = dispatch_time(now, queued=queued, oldest_arrival=oldest, earliest_deadline=deadline, policy=p, predict=predict,
                      arrival_rate=rate, per_batch=hand_off)
    assert t >= now  # never in the past
    assert t <= max(now, oldest + wait) + 1e-12  # never beyond the wait bound
    if t > now:
        # Waiting only while the earliest deadline stays reachable by the bigger batch.
        assert t + predict(min(size, queued + 1)) + p.margin <= deadline + 1e-9
        assert queued < size
        assert rate * wait >= 1.0  # another arrival is expected within the wait
        bigger = min(size, queued + 1)  # and the bigger batch is cheaper per request (or nothing is timed)
        assert predict(queued) == 0 or (predict(bigger) + hand_off) * queued < (predict(queued) + hand_off) * bigger


def test_a_lone_robot_never_waits() -> None:
    p = BatchPolicy(max_batch_size=16, max_batch_wait=0.002)
    # 10 requests per second: none expected within 2 ms.
    assert dispatch_time(5.0, queued=1, oldest_arrival=5.0, earliest_deadline=5.1, policy=p,
                         predict=linear(0.005, 0.0005), arrival_rate=10.0) == 5.0


def test_arrival_rate_estimate() -> None:
    r = ArrivalRate(alpha=0.5)
    assert r.rate(0.0) == 0.0
    for i in range(50):
        r.observe(i * 0.01)
    assert r.rate(0.49) == pytest.approx(100.0)
    assert r.rate(1.49) == pytest.approx(1.0)  # a second of silence


def test_no_wait_when_a_bigger_batch_costs_as_much_per_request() -> None:
    p = BatchPolicy(max_batch_size=16, max_batch_wait=0.002)
    # Proportional to the size (a CPU model, the no-op copying each robot's images): go now.
    assert dispatch_time(5.0, queued=1, oldest_arrival=5.0, earliest_deadline=6.0, policy=p,
                         predict=linear(0.0, 0.0005), arrival_rate=1e4) == 5.0
    # Cheaper per request in a bigger batch (a GPU): wait for the next robot.
    assert dispatch_time(5.0, queued=1, oldest_arrival=5.0, earliest_deadline=6.0, policy=p,
                         predict=linear(0.005, 0.0005), arrival_rate=1e4) == pytest.approx(5.002)
    # Proportional, but each batch also costs a hand-off to a lane and back: a bigger batch shares it.
    assert dispatch_time(5.0, queued=1, oldest_arrival=5.0, earliest_deadline=6.0, policy=p,
                         predict=linear(0.0, 0.0005), arrival_rate=1e4, per_batch=0.0002) == pytest.approx(5.002)
    # Nothing timed yet (every estimate 0): the wait as before.
    assert dispatch_time(5.0, queued=1, oldest_arrival=5.0, earliest_deadline=6.0, policy=p,
                         predict=linear(0.0, 0.0), arrival_rate=1e4) == pytest.approx(5.002)


def test_observations_stack_when_every_field_has_the_same_shape_or_is_absent_from_both() -> None:
    a = {"state": np.zeros(14), "image": np.zeros((3, 8, 8)), "prompt": "pick"}
    assert stackable(a, dict(a))
    assert stackable(a, {"state": np.zeros(14), "image": np.ones((3, 8, 8))})  # a field without a shape may be absent
    assert not stackable(a, {**a, "image": np.zeros((3, 8, 9))})
    assert not stackable(a, {"state": np.zeros(14), "prompt": "pick"})  # an array in one only
    assert not stackable({"state": np.zeros(14)}, {"state": np.zeros(14), "wrist": np.zeros(3)})
