"""Reservation in the fleet strategy (issue 32): each robot's next request predicted from its own
urgencies and batches (server/robot/fleet/calendar.py), a free worker that waits for a heavy robot
about to ask, the selector's wake-up time through admission, and the effect on the DES."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.robot.fleet import FleetCandidate, FleetConfig, FleetSelector, FleetStrategy, Urgency
from chunkline.server.robot.fleet.calendar import RobotCalendar
from chunkline.server.robot.fleet.strategy import blocking_cost

L40S = {1: 0.073, 2: 0.1098, 3: 0.1424, 4: 0.1775, 5: 0.2111}
_ids = itertools.count(1)


def latency(size: int) -> float:
    return L40S[min(size, 5)]


def cand(key: object, robot: str, arrival: float, *, dry_in: float = 0.1, rows: int = 5, weight: float = 1.0,
         deadline: float = 10.0) -> FleetCandidate:
    return FleetCandidate(key, "t", arrival, deadline, weight, Urgency(dry_in, rows, 0.05), robot=robot)


# ------------------------------------------------------------------------------------- calendar


def test_the_calendar_predicts_the_next_request_a_lead_before_the_plan_ends() -> None:
    cal = RobotCalendar()
    first = cand(1, "r", 0.0)
    cal.arrived(first)
    assert cal.expected(0.0, 10.0) == []  # its batch has not started: nothing to predict from
    cal.started([first], 0.08)  # back before the plan runs dry at 0.1: the plan grows from 0.1
    (e,) = cal.expected(0.0, 10.0)
    assert e.robot == "r" and e.candidate.key == ("expected", "r") and e.candidate.arrival == pytest.approx(0.25)
    assert e.candidate.urgency == first.urgency and e.candidate.weight == 1.0



@pytest.mark.parametrize(("end", "next_at"), [(0.08, 0.30), (0.16, 0.35)])
def test_a_fresher_observation_in_a_requests_place_moves_its_robots_next_request_only_when_its_chunk_is_in_time(
        end: float, next_at: float) -> None:
    # Replaced (``replaces``) a tick later, its place and key kept: back before the plan runs dry at
    # 0.1, the chunk's rows run on from the newer observation, a tick further; back after it, the
    # robot holds and resumes from the chunk's first row whatever its observation. Its lead stays.
    cal = RobotCalendar()
    first = cand(1, "r", 0.0)
    cal.arrived(first)
    cal.arrived(FleetCandidate(1, "t", 0.05, 10.0, 1.0, Urgency(0.05, 5, 0.05), robot="r", since=0.0))
    cal.started([first], end)
    (e,) = cal.expected(0.0, 10.0)
    assert e.candidate.arrival == pytest.approx(next_at) and e.candidate.urgency == first.urgency

def test_the_calendar_learns_the_extension_and_the_resume_after_a_hold() -> None:
    cal = RobotCalendar()
    a = cand(1, "r", 0.0, rows=5)
    cal.arrived(a)
    cal.started([a], 0.08)
    b = cand(2, "r", 0.30)  # one tick later than 5 rows say: its chunk runs six
    cal.arrived(b)
    cal.started([b], 0.46)  # past the plan's end at 0.4: it holds until its first tick after 0.46
    (e,) = cal.expected(0.0, 10.0)
    assert e.candidate.arrival == pytest.approx(0.50 + 0.30 - 0.1)
    c = cand(3, "r", 0.75)  # it resumed at 0.55: the chunk took 0.09 s to come back
    cal.arrived(c)
    cal.started([c], 0.80)  # back by 0.89, past the plan's end at 0.85: it resumes at 0.90
    (e,) = cal.expected(0.0, 10.0)
    # The hold's extra tick was learned as the return leg, not as a longer chunk.
    assert e.candidate.arrival == pytest.approx(0.90 + 0.30 - 0.1)


def test_a_missed_prediction_moves_a_tick_then_is_dropped_until_the_robot_asks_again_and_queued_robots_are_skipped() -> None:
    cal = RobotCalendar()
    a = cand(1, "r", 0.0)
    cal.arrived(a)
    cal.started([a], 0.08)
    assert [e.robot for e in cal.expected(0.0, 1.0)] == ["r"]
    assert cal.expected(0.0, 1.0, queued=["r"]) == []  # it has a request queued already
    assert cal.expected(0.0, 0.2) == []  # not by then
    # Due at 0.25, not here by then: a tick later (a hold a tick longer than predicted), once.
    assert [e.candidate.arrival for e in cal.expected(0.25, 1.0)] == [pytest.approx(0.30)]
    assert cal.expected(0.30, 1.0) == []  # not then either: missed
    assert cal.expected(0.0, 1.0) == []  # and not predicted again from that batch
    b = cand(2, "r", 0.32)
    cal.arrived(b)
    cal.started([b], 0.40)
    assert [e.robot for e in cal.expected(0.32, 1.0)] == ["r"]


def test_jittered_requests_are_predicted_on_the_robots_tick_grid_and_waited_for_through_their_band() -> None:
    cal = RobotCalendar()
    jitter = [0.0, 0.003, 0.001, 0.0015, 0.0005, 0.002]  # each request's send delay past its tick
    # A steady cycle: ask two rows before the plan ends, every five ticks, each chunk back in time.
    for k, late in enumerate(jitter):
        c = cand(k, "r", 0.25 * k + late)
        cal.arrived(c)
        cal.started([c], 0.25 * k + late + 0.08)
    (e,) = cal.expected(0.0, 10.0)
    # On the grid at the median phase (1.25 ms), at the band's late end (the latest, 3 ms): not
    # 1.50 + 2 ms as the last request's own delay would say, nor early by the jitter.
    assert e.candidate.arrival == pytest.approx(1.5 + 0.003)
    assert cal.expected(1.5 + 0.0025, 10.0) != []  # a request late within the band is still awaited
    # Past it: a tick later (see the next test).
    assert [e.candidate.arrival for e in cal.expected(1.5 + 0.0031, 10.0)] == [pytest.approx(1.55 + 0.003)]


def test_a_request_sent_dry_after_a_late_chunk_does_not_teach_the_cycle() -> None:
    cal = RobotCalendar()
    for k in range(4):
        c = cand(k, "r", 0.25 * k)
        cal.arrived(c)
        cal.started([c], 0.25 * k + 0.08)
    # A re-ask with the plan dry a tick after the last request: not a cycle's growth.
    dry = cand(10, "r", 0.80, dry_in=0.0)
    cal.arrived(dry)
    cal.started([dry], 0.88)
    back = cand(11, "r", 1.00)  # the robot is back on its cycle
    cal.arrived(back)
    cal.started([back], 1.08)
    (e,) = cal.expected(0.0, 10.0)
    assert e.candidate.arrival == pytest.approx(1.25)


def test_the_calendar_forgets_the_robots_heard_from_longest_ago() -> None:
    cal = RobotCalendar(max_robots=4)
    for i in range(9):
        cal.arrived(cand(i, f"r{i}", float(i)))
    assert len(cal) <= 4
    with pytest.raises(ValueError):
        RobotCalendar(max_robots=0)


# ------------------------------------------------------------------------------------- strategy


def test_a_free_worker_waits_for_a_heavy_robot_about_to_ask_rather_than_block_it() -> None:
    light = cand("light", "light", 0.0, dry_in=0.4, rows=9)
    heavy = cand(("expected", "heavy"), "heavy", 0.02, weight=5.0)
    s = FleetStrategy()
    choice = s.choose(0.0, [light], latency, 3, expected=[heavy])
    assert choice.waits_until == pytest.approx(0.02) and heavy.key in choice.keys
    # Without the prediction the light robot goes at once.
    now = FleetStrategy().choose(0.0, [light], latency, 3)
    assert now.keys == ("light",) and now.waits_until is None


def test_no_wait_beyond_half_a_batch_of_one_nor_while_a_request_has_aged() -> None:
    light = cand("light", "light", 0.0, dry_in=0.4, rows=9)
    late = cand(("expected", "heavy"), "heavy", 0.05, weight=5.0)  # beyond 0.5 * 73 ms
    assert FleetStrategy().choose(0.0, [light], latency, 3, expected=[late]).waits_until is None
    soon = cand(("expected", "heavy"), "heavy", 0.02, weight=5.0)
    aged = cand("old", "old", -1.0, dry_in=0.0)  # queued past the starvation bound (0.5 s)
    choice = FleetStrategy().choose(0.0, [light, aged], latency, 3, expected=[soon])
    assert choice.waits_until is None and "old" in choice.keys
    with pytest.raises(ValueError):
        FleetConfig(max_wait_share=-1.0)


def test_a_full_batch_that_would_make_a_heavy_robot_hold_gives_way_to_one_that_ends_in_time() -> None:
    lights = [cand(f"l{i}", f"l{i}", 0.0, dry_in=0.4, rows=9) for i in range(3)]
    # The heavy robot asks in 96 ms with two rows left: a batch of three (142 ms) and then its own
    # batch of one end past its plan's end (a tick held at weight 5); a batch of two does not.
    heavy = cand(("expected", "heavy"), "heavy", 0.096, dry_in=0.1, weight=5.0)
    assert blocking_cost(heavy, latency(3), latency(1)) == pytest.approx(5 * 0.05)
    assert blocking_cost(heavy, latency(2), latency(1)) == 0.0
    assert blocking_cost(heavy, 0.05, latency(1)) == 0.0
    assert len(FleetStrategy().choose(0.0, lights, latency, 3, expected=[heavy]).keys) == 2
    assert len(FleetStrategy().choose(0.0, lights, latency, 3).keys) == 3


def test_robots_asking_a_few_milliseconds_apart_share_a_batch() -> None:
    first = cand("a", "a", 0.0, dry_in=0.1, rows=9)
    others = [cand(("expected", r), r, 0.01, dry_in=0.1, rows=9) for r in ("b", "c")]
    choice = FleetStrategy().choose(0.0, [first], latency, 3, expected=others)
    assert choice.waits_until == pytest.approx(0.01) and set(choice.keys) == {"a", *(c.key for c in others)}


# ------------------------------------------------------------------------------------- selector


@dataclasses.dataclass
class Work:
    enqueued_at: float
    urgency: Urgency | None
    robot_weight: float = 1.0
    queued_since: float | None = None


def _controller() -> AdmissionController:
    reg = TenantRegistry({"fleet": TenantInfo("fleet")})
    return AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_batch_size=3),
                               ServiceTimeModel(deviation_factor=0.0, initial=L40S), FleetSelector(FleetStrategy(), lambda t: 1.0))


def _offer(c: AdmissionController, session: str, work: Work, now: float) -> Request:
    r = Request(next(_ids), session, "fleet", "policy", PolicyCost(), now + 1.0, 0, work)
    assert isinstance(c.offer(r, now), Admitted)
    return r


def test_the_selector_waits_for_the_heavy_robot_and_admission_says_when_to_ask_again() -> None:
    c = _controller()
    assert c.wake_at() == math.inf
    heavy = _offer(c, "heavy", Work(0.0, Urgency(0.1, 5, 0.05), 5.0), 0.0)
    assert c.next_batch(0.0) == [heavy]
    c.complete_batch([heavy], 0.073, 0.073)
    light = _offer(c, "light", Work(0.2, Urgency(0.4, 9, 0.05)), 0.2)
    # The heavy robot's plan ends at 0.35 (0.1 + five rows): it asks again at 0.25.
    assert c.next_batch(0.23) == [] and c.wake_at() == pytest.approx(0.25 + 0.002)
    again = _offer(c, "heavy", Work(0.25, Urgency(0.1, 5, 0.05), 5.0), 0.25)
    assert c.next_batch(0.25) == [again] and c.wake_at() == math.inf
    assert c.queued == 1 and light


def test_a_robot_that_does_not_come_is_not_waited_for_twice() -> None:
    c = _controller()
    heavy = _offer(c, "heavy", Work(0.0, Urgency(0.1, 5, 0.05), 5.0), 0.0)
    c.next_batch(0.0)
    c.complete_batch([heavy], 0.073, 0.073)
    light = _offer(c, "light", Work(0.2, Urgency(0.4, 9, 0.05)), 0.2)
    assert c.next_batch(0.23) == []
    assert c.next_batch(c.wake_at()) == [light]  # the heavy robot did not ask: the light one goes


def test_without_reservation_the_selector_never_waits() -> None:
    reg = TenantRegistry({"fleet": TenantInfo("fleet")})
    c = AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_batch_size=3), ServiceTimeModel(initial=L40S),
                            FleetSelector(FleetStrategy(), lambda t: 1.0, reserve=False))
    heavy = _offer(c, "heavy", Work(0.0, Urgency(0.1, 5, 0.05), 5.0), 0.0)
    c.next_batch(0.0)
    c.complete_batch([heavy], 0.073, 0.073)
    light = _offer(c, "light", Work(0.2, Urgency(0.4, 9, 0.05)), 0.2)
    assert c.next_batch(0.23) == [light] and c.wake_at() == math.inf


# ------------------------------------------------------------------------------------- the DES


def test_reservation_keeps_the_weighted_robot_running_on_armorys_workload() -> None:
    from chunkline.bench.fleet_contention import defaults_for
    from chunkline.bench.fleet_contention.des import run_des
    from chunkline.bench.fleet_contention.metrics import fleet_metrics
    from chunkline.bench.fleet_contention.workload import load_workload

    w = load_workload("armory-l40s")
    by = {s: fleet_metrics(run_des(w, defaults_for, strategy=s), w.duration_s, indexed=True) for s in ("fleet", "fleet-now")}
    assert by["fleet"].tiers[5.0] >= by["fleet-now"].tiers[5.0] + 0.05
    assert by["fleet"].tiers[5.0] >= 0.9
