"""Refusal economics on the cores, with injected clocks: the retry line (refused sessions come
back one after another, those that wait as told keep their place), the door's retry windows,
the hand-off admission plans with, and admitted work keeping its promise when later requests
with earlier deadlines arrive."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import aloha_obs
from hypothesis import given, settings
from hypothesis import strategies as st
from runner_helpers import TENANT, Gate, one_at_a_time

from chunkline.client.wire.errors import ErrorCode
from chunkline.policies.base import validate_observation
from chunkline.policies.registry import load_policy
from chunkline.server.core.admission import (
    AdmissionConfig,
    AdmissionController,
    Admitted,
    Request,
    ServiceTimeModel,
)
from chunkline.server.core.admission.retry_holds import HOLD_CODES, Held, RetryHolds
from chunkline.server.core.admission.retry_line import RetryLine
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.errors import QuotaLimit, Refusal

_ids: Iterator[int] = itertools.count()


def req(deadline: float, session: str = "s", tenant: str = "a") -> Request:
    return Request(next(_ids), session, tenant, "policy", PolicyCost(), deadline)


def controller(service: float = 0.010, **config: Any) -> AdmissionController:
    reg = TenantRegistry({"a": TenantInfo("a")})
    svc = ServiceTimeModel(deviation_factor=0.0, initial={1: service})
    return AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_batch_size=1, **config), svc)


# ----------------------------------------------------------------------------- the retry line

SLOT, GRACE = 0.05, 0.1


def trusted(line: RetryLine, *sessions: str, now: float = 0.0) -> RetryLine:
    """Make ``sessions`` trusted: each was given a time and came back at it."""
    for s in sessions:
        line.appoint(s, now, now, SLOT, GRACE)
        line.admitted(s, now, SLOT)
        assert line.trusted(s) and line.time_of(s) is None
    return line


def test_a_session_new_to_the_line_reserves_nothing_and_gets_admissions_own_time() -> None:
    line = RetryLine()
    assert [line.appoint(s, 1.0, 0.5, SLOT, GRACE) for s in ("a", "b")] == [1.0, 1.0]
    assert not line.reserved("a") and line.ahead_of("new", 0.5, GRACE) == 0
    # "a" comes back at its time and is refused again: it keeps its place, and is now trusted
    assert line.appoint("a", 1.02, 1.0, SLOT, GRACE) == pytest.approx(1.02)
    assert line.trusted("a") and line.reserved("a") and line.ahead_of("new", 1.0, GRACE) == 1
    assert line.ahead_of("b", 1.0, GRACE) == 0  # "b" holds the earlier place (1.0)
    # "b" comes back two slots late (but within grace): it keeps its place, not trusted
    line.appoint("b", 1.2, 1.1 + 1e-9, SLOT, GRACE)
    assert not line.trusted("b") and not line.reserved("b")


def test_trusted_sessions_are_lined_up_one_slot_apart_and_count_ahead() -> None:
    line = trusted(RetryLine(), "a", "b", "c")
    at = [line.appoint(s, 1.0, 0.5, SLOT, GRACE) for s in ("a", "b", "c")]
    assert at == pytest.approx([1.0, 1.05, 1.10])
    assert line.appoint("d", 2.0, 0.5, SLOT, GRACE) == 2.0  # admission's own time is later: it wins
    assert line.appoint("e", 0.0, 0.5, SLOT, GRACE) == pytest.approx(1.15)  # untrusted: behind the reserved places
    assert [line.ahead_of(s, 0.5, GRACE) for s in ("a", "b", "c", "e", "new")] == [0, 1, 2, 3, 3]
    line.admitted("b", 1.05, SLOT)  # back at its time and admitted: it waits no more
    assert line.time_of("b") is None and line.trusted("b") and line.ahead_of("c", 0.5, GRACE) == 1
    line.leave("c")  # its connection closed
    assert line.time_of("c") is None and not line.trusted("c")


def test_a_session_refused_again_keeps_its_place() -> None:
    line = trusted(RetryLine(), "a", "b", "c")
    for s in ("a", "b", "c"):
        line.appoint(s, 1.0, 0.5, SLOT, GRACE)
    # "a" came back at its time; the work ahead ran late and admission says 1.02: it is not sent
    # behind "c" (1.10) but keeps the front
    assert line.appoint("a", 1.02, 1.0, SLOT, GRACE) == pytest.approx(1.02)
    assert line.ahead_of("a", 1.0, GRACE) == 0
    # a session refused again well before its time keeps its time, but has not shown it waits
    assert line.appoint("c", 1.0, 0.9, SLOT, GRACE) == pytest.approx(1.10)
    assert not line.trusted("c")


def test_a_place_not_taken_up_within_its_grace_is_dropped_and_its_session_not_trusted() -> None:
    line = trusted(RetryLine(), "a")
    line.appoint("a", 1.0, 0.5, SLOT, GRACE)
    assert line.ahead_of("new", 1.1, GRACE) == 1  # still within grace of 1.0
    assert line.ahead_of("new", 1.11, GRACE) == 0  # past it: no longer counted ...
    assert line.appoint("b", 1.2, 1.2, SLOT, GRACE) == 1.2  # ... and dropped at the next appointment
    assert len(line) == 1 and line.time_of("a") is None and not line.trusted("a")


def test_a_session_that_sends_before_its_time_forfeits_its_reservation() -> None:
    line = trusted(RetryLine(), "storm", "polite")
    line.appoint("storm", 1.0, 0.5, SLOT, GRACE)
    line.appoint("polite", 1.0, 0.5, SLOT, GRACE)
    assert line.ahead_of("polite", 0.5, GRACE) == 1
    line.forfeit("storm")
    assert not line.reserved("storm") and not line.trusted("storm") and line.reserved("polite")
    assert line.time_of("storm") == 1.0  # it keeps its time: the door holds it until then
    assert line.ahead_of("polite", 0.5, GRACE) == 0 and line.ahead_of("new", 0.5, GRACE) == 1
    # places handed out later go behind the last reserved one, not behind the forfeited one
    assert line.appoint("next", 0.0, 0.5, SLOT, GRACE) == pytest.approx(1.10)
    # back at its time after sending early: not trusted, its next place reserves nothing
    line.appoint("storm", 1.2, 1.0, SLOT, GRACE)
    assert not line.trusted("storm") and not line.reserved("storm")
    # waiting out that one earns the trust back
    line.appoint("storm", 1.3, 1.2, SLOT, GRACE)
    assert line.trusted("storm") and line.reserved("storm")


_line_op = st.one_of(
    st.tuples(st.just("appoint"), st.integers(0, 5), st.floats(0.0, 0.3)),
    st.tuples(st.just("admitted"), st.integers(0, 5)),
    st.tuples(st.just("forfeit"), st.integers(0, 5)),
    st.tuples(st.just("leave"), st.integers(0, 5)),
    st.tuples(st.just("tick"), st.floats(0.0, 0.1)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_line_op, max_size=60), st.sampled_from([0.001, 0.02, 0.05]), st.sampled_from([0.0, 0.05, 0.2]))
def test_retry_line_invariants(ops: list[tuple[Any, ...]], slot: float, grace: float) -> None:
    line = RetryLine()
    now = 0.0
    for op in ops:
        if op[0] == "tick":
            now += op[1]
            continue
        session = f"s{op[1]}"
        before = line.time_of(session)
        if op[0] == "appoint":
            earliest = now + op[2]
            kept = before is not None and before >= now - grace
            reserved = [line.time_of(f"s{i}") for i in range(6) if line.reserved(f"s{i}") and f"s{i}" != session]
            at = line.appoint(session, earliest, now, slot, grace)
            assert at >= earliest and line.time_of(session) == at
            assert line.reserved(session) == line.trusted(session)
            if kept:
                assert before is not None and at == max(before, earliest)  # it keeps its place
            else:
                # new to the line: behind every reserved place still kept
                assert all(at >= t + slot - 1e-12 for t in reserved if t is not None and t >= now - grace)
        elif op[0] == "admitted":
            line.admitted(session, now, slot)
            assert line.time_of(session) is None
        elif op[0] == "forfeit":
            line.forfeit(session)
            assert not line.reserved(session) and not line.trusted(session)
        else:
            line.leave(session)
            assert line.time_of(session) is None and not line.trusted(session)
        # one place per session, in (time, order given); ahead_of counts the reserved places
        # still kept that come before a session's own (all of them, for a session with none)
        places = dict(line._place)  # (time, seq, session) per session: the test reads it to count
        assert len(line) == len(places) and all(p[2] == name for name, p in places.items())
        assert all(line.trusted(v) for v in places if line.reserved(v))  # only trusted sessions reserve room
        for i in range(7):
            name = f"s{i}"
            own = places.get(name)
            counted = [p for v, p in places.items() if line.reserved(v) and p[0] >= now - grace and (own is None or p < own)]
            assert line.ahead_of(name, now, grace) == len(counted)


# ----------------------------------------------------------------------------- the controller and the line


def test_admission_lines_up_trusted_sessions_and_an_admitted_session_leaves_the_line() -> None:
    c = controller()
    trusted(c.retry_line, "a", "b", "c", now=-1.0)
    assert isinstance(c.offer(req(10.0, "r"), 0.0), Admitted)
    assert len(c.next_batch(0.0)) == 1  # 10 ms running
    # 15 ms budgets, three sessions refused at the same moment: the first is 5 ms short; each
    # next one also has the reserved places before it ahead of it, a slot (10 ms) each
    hints = []
    for s in ("a", "b", "c"):
        r = c.check(req(0.015, s), 0.0)
        assert isinstance(r, Refusal) and r.code is ErrorCode.DEADLINE_UNMEETABLE
        hints.append(c.appoint(r, s, 0.0).retry_after_ms)
    assert hints == pytest.approx([5.0, 15.0, 25.0])
    # at 5 ms "a" is back: admitted, and it leaves the line
    assert isinstance(c.offer(req(0.020, "a"), 0.005), Admitted)
    assert c.retry_line.time_of("a") is None and c.retry_line.time_of("b") == pytest.approx(0.015)


def test_untrusted_sessions_refused_together_get_the_same_time() -> None:
    c = controller()
    c.offer(req(10.0, "r"), 0.0)
    c.next_batch(0.0)
    hints = [c.appoint(c.check(req(0.015, s), 0.0), s, 0.0).retry_after_ms for s in ("a", "b")]  # type: ignore[arg-type]
    assert hints == pytest.approx([5.0, 5.0])


def test_reserved_places_count_ahead_of_a_newcomer_until_forfeited() -> None:
    c = controller()
    trusted(c.retry_line, "polite", "early", now=-1.0)
    c.offer(req(10.0, "r"), 0.0)
    c.next_batch(0.0)  # running until 10 ms
    c.appoint(c.check(req(0.015, "polite"), 0.0), "polite", 0.0)  # type: ignore[arg-type]  # told: 5 ms
    # at 5 ms a newcomer with the same budget would fit (10 + 10 ms of 20), but the polite
    # session, due now, counts ahead of it: 30 ms is past its deadline
    late = c.check(req(0.020, "storm"), 0.005)
    assert isinstance(late, Refusal) and late.code is ErrorCode.DEADLINE_UNMEETABLE
    assert isinstance(c.offer(req(0.020, "polite"), 0.005), Admitted)
    # a session that sent before its time is not protected
    c2 = controller()
    trusted(c2.retry_line, "early", now=-1.0)
    c2.offer(req(10.0, "r"), 0.0)
    c2.next_batch(0.0)
    c2.appoint(c2.check(req(0.015, "early"), 0.0), "early", 0.0)  # type: ignore[arg-type]
    c2.retry_line.forfeit("early")
    assert c2.check(req(0.020, "storm"), 0.005) is None


def test_only_refusals_that_waiting_cures_are_lined_up() -> None:
    c = controller()
    for refusal in (Refusal(ErrorCode.DEADLINE_UNMEETABLE, "one batch alone is longer", None),
                    Refusal(ErrorCode.QUOTA_EXCEEDED, "rate", 40.0, QuotaLimit.RATE),
                    Refusal(ErrorCode.FORBIDDEN, "no")):
        assert c.appoint(refusal, "s", 0.0) is refusal
    assert len(c.retry_line) == 0
    overloaded = Refusal(ErrorCode.OVERLOADED, "queue full", 3.0)
    trusted(c.retry_line, "s", now=-1.0)
    assert c.appoint(overloaded, "s", 0.0) is overloaded  # first in line: its own time
    assert c.appoint(overloaded, "t", 0.0).retry_after_ms == pytest.approx(13.0)


def test_a_session_that_closes_leaves_the_line() -> None:
    policy = load_policy("noop")

    async def go() -> None:
        runner = one_at_a_time(policy, clock=lambda: 0.0)
        trusted(runner.core.retry_line, "gone")
        runner.core.retry_line.appoint("gone", 1.0, 0.0, 0.05, 0.05)
        assert runner.core.retry_line.reserved("gone")
        runner.sent_early("gone")
        assert not runner.core.retry_line.reserved("gone")
        runner.release_session("gone")
        assert runner.core.retry_line.time_of("gone") is None
        await runner.stop()

    asyncio.run(go())


def test_the_runner_lines_up_refusals_at_the_door_and_after_decoding() -> None:
    policy = Gate()

    async def go() -> list[float]:
        runner = one_at_a_time(policy, service=ServiceTimeModel(initial={1: 0.05}, deviation_factor=0.0))
        obs = validate_observation(policy.spec, aloha_obs(0))
        trusted(runner.core.retry_line, "a", "b", "c", now=time.perf_counter() - 10.0)
        first = runner.submit(obs, tenant=TENANT, session="r", deadline=time.perf_counter() + 10)
        hints = []
        for s in ("a", "b"):  # the lane is busy for 50 ms: a 60 ms budget is about 40 ms short
            refusal = runner.precheck(tenant=TENANT, session=s, deadline=time.perf_counter() + 0.06)
            assert refusal is not None and refusal.retry_after_ms is not None
            hints.append(refusal.retry_after_ms)
        with pytest.raises(Refusal) as refused:
            runner.submit(obs, tenant=TENANT, session="c", deadline=time.perf_counter() + 0.06)
        hints.append(refused.value.retry_after_ms)
        policy.gate.set()
        await first.future
        await runner.stop()
        return hints

    hints = asyncio.run(go())
    assert 30.0 < hints[0] <= 40.0
    assert hints[1] == pytest.approx(hints[0] + 50.0, abs=2.0) and hints[2] == pytest.approx(hints[0] + 100.0, abs=2.0)


# ----------------------------------------------------------------------------- the door


def test_the_door_holds_a_session_until_its_retry_time_then_forgets() -> None:
    holds = RetryHolds(close_after=3)
    assert not holds and holds.check("m", 0.0) is None
    holds.hold("m", ErrorCode.INVALID_MESSAGE, 50.0, 0.0)  # not a code that opens a window
    holds.hold("m", ErrorCode.OVERLOADED, None, 0.0)  # no retry time: nothing to wait for
    assert not holds
    holds.hold("m", ErrorCode.DEADLINE_UNMEETABLE, 50.0, 1.0)
    assert holds.check("other", 1.01) is None  # per model
    assert holds.check("m", 1.01) == Held(ErrorCode.DEADLINE_UNMEETABLE, pytest.approx(40.0), True, False)
    assert holds.check("m", 1.02) == Held(ErrorCode.DEADLINE_UNMEETABLE, pytest.approx(30.0), False, False)
    assert holds.in_a_row == 2
    assert holds.check("m", 1.05) is None and holds.in_a_row == 0 and not holds  # its time: through, forgotten


def test_the_door_closes_a_session_that_keeps_sending_inside_its_windows() -> None:
    holds = RetryHolds(close_after=3)
    holds.hold("m", ErrorCode.OVERLOADED, 100.0, 0.0)
    seen = [holds.check("m", 0.001 * i) for i in range(1, 5)]
    assert [h.close for h in seen if h] == [False, False, False, True]
    assert [h.first for h in seen if h] == [True, False, False, False]
    # one request after its time ends the run; a new window's first request is reported again
    holds2 = RetryHolds(close_after=3)
    holds2.hold("m", ErrorCode.OVERLOADED, 10.0, 0.0)
    for i in range(3):
        assert holds2.check("m", 0.001 * (i + 1)) is not None
    assert holds2.check("m", 0.02) is None
    holds2.hold("m", ErrorCode.QUOTA_EXCEEDED, 10.0, 0.02)
    again = holds2.check("m", 0.021)
    assert again is not None and again.first and not again.close and again.code is ErrorCode.QUOTA_EXCEEDED
    assert HOLD_CODES == {ErrorCode.OVERLOADED, ErrorCode.DEADLINE_UNMEETABLE, ErrorCode.QUOTA_EXCEEDED}


# ----------------------------------------------------------------------------- the hand-off


def test_the_hand_off_is_learned_from_completions_and_planned_for() -> None:
    c = controller(service=0.010)
    c.offer(req(10.0), 0.0)
    batch = c.next_batch(0.0)
    # the batch ran 10 ms but held its worker 13 ms (the result waited 3 ms for the loop)
    c.complete_batch(batch, 0.013, 0.010)
    assert c.service.handoff_snapshot() == pytest.approx((0.003, 0.0015))
    assert c.service.occupancy(1) == pytest.approx(0.013)  # deviation_factor 0 in this controller
    # alone, a request now takes 13 ms: a 12.5 ms budget cannot be met however long it waits
    hopeless = c.check(req(0.0125 + 1.0), 1.0)
    assert isinstance(hopeless, Refusal) and hopeless.retry_after_ms is None
    assert isinstance(c.offer(req(1.0135), 1.0), Admitted)
    # a running batch is planned to end an occupancy after it started
    c.next_batch(1.0)
    late = c.check(req(1.025), 1.0)  # 13 ms ahead + 13 ms of its own = 26 ms
    assert isinstance(late, Refusal) and late.retry_after_ms == pytest.approx(1.0)


def test_one_slow_hand_off_moves_the_estimate_little() -> None:
    m = ServiceTimeModel(deviation_factor=2.0)
    assert m.handoff() == 0.0 and m.occupancy(1) == 0.0  # nothing observed
    for _ in range(20):
        m.observe_handoff(0.0002)
    steady = m.handoff()
    m.observe_handoff(0.5)  # a loop stall: winsorised to 1 ms
    assert m.handoff() < steady + 0.001
    m.observe_handoff(-1.0)  # clocks that disagree: counted as none
    m.observe_handoff(math.nan)
    assert m.handoff_snapshot()[0] >= 0.0
    for _ in range(30):  # a loop that stays busy: the estimate follows within a few batches
        m.observe_handoff(0.004)
    assert m.handoff_snapshot()[0] == pytest.approx(0.004, rel=0.05)
    assert m.mean_occupancy(1) == pytest.approx(m.mean(1) + m.handoff_snapshot()[0])


# ----------------------------------------------------------------------------- promises


def test_a_request_that_would_push_admitted_work_past_its_deadline_waits_until_that_work_started() -> None:
    c = controller(service=0.010)
    c.offer(req(10.0), 0.0)
    c.next_batch(0.0)  # running until 10 ms
    assert isinstance(c.offer(req(0.025), 0.0), Admitted)  # promised 20 ms: 5 ms to spare
    # an earlier deadline would finish in time itself (20 ms of 22) but push it to 30 ms
    r = c.check(req(0.022), 0.0)
    assert isinstance(r, Refusal) and r.code is ErrorCode.DEADLINE_UNMEETABLE and "1 admitted" in r.reason
    assert r.retry_after_ms == pytest.approx(10.0)  # when it starts
    assert isinstance(c.offer(req(0.031), 0.0), Admitted)  # behind it: overtakes nothing


_arrival = st.tuples(st.floats(0.0, 0.03), st.floats(0.005, 0.2))  # (gap since the last arrival, budget)


@settings(max_examples=200, deadline=None)
@given(st.lists(_arrival, min_size=1, max_size=40), st.sampled_from([0.004, 0.01, 0.02]))
def test_every_admitted_request_finishes_by_its_deadline(arrivals: list[tuple[float, float]], service: float) -> None:
    """One tenant, one worker, batches of one, exact service times: whatever the order of the
    deadlines, admission keeps every promise it made (a request that would overtake admitted
    work with no time to spare is refused), so nothing admitted is dropped or late."""
    c = controller(service=service)
    clock = [0.0]
    running: list[tuple[list[Request], float]] = []  # the batch on the worker and when it ends
    finished: list[tuple[Request, float]] = []

    def settle(until: float) -> None:
        """Run the worker up to ``until``: take the next batch when idle, complete it at its end."""
        while True:
            if not running:
                batch = c.next_batch(clock[0])
                assert not c.take_dropped(), "an admitted request was dropped"
                if not batch:
                    return
                running.append((batch, clock[0] + service))
            batch, end = running[0]
            if end > until:
                return
            clock[0] = end
            c.complete_batch(batch, end, service)
            finished.extend((r, end) for r in batch)
            running.clear()

    t = 0.0
    admitted = 0
    for gap, budget in arrivals:
        t += gap
        settle(t)
        clock[0] = t
        admitted += isinstance(c.offer(req(t + budget), t), Admitted)
        settle(t)
    settle(math.inf)
    assert len(finished) == admitted and c.queued == 0
    for r, done in finished:
        assert done <= r.deadline + 1e-9, f"finished {done - r.deadline:.4f} s late"


def test_an_idle_refusing_runner_re_measures_the_hand_off_too() -> None:
    """A hand-off estimate left high by a busy loop refuses everything as unmeetable; nothing
    runs, so only the idle re-measurement can bring it down."""
    policy = load_policy("noop")
    service = ServiceTimeModel(initial={1: 0.001})
    service.observe_handoff(5.0)

    async def go() -> None:
        runner = one_at_a_time(policy, service=service)
        with pytest.raises(Refusal) as refused:
            runner.submit(validate_observation(policy.spec, aloha_obs(0)), tenant=TENANT, session="s",
                          deadline=time.perf_counter() + 0.1)
        assert refused.value.code is ErrorCode.DEADLINE_UNMEETABLE and "re-measuring" in refused.value.message
        assert refused.value.retry_after_ms == runner.remeasure.interval_s * 1000.0  # the stale estimate is not waited out
        assert runner.remeasure.future is not None
        await runner.remeasure.future
        await runner.stop()

    asyncio.run(go())
    assert service.handoff_snapshot()[0] < 4.1  # one sample of well under a second, at weight 0.2
