"""Hold-and-resume and load-aware pacing: a late chunk answering a held state starts after its
observation's tick; a robot that moved never runs a row planned from a state it left; a saturated server
gets one request in flight, asked from a held state."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.broker import ActionChunk, Broker, BrokerConfig, MergeMode, MergeOutcome
from chunkline.broker.hold import HoldTracker
from chunkline.broker.pacing import LoadPacer
from chunkline.safety import Mode

A = 2
TOL = 0.005
STEP = 0.01


def _saturated_broker(period: float) -> tuple[Broker, float]:
    """A broker at rest whose server has refused once (saturated), at the time it may ask again."""
    # resume_steps=1: the hand-back from the hold takes the policy row at once (the row is visible)
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=period, merge=MergeMode.REPLACE, hold_tolerance=TOL, resume_steps=1),
               initial_position=np.zeros(A), limits=None, verify_fallback=False)
    r = b.tick(0.0, {"s": 0}, state=np.zeros(A)).request
    assert r is not None
    b.on_sent(r.request_id, 0.0)
    b.on_error(0.0, request_id=r.request_id, code="deadline_unmeetable", retry_after_s=0.0)
    return b, 0.0


def _answer(rid: int, obs_time: float, state: np.ndarray, horizon: int, period: float) -> ActionChunk:
    rows = state[None, :] + STEP * np.arange(1, horizon + 1)[:, None]
    return ActionChunk(rows, obs_time, period, obs_time + horizon * period, request_id=rid,
                       timing={"queue_ms": 500.0, "infer_ms": 100.0})


def _run(period: float, horizon: int, wait_ticks: int, drift: list[float]) -> tuple[ActionChunk, float, float, object]:
    """Ask from rest, tick ``wait_ticks`` with the measured state drifting by ``drift`` (cycled),
    deliver the answer, and return (the answer, its observation time, the next tick, its command)."""
    b, t = _saturated_broker(period)
    req = None
    while req is None:
        t = round(t + period, 9)
        req = b.tick(t, {"s": 1}, state=np.zeros(A)).request
    b.on_sent(req.request_id, t)
    obs_time = req.obs_time
    for i in range(wait_ticks):
        t = round(t + period, 9)
        cmd = b.tick(t, {"s": 1}, state=np.full(A, drift[i % len(drift)]))
        assert cmd.request is None  # one in flight: never re-asked while it may still arrive
    answer = _answer(req.request_id, obs_time, np.zeros(A), horizon, period)
    b.on_chunk(answer, t + 0.3 * period)
    t_next = round(t + period, 9)
    return answer, obs_time, t_next, b.tick(t_next, {"s": 1}, state=np.full(A, drift[(wait_ticks - 1) % len(drift)] if wait_ticks else 0.0))


@settings(max_examples=60, deadline=None)
@given(period=st.sampled_from([0.02, 0.05]), horizon=st.integers(3, 20), wait_ticks=st.integers(1, 40),
       drift=st.lists(st.floats(-TOL, TOL), min_size=1, max_size=5))
def test_a_chunk_answering_a_held_state_starts_after_its_observations_tick(period, horizon, wait_ticks, drift) -> None:
    answer, _, _, cmd = _run(period, horizon, wait_ticks, drift)
    # Held within the tolerance since the observation: the row after the observation's tick (whose
    # command, the hold, went out then) runs at the next tick, whatever the wait (time-based, every
    # row would be past after `horizon` ticks).
    assert cmd.chunk_id == answer.request_id
    np.testing.assert_allclose(cmd.action, answer.actions[1], atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(period=st.sampled_from([0.02, 0.05]), horizon=st.integers(3, 20), wait_ticks=st.integers(1, 40),
       moved=st.floats(2 * TOL, 1.0), sign=st.sampled_from([-1.0, 1.0]), at=st.integers(0, 39))
def test_a_robot_that_moved_never_runs_a_row_planned_from_the_state_it_left(period, horizon, wait_ticks, moved,
                                                                            sign, at) -> None:
    drift = [0.0] * wait_ticks
    drift[at % wait_ticks] = sign * moved
    answer, obs_time, t_next, cmd = _run(period, horizon, wait_ticks, drift)
    k = math.floor((t_next - obs_time) / period + 1e-9)  # the row due now on the robot's clock
    if cmd.chunk_id is None:
        assert cmd.mode is Mode.FALLBACK and k >= horizon - 1  # nothing valid due: the fallback holds
    else:
        # Time-based: the row due now, never the re-anchored first row.
        assert k >= 1
        np.testing.assert_allclose(cmd.action, answer.actions[k], atol=1e-6)


def test_hold_tracker_counts_a_non_finite_measurement_as_moving() -> None:
    h = HoldTracker(TOL)
    h.update(0.0, np.zeros(A), holding=True)
    h.update(0.1, np.zeros(A), holding=True)
    assert h.resumes(0.05)
    h.update(0.2, np.array([math.nan, 0.0]), holding=True)
    assert not h.resumes(0.05)
    h.update(0.3, np.zeros(A), holding=False)
    assert not h.resumes(0.3) and not HoldTracker(None).resumes(0.0)


def test_pacer_enters_on_queueing_or_refusal_and_leaves_only_after_a_calm_run() -> None:
    p = LoadPacer()
    p.on_reply({"queue_ms": 10.0, "infer_ms": 100.0})
    assert not p.saturated
    p.on_reply({"queue_ms": 150.0, "infer_ms": 100.0})
    assert p.saturated
    for _ in range(p.leave_after - 1):
        p.on_reply({"queue_ms": 1.0, "infer_ms": 100.0})
    p.on_reply({"queue_ms": 60.0, "infer_ms": 100.0})  # not calm: the run starts again
    for _ in range(p.leave_after - 1):
        p.on_reply({"queue_ms": 1.0, "infer_ms": 100.0})
    assert p.saturated
    p.on_reply({"queue_ms": 1.0, "infer_ms": 100.0})
    assert not p.saturated
    p.on_reply({"queue_ms": math.nan, "infer_ms": 100.0})
    p.on_refusal("overloaded", None)
    assert p.saturated
    q = LoadPacer()
    q.on_refusal("invalid_message", None)
    assert not q.saturated
    fast = LoadPacer(min_queue_s=0.02)  # a fast policy: a millisecond of queueing is noise
    fast.on_reply({"queue_ms": 1.5, "infer_ms": 0.5})
    assert not fast.saturated
    fast.on_reply({"queue_ms": 30.0, "infer_ms": 0.5})
    assert fast.saturated


def test_saturated_broker_keeps_one_request_in_flight_and_waits_for_the_plan_to_run_dry() -> None:
    period = 0.05
    b, t = _saturated_broker(period)
    asked = []
    for _ in range(200):
        t = round(t + period, 9)
        cmd = b.tick(t, {"s": 1}, state=np.asarray(b.watchdog.state.position))
        if cmd.request is not None:
            asked.append(t)
            b.on_sent(cmd.request.request_id, t)
            assert len(b.in_flight_ids) == 1
            # the answer comes 0.3 s later, planned from the held state; the server still queues
            b.on_chunk(_answer(cmd.request.request_id, cmd.request.obs_time, np.asarray(b.watchdog.state.position),
                               10, period), t + 0.3)
            t = round(t + 0.3 - period, 9)
    # Each answer's ten rows run, then the plan runs dry and the next request goes: once per
    # ten rows plus the round trip, never while the plan runs.
    gaps = np.diff(asked)
    assert len(asked) > 5 and np.all(gaps >= 10 * period - 1e-6)
    assert b.stats.chunks_resumed == len(asked) - 1 or b.stats.chunks_resumed == len(asked)


def test_until_the_first_reply_the_server_counts_as_saturated_and_a_calm_first_reply_ends_it() -> None:
    calm = LoadPacer(min_queue_s=0.02)
    assert calm.saturated  # nothing known yet: a fleet that starts together finds the server busy
    calm.on_reply({"queue_ms": 0.5, "infer_ms": 100.0, "batch_size": 1.0})
    assert not calm.saturated  # the first reply queued behind no one: room at once, not after a calm run
    for timing in ({"queue_ms": 70.0, "infer_ms": 140.0, "batch_size": 3.0}, {"queue_ms": 150.0, "infer_ms": 100.0}):
        busy = LoadPacer(min_queue_s=0.02)
        busy.on_reply(timing)  # queued behind others (batched with them, or longer than its inference)
        assert busy.saturated
    silent = LoadPacer()
    silent.on_reply(None)  # says nothing: the assumption ends
    assert not silent.saturated


def test_a_late_first_chunk_from_a_busy_server_resumes_after_its_observations_tick() -> None:
    period, horizon = 0.05, 10
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=period, hold_tolerance=TOL, resume_steps=1),
               initial_position=np.zeros(A), limits=None, verify_fallback=False)
    req = b.tick(0.0, {"s": 0}, state=np.zeros(A)).request
    assert req is not None
    b.on_sent(req.request_id, 0.0)
    t = 0.0
    for _ in range(4):
        t = round(t + period, 9)
        assert b.tick(t, {"s": 0}, state=np.zeros(A)).request is None  # one in flight
    rows = STEP * np.arange(1, horizon + 1)[:, None] * np.ones((1, A))
    b.on_chunk(ActionChunk(rows, 0.0, period, horizon * period, request_id=req.request_id,
                           timing={"queue_ms": 70.0, "infer_ms": 140.0, "batch_size": 3.0}), t + 0.01)
    cmd = b.tick(round(t + period, 9), {"s": 0}, state=np.zeros(A))
    # Time-based, rows 0-4 would be past; the robot held still since its observation: row 1 runs
    # (row 0 was its observation's tick, when the hold went out).
    assert cmd.chunk_id == req.request_id and b.stats.chunks_resumed == 1
    np.testing.assert_allclose(cmd.action, rows[1], atol=1e-6)


def _lead_cycle(period: float, horizon: int, lead: int, hold_ticks: int, answer_rows,
                late: float = 0.0) -> tuple[Broker, object, ActionChunk, float]:
    """A saturated rtc broker runs a resumed chunk until it asks (``lead`` rows before its end,
    those rows frozen), runs them, holds ``hold_ticks``, then gets ``answer_rows(request)``; every
    tick ``late`` after its due time. Returns the broker, the request, the answer and the next tick."""
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=period, hold_tolerance=TOL, resume_steps=1, paced_lead_rows=lead),
               initial_position=np.zeros(A), limits=None, verify_fallback=False)
    k = 0

    def at(k: int) -> float:
        return round(k * period + late, 9)

    req = b.tick(at(k), {"s": 0}, state=np.zeros(A)).request
    assert req is not None
    b.on_sent(req.request_id, at(k))
    for _ in range(6):  # a slow server: the round trip outlasts most of a chunk (no prefetch while it runs)
        k += 1
        assert b.tick(at(k), {"s": 0}, state=np.zeros(A)).request is None
    # The first reply queued behind others: the server is saturated, the chunk resumes from the hold.
    b.on_chunk(ActionChunk(STEP * np.arange(1, horizon + 1)[:, None] * np.ones((1, A)), req.obs_time, period,
                           req.obs_time + horizon * period, request_id=req.request_id,
                           timing={"queue_ms": 500.0, "infer_ms": 100.0}), at(k) + 0.5 * period)
    position = np.zeros(A)
    asked = None
    while asked is None:
        k += 1
        cmd = b.tick(at(k), {"s": 1}, state=position)
        position = np.asarray(cmd.action)
        asked = cmd.request
    # Asked with `lead` rows left (this tick's included), those rows frozen: the answer is planned after them.
    assert asked.prefix is not None and asked.prefix_delay == lead and len(asked.prefix) == lead
    b.on_sent(asked.request_id, at(k))
    for _ in range(lead - 1):
        k += 1
        cmd = b.tick(at(k), {"s": 1}, state=position)
        assert cmd.mode is not Mode.FALLBACK and cmd.request is None
        position = np.asarray(cmd.action)
    for _ in range(hold_ticks):
        k += 1
        cmd = b.tick(at(k), {"s": 1}, state=position)
        assert cmd.mode is Mode.FALLBACK and cmd.request is None
    answer = ActionChunk(answer_rows(asked), asked.obs_time, period, asked.obs_time + horizon * period,
                         request_id=asked.request_id, timing={"queue_ms": 500.0, "infer_ms": 100.0})
    b.on_chunk(answer, at(k) + 0.3 * period)
    return b, asked, answer, at(k + 1)


def _continuing(horizon: int, offset: float = 0.0):
    def rows(req) -> np.ndarray:
        d = req.prefix_delay
        last = np.asarray(req.prefix[d - 1], dtype=np.float64) + offset
        return np.vstack([np.asarray(req.prefix[: d - 1], dtype=np.float64).reshape(d - 1, A), last[None, :],
                          last[None, :] + STEP * np.arange(1, horizon - d + 1)[:, None]])
    return rows


@settings(max_examples=40, deadline=None)
@given(period=st.sampled_from([0.02, 0.05]), horizon=st.integers(4, 12), lead=st.integers(1, 3),
       hold_ticks=st.integers(1, 30), late=st.floats(0.0, 0.3))
def test_a_chunk_asked_before_the_plan_runs_dry_resumes_after_its_frozen_prefix(period, horizon, lead, hold_ticks,
                                                                                  late) -> None:
    b, asked, answer, t_next = _lead_cycle(period, horizon, lead, hold_ticks, _continuing(horizon), late * period)
    cmd = b.tick(t_next, {"s": 1}, state=np.asarray(b.watchdog.state.position))
    # Held still since its frozen rows ran: the first row it planned itself runs now, whatever the wait.
    assert cmd.chunk_id == answer.request_id
    np.testing.assert_allclose(cmd.action, answer.actions[lead], atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(period=st.sampled_from([0.02, 0.05]), horizon=st.integers(4, 12), lead=st.integers(1, 3),
       hold_ticks=st.integers(1, 30), off=st.floats(2 * TOL, 1.0))
def test_a_chunk_that_does_not_reproduce_its_prefix_is_not_resumed_after_it(period, horizon, lead, hold_ticks,
                                                                            off) -> None:
    b, asked, answer, t_next = _lead_cycle(period, horizon, lead, hold_ticks, _continuing(horizon, off))
    cmd = b.tick(t_next, {"s": 1}, state=np.asarray(b.watchdog.state.position))
    k = math.floor((t_next - asked.obs_time) / period + 1e-9)
    # Planned from elsewhere than where the prefix left the robot: time-based, the row due now or nothing.
    assert b.stats.chunks_resumed == 1  # the first chunk only
    if cmd.chunk_id is not None:
        np.testing.assert_allclose(cmd.action, answer.actions[k], atol=1e-6)
    else:
        assert k >= horizon - 1


def test_hold_tracker_resumes_after_a_prefix_only_when_the_hold_began_as_it_ended() -> None:
    h = HoldTracker(TOL, ahead_s=0.1)
    for due in (0.05, 0.10):  # prefix rows due at 0.05 and 0.10 ran (at ticks a few ms late) ...
        h.update(due + 0.004, np.zeros(A), holding=False, due=due)
    h.update(0.178, np.zeros(A), holding=True)  # ... then the hold began (a late tick)
    assert h.ran_of(0.05, 2, 0.05) == 2  # both rows of a two-row prefix from 0.05 ran, nothing after
    assert h.ran_of(0.10, 2, 0.05) == 1  # one row of a prefix from 0.10 ran, then the hold
    assert h.ran_of(0.00, 2, 0.05) == 0  # a prefix from 0.00 ended at 0.05: another row ran after it
    assert h.ran_of(0.15, 2, 0.05) == 0  # none of a prefix from 0.15 ran
    h.update(0.2, np.full(A, 2 * TOL), holding=True)  # moved during the hold: nothing resumes
    assert h.ran_of(0.05, 2, 0.05) == 0
    assert h.agrees(np.array([0.004, 0.0]), np.zeros(A)) and not h.agrees(np.array([0.006, 0.0]), np.zeros(A))
    assert not HoldTracker(None).agrees(np.zeros(A), np.zeros(A))


def test_a_reply_served_alone_while_others_wait_behind_it_says_the_server_is_busy() -> None:
    # A fleet scheduler may serve a weighted robot alone and at once while the rest queue: its
    # replies barely queue, but the backlog behind them says the server is saturated.
    p = LoadPacer(min_queue_s=0.05)
    p.on_reply({"queue_ms": 0.0, "infer_ms": 73.0, "batch_size": 1.0, "backlog": 9.0})
    assert p.saturated  # the first reply left nine waiting: the start-up assumption stands
    for _ in range(3 * p.leave_after):
        p.on_reply({"queue_ms": 0.0, "infer_ms": 73.0, "batch_size": 1.0, "backlog": 3.0})
    assert p.saturated
    for _ in range(p.leave_after):
        p.on_reply({"queue_ms": 0.0, "infer_ms": 73.0, "batch_size": 1.0, "backlog": 0.0})
    assert not p.saturated
    # A backlog a fast policy clears within a control period is noise, as its queueing is.
    fast = LoadPacer(min_queue_s=0.05)
    fast.on_reply({"queue_ms": 0.0, "infer_ms": 2.0, "batch_size": 1.0, "backlog": 4.0})
    assert not fast.saturated
    alone = LoadPacer(min_queue_s=0.05)  # a robot alone on a server: no backlog, as before
    alone.on_reply({"queue_ms": 0.0, "infer_ms": 73.0, "batch_size": 1.0})
    assert not alone.saturated


@pytest.mark.parametrize("clock", [0.0, 2.3e4])
@pytest.mark.parametrize(("late", "late_next", "land", "ticks_before"),
                         [(0.0005, 0.0008, 0.083, 1), (0.0442, 0.0444, 0.1238, 2), (0.0, 0.0, 0.083, 1)])
def test_a_chunk_answering_a_resumed_plans_last_rows_carries_it_on_whatever_the_ticks_jitter(
        clock: float, late: float, late_next: float, land: float, ticks_before: int) -> None:
    # The shipped defaults on a saturated server: a chunk resumes from a hold (its rows on the grid
    # of the tick it resumed at); the next request goes out with its last rows frozen at a tick
    # `late` past that grid, the ticks after it `late_next`; the answer lands `land` after it,
    # reproducing them. Its own rows run from the next tick to its end, and the robot asks only
    # once those run short (not at every tick with the plan still full). Nearly a period late is
    # still late beyond the default lead (a tenth of a period); within it, a tick counts as early.
    period, n = 0.05, 7
    b = Broker(BrokerConfig(refresh_queued=False, control_period_s=period), initial_position=np.zeros(A), limits=None, verify_fallback=False)
    busy = {"queue_ms": 70.0, "infer_ms": 140.0, "batch_size": 3.0, "backlog": 5.0}
    k, shift = 0, 0.0

    def tick(state: np.ndarray) -> object:
        return b.tick(clock + k * period + shift, {"s": 0}, state=state)

    req = tick(np.zeros(A)).request
    assert req is not None
    b.on_sent(req.request_id, req.obs_time)
    for _ in range(4):
        k += 1
        assert tick(np.zeros(A)).request is None
    first = ActionChunk(STEP * np.arange(1, n + 1)[:, None] * np.ones((1, A)), req.obs_time, period,
                        req.obs_time + n * period, request_id=req.request_id, timing=busy)
    b.on_chunk(first, clock + k * period + 0.02)
    assert b.stats.chunks_resumed == 1  # its rows on the grid of the next tick
    position, shift, asked = np.zeros(A), late, None
    while asked is None:
        k += 1
        cmd = tick(position)
        position, asked = np.asarray(cmd.action), cmd.request
    b.on_sent(asked.request_id, asked.obs_time)
    d = asked.prefix_delay
    assert d is not None and d >= 2 and asked.prefix is not None
    shift = late_next
    for _ in range(ticks_before):
        k += 1
        cmd = tick(position)
        assert cmd.mode is not Mode.FALLBACK and cmd.request is None
        position = np.asarray(cmd.action)
    frozen = np.asarray(asked.prefix[:d], dtype=np.float64).reshape(d, A)
    rows = np.vstack([frozen, frozen[-1] + STEP * np.arange(1, n - d + 1)[:, None]])
    obs = asked.obs_time
    answer = ActionChunk(rows, obs, period, obs + n * period, request_id=asked.request_id, timing=busy)
    assert b.on_chunk(answer, obs + land) is MergeOutcome.MERGED
    assert b.timeline.valid_until == pytest.approx(obs + n * period, abs=1e-6)
    ran = 0
    while clock + (k + 1) * period + shift < obs + (n - 2) * period:  # up to its last two rows (the paced lead)
        k += 1
        cmd = tick(position)
        assert cmd.chunk_id == asked.request_id and cmd.request is None
        position, ran = np.asarray(cmd.action), ran + 1
    assert ran >= n - d - 2
