"""The fleet batch-selection strategy (server/robot/fleet): urgency checks, value, deadlines,
the starvation bound, fairness between equals and between tenants, and Armory's L40S workload in
the discrete-event simulation of bench/fleet_strategies.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.bench import fleet_strategies as fs
from chunkline.client.wire.errors import ErrorCode
from chunkline.server.robot.fleet import (
    FleetCandidate,
    FleetConfig,
    FleetStrategy,
    Reserver,
    Urgency,
    UrgencyBounds,
    UrgencyError,
    urgency_from_wire,
)
from chunkline.server.robot.fleet.strategy import stale_rows

L40S = (0.073, 0.1098, 0.1424, 0.1775, 0.2111)


def latency(size: int) -> float:
    return L40S[size - 1]


def cand(key: str, *, arrival: float = 0.0, deadline: float = 1.0, weight: float = 1.0, dry_in: float = 0.2,
         rows: int = 8, period: float = 0.05, tenant: str = "t") -> FleetCandidate:
    return FleetCandidate(key, tenant, arrival, deadline, weight, Urgency(dry_in, rows, period), robot=key)


# ----------------------------------------------------------------------------- urgency on the wire


def test_urgency_is_read_in_seconds() -> None:
    assert urgency_from_wire({"dry_in_ms": 120.0, "rows": 8, "period_ms": 50}) == Urgency(0.12, 8, 0.05)


@pytest.mark.parametrize("fields", [
    {"dry_in_ms": -1.0, "rows": 8, "period_ms": 50},
    {"dry_in_ms": math.nan, "rows": 8, "period_ms": 50},
    {"dry_in_ms": math.inf, "rows": 8, "period_ms": 50},
    {"dry_in_ms": 10, "rows": 0, "period_ms": 50},
    {"dry_in_ms": 10, "rows": 2.5, "period_ms": 50},
    {"dry_in_ms": 10, "rows": True, "period_ms": 50},
    {"dry_in_ms": 10, "rows": 8, "period_ms": 0},
    {"dry_in_ms": 10, "rows": 8, "period_ms": -5},
    {"dry_in_ms": "10", "rows": 8, "period_ms": 50},
    {"rows": 8, "period_ms": 50},
    {"dry_in_ms": 10, "rows": 8, "period_ms": 50, "weight": 100},
])
def test_urgency_that_cannot_be_true_is_refused_with_a_typed_error(fields: dict[str, object]) -> None:
    with pytest.raises(UrgencyError) as err:
        urgency_from_wire(fields)
    assert err.value.code is ErrorCode.INVALID_MESSAGE


def test_urgency_beyond_the_tenants_bounds_is_clamped() -> None:
    bounds = UrgencyBounds(max_dry_in_s=2.0, max_rows=50, min_period_s=0.01, max_period_s=0.5)
    u = urgency_from_wire({"dry_in_ms": 1e12, "rows": 10**9, "period_ms": 1e-6}, bounds)
    assert u == Urgency(2.0, 50, 0.01)
    assert urgency_from_wire({"dry_in_ms": 0, "rows": 1, "period_ms": 1e9}, bounds).period_s == 0.5


# ----------------------------------------------------------------------------- choices


def test_equal_robots_fill_a_batch_most_urgent_first() -> None:
    queued = [cand(f"r{i}", dry_in=0.1 * (5 - i)) for i in range(5)]
    choice = FleetStrategy().choose(0.0, queued, latency, 3)
    assert choice.keys == ("r4", "r3", "r2")
    assert choice.end == pytest.approx(0.1424)


def test_a_weighted_robot_goes_alone_when_that_is_worth_more() -> None:
    # Dry in 100 ms: on time alone (73 ms), late in a full batch (142 ms).
    heavy = cand("heavy", weight=5.0, rows=4, dry_in=0.1)
    light = [cand(f"r{i}", rows=8) for i in range(4)]
    assert FleetStrategy().choose(0.0, [heavy, *light], latency, 3).keys == ("heavy",)
    # On time in a full batch too, it rides in one; so does the same robot at weight 1.
    on_time = cand("heavy", weight=5.0, rows=4, dry_in=0.145)
    assert FleetStrategy().choose(0.0, [on_time, *light], latency, 3).keys == ("heavy", "r0", "r1")
    heavy.weight = 1.0
    assert len(FleetStrategy().choose(0.0, [heavy, *light], latency, 3).keys) == 3


def test_nothing_is_chosen_for_a_batch_that_ends_after_its_deadline() -> None:
    tight = cand("tight", deadline=0.1)  # fits a batch of one (73 ms), not of three (142 ms)
    queued = [tight, *(cand(f"r{i}") for i in range(3))]
    choice = FleetStrategy().choose(0.0, queued, latency, 3)
    assert "tight" not in choice.keys or choice.end <= 0.1
    assert FleetStrategy().choose(0.0, [cand("late", deadline=0.05)], latency, 3).keys == ()


def test_rows_pass_while_dry_only_for_time_indexed_plans() -> None:
    late = cand("late", dry_in=0.0, rows=8)
    held = FleetStrategy().value(late, 0.2, 0.0)
    indexed = FleetStrategy(FleetConfig(rows_pass_while_dry=True)).value(late, 0.2, 0.0)
    assert held == pytest.approx(0.4)
    assert indexed == pytest.approx(0.2)  # four of its eight rows were due while it waited


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 0.5), st.floats(0.01, 1.0), st.floats(0.2, 5.0), st.floats(0, 0.5),
                       st.integers(1, 12)), min_size=1, max_size=12),
    st.integers(1, 5),
)
def test_every_chosen_request_meets_its_deadline(specs: list[tuple[float, float, float, float, int]], max_size: int) -> None:
    now = 0.5
    queued = [cand(f"r{i}", arrival=a, deadline=now + d, weight=w, dry_in=dry, rows=rows)
              for i, (a, d, w, dry, rows) in enumerate(specs)]
    choice = FleetStrategy().choose(now, queued, latency, max_size)
    by_key = {c.key: c for c in queued}
    assert len(choice.keys) <= max_size and len(set(choice.keys)) == len(choice.keys)
    assert all(by_key[k].deadline >= choice.end - 1e-9 for k in choice.keys)
    if choice.keys:
        assert choice.end == pytest.approx(now + latency(len(choice.keys)))
    elif any(c.deadline >= now + latency(1) for c in queued):
        pytest.fail("a request that fits a batch of one was left with the worker idle")


def _serve_closed_loop(robots: list[FleetCandidate], strategy: FleetStrategy, max_size: int, batches: int,
                       claim: dict[str, float] | None = None) -> tuple[dict[str, int], dict[str, float]]:
    """Each robot always has one request queued: it asks again the moment its chunk lands.
    Returns the batches each robot rode in and its longest wait."""
    now = 0.0
    served = {str(r.key): 0 for r in robots}
    waited = {str(r.key): 0.0 for r in robots}
    queued = {str(r.key): r for r in robots}
    for _ in range(batches):
        choice = strategy.choose(now, list(queued.values()), latency, max_size)
        assert choice.keys
        now = choice.end
        for k in map(str, choice.keys):
            old = queued[k]
            served[k] += 1
            waited[k] = max(waited[k], now - latency(len(choice.keys)) - old.arrival)
            dry = claim[k] if claim is not None and k in claim else 0.3
            queued[k] = cand(k, arrival=now, deadline=now + 10.0, weight=old.weight, tenant=old.tenant,
                             dry_in=dry, rows=old.urgency.rows if old.urgency else 8)
    for k, c in queued.items():  # still waiting at the end (or never served): waited until now
        waited[k] = max(waited[k], now - c.arrival)
    return served, waited


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 5.0), st.floats(0.0, 1.0), st.integers(1, 12)), min_size=2, max_size=10),
       st.integers(1, 3), st.sampled_from([0.2, 0.5]))
def test_no_request_waits_beyond_the_starvation_bound(specs: list[tuple[float, float, int]], max_size: int, bound: float) -> None:
    robots = [cand(f"r{i}", weight=w, dry_in=dry, rows=rows, deadline=10.0) for i, (w, dry, rows) in enumerate(specs)]
    _, waited = _serve_closed_loop(robots, FleetStrategy(FleetConfig(starvation_bound_s=bound)), max_size, 60)
    # Past the bound a request goes first, oldest first: at most the others' aged requests, a
    # batch at a time, plus the batch running when it aged, go before it.
    worst = bound + (math.ceil(len(robots) / max_size) + 1) * latency(max_size)
    assert max(waited.values()) <= worst + 1e-9


def test_without_aging_a_claimed_urgency_would_starve_the_others() -> None:
    robots = [cand("heavy", weight=5.0, dry_in=0.0, rows=12, deadline=10.0),
              *(cand(f"r{i}", weight=0.5, dry_in=1.0, rows=1, deadline=10.0) for i in range(3))]
    for bound, starved in ((0.2, False), (100.0, True)):
        _, waited = _serve_closed_loop(robots, FleetStrategy(FleetConfig(starvation_bound_s=bound)), 1, 60, claim={"heavy": 0.0})
        assert (max(waited.values()) > 0.2 + 5 * latency(1)) is starved


@given(st.integers(2, 9), st.integers(1, 3))
@settings(max_examples=30, deadline=None)
def test_equal_weights_share_equally(n: int, max_size: int) -> None:
    robots = [cand(f"r{i}", rows=8) for i in range(n)]
    served, _ = _serve_closed_loop(robots, FleetStrategy(), max_size, 40 * n)
    assert max(served.values()) - min(served.values()) <= 1


@pytest.mark.parametrize("slack", [0.0, 0.5])
def test_a_robot_whose_urgency_lies_takes_no_more_than_its_tenants_weight(slack: float) -> None:
    # One robot always claims to be dry with long chunks; the other tells the truth. Two tenants
    # of equal weight, one batch at a time: each gets half, within the slack.
    liar = cand("liar", tenant="a", rows=256, dry_in=0.0)
    honest = cand("honest", tenant="b", rows=8, dry_in=0.3)
    strategy = FleetStrategy(FleetConfig(tenant_slack_s=slack, starvation_bound_s=10.0))
    served, _ = _serve_closed_loop([liar, honest], strategy, 1, 200, claim={"liar": 0.0})
    assert served["honest"] >= 100 - (slack / latency(1) + 1)


def test_without_the_tenant_share_the_lying_robot_would_take_the_worker() -> None:
    # The same as above with the share turned off and aging far off: the guard is what holds.
    liar = cand("liar", tenant="a", rows=256, dry_in=0.0)
    honest = cand("honest", tenant="b", rows=8, dry_in=0.3)
    strategy = FleetStrategy(FleetConfig(tenant_slack_s=math.inf, starvation_bound_s=10.0))
    served, _ = _serve_closed_loop([liar, honest], strategy, 1, 200, claim={"liar": 0.0})
    assert served["honest"] < 20


def test_a_robot_with_no_plan_is_valued_as_dry_from_its_arrival() -> None:
    # A first request tells no plan: its robot is dry, so a later batch costs it that batch's
    # time dry, as for any dry robot; a plan far from dry with a little more to run waits.
    first = FleetCandidate("first", "t", 0.0, 10.0, robot="first")
    later = cand("later", dry_in=2.0, rows=3)
    assert FleetStrategy().value(first, 0.1, 0.1) == pytest.approx(FleetConfig().plain_value_s + 0.1)
    assert FleetStrategy().choose(0.0, [later, first], latency, 1).keys == ("first",)


def test_a_robot_that_tells_no_plan_takes_no_more_than_its_tenants_weight() -> None:
    # Telling no plan (dry now) on every request is no way past the tenant share either.
    now, served = 0.0, {"silent": 0, "honest": 0}
    queued = {"silent": FleetCandidate("silent", "a", now, 10.0, robot="silent"),
              "honest": cand("honest", tenant="b", rows=2, dry_in=1.0)}
    for share in (0.0, math.inf):  # with the share off, it would take the worker
        strategy = FleetStrategy(FleetConfig(tenant_slack_s=share, starvation_bound_s=10.0))
        for _ in range(200):
            (k,) = strategy.choose(now, list(queued.values()), latency, 1).keys
            now += latency(1)
            served[str(k)] += 1
            queued[str(k)] = (FleetCandidate("silent", "a", now, now + 10.0, robot="silent") if k == "silent"
                              else cand("honest", tenant="b", rows=2, dry_in=1.0, arrival=now, deadline=now + 10.0))
        assert (served["honest"] == 100) if share == 0.0 else (served["honest"] < 20)
        served = {k: 0 for k in served}


def test_a_chunk_runs_stale_from_the_tick_it_lands_too_late_for() -> None:
    # Nine rows one a tick from the first tick after the chunk is back (10 ms after its batch):
    # back before the 4th tick after the observation, its last row runs 12 ticks old (0.60 s).
    cfg = FleetConfig()
    asked = cand("a", arrival=0.0, dry_in=0.1, rows=9)
    assert stale_rows(asked, 0.185, cfg) == 0
    assert stale_rows(asked, 0.195, cfg) == 1  # back at 0.205: from the 5th tick
    assert stale_rows(asked, 0.295, cfg) == 3
    assert stale_rows(asked, 5.0, cfg) == 9  # never more than its rows
    # A plan whose rows run older than the bound however soon it is served is not weighed.
    assert stale_rows(cand("long", dry_in=0.1, rows=12), 0.295, cfg) == 0
    assert stale_rows(asked, 0.295, FleetConfig(age_bound_s=None)) == 0


def _stale_or_not(weight: float) -> tuple[FleetCandidate, FleetCandidate]:
    # "late" asked 110 ms ago and is dry: served now its rows run within 0.6 s, a batch later two
    # run stale. "fresh" asked now: a batch later costs it no stale row but a little dry time.
    late = cand("late", arrival=-0.11, dry_in=0.1, rows=9)
    return late, cand("fresh", arrival=0.0, dry_in=0.1, rows=9, weight=weight)


def test_among_equals_the_robot_whose_rows_would_run_stale_goes_first() -> None:
    late, fresh = _stale_or_not(1.0)
    assert FleetStrategy().choose(0.0, [late, fresh], latency, 1).keys == ("late",)
    # Weighed by executed time alone it would wait: the other is spared as much and weighs more.
    heavier = cand("fresh", arrival=0.0, dry_in=0.1, rows=12)
    assert FleetStrategy(FleetConfig(age_bound_s=None)).choose(0.0, [late, heavier], latency, 1).keys == ("fresh",)
    assert FleetStrategy().choose(0.0, [late, heavier], latency, 1).keys == ("late",)


def test_a_lighter_robots_freshness_never_outbids_a_heavier_robots_time() -> None:
    late, fresh = _stale_or_not(1.1)
    assert FleetStrategy().choose(0.0, [late, fresh], latency, 1).keys == ("fresh",)
    # Its two stale rows (stale_cost of a row's time each) count only where none weighed is heavier.
    strategy = FleetStrategy()
    stale = 2 * strategy.config.stale_cost * late.urgency.period_s
    assert stale > 0
    assert strategy.value(late, 0.073, 0.073, heaviest=1.0) == pytest.approx(strategy.value(late, 0.073, 0.073) + stale)
    assert strategy.value(late, 0.073, 0.073, heaviest=1.1) == pytest.approx(strategy.value(late, 0.073, 0.073))


def test_a_heavier_robot_heard_from_lately_keeps_lighter_robots_ages_unweighed() -> None:
    # Between its requests a heavier robot is neither queued nor expected: its weight still counts.
    late, _ = _stale_or_not(1.0)
    heavier = cand("fresh", arrival=0.0, dry_in=0.1, rows=12)
    assert FleetStrategy().choose(0.0, [late, heavier], latency, 1).keys == ("late",)
    assert FleetStrategy().choose(0.0, [late, heavier], latency, 1, heaviest=5.0).keys == ("fresh",)


def test_the_reserver_remembers_a_heavy_robots_weight_for_a_while_only() -> None:
    reserver = Reserver(FleetStrategy(), reserve=False)
    reserver.choose(0.0, [cand("heavy", weight=5.0)], latency, 1)

    def first_at(now: float, n: int) -> str:
        late = FleetCandidate(f"late{n}", "t", now - 0.11, now + 1.0, 1.0, Urgency(0.1, 9, 0.05), robot="late")
        fresh = FleetCandidate(f"fresh{n}", "t", now, now + 1.0, 1.0, Urgency(0.1, 12, 0.05), robot="fresh")
        return str(reserver.choose(now, [late, fresh], latency, 1).keys[0])

    memory = reserver.strategy.config.weight_memory_s
    assert first_at(0.5 * memory, 1) == "fresh1"  # the heavy robot is between two requests
    assert first_at(2.0 * memory, 2) == "late2"  # gone: the lighter robots are the heaviest left


def test_ages_are_reckoned_where_a_batch_ends_on_average_not_where_admission_plans_it() -> None:
    # Admission plans a bad-but-usual batch (its mean plus deviations), 25 ms longer here. Two
    # robots dry since 66 ms ago are back before their 4th tick after a batch of two on average
    # (none of their rows stale) and from their 5th after a batch of three; the third asked now.
    def planned(size: int) -> float:
        return latency(size) + 0.025

    late = [cand(k, arrival=-0.066, dry_in=0.1, rows=9) for k in ("a", "b")]
    queued = [*late, cand("c", arrival=0.0, dry_in=0.1, rows=5)]
    assert FleetStrategy().choose(0.0, queued, planned, 3, mean_latency=latency).keys == ("a", "b")
    # On the planned ends both run a row stale in either batch: the third robot's rows tip it.
    assert len(FleetStrategy().choose(0.0, queued, planned, 3).keys) == 3
    # Deadlines are still met on the planned curve.
    tight = [cand(k, arrival=-0.066, dry_in=0.1, rows=9, deadline=0.12) for k in ("a", "b")]
    assert FleetStrategy().choose(0.0, tight, planned, 3, mean_latency=latency).keys == ("a",)


# ----------------------------------------------------------------------------- Armory's L40S workload


def test_armory_weighted_robot_reaches_lookaheads_progress_without_losing_the_fleet() -> None:
    m = fs.simulate(fs.armory_l40s(weighted=True), fs.FleetScheduler())
    assert m.progress["fast-0"] >= 0.92 and m.useful >= 1294


def test_armory_equal_weights_match_round_robin_at_least() -> None:
    m = fs.simulate(fs.armory_l40s(weighted=False), fs.FleetScheduler())
    rr = fs.simulate(fs.armory_l40s(weighted=False), fs.RoundRobin())
    assert m.useful >= 1497 and m.starved <= 0.251
    assert m.useful >= rr.useful and m.starved <= rr.starved


def test_the_simulation_reproduces_fleetvlas_round_robin_and_edf() -> None:
    # FleetVLA's published figures for the same workload: the harness measures what it does.
    w = fs.armory_l40s(weighted=True)
    rr = fs.simulate(w, fs.RoundRobin())
    edf = fs.simulate(w, fs.schedulers(w)["EDF"]())
    assert (rr.useful, rr.starved, rr.progress["fast-0"]) == (1497, pytest.approx(0.2515), 0.46)
    assert (edf.useful, edf.starved, edf.progress["fast-0"]) == (1481, pytest.approx(0.2595), 0.73)


class _Unpruned(FleetStrategy):
    def _pool(self, queued, *args, **kwargs):  # type: ignore[no-untyped-def]
        return list(queued)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1.0), st.floats(0.01, 1.0), st.sampled_from([0.5, 1.0, 5.0]), st.floats(0, 0.5),
                       st.integers(1, 12), st.sampled_from(["a", "b"])), min_size=1, max_size=30),
    st.integers(1, 4), st.booleans(),
)
def test_pruning_the_pool_never_changes_the_choice(specs: list[tuple[float, float, float, float, int, str]], max_size: int,
                                                   rows_pass: bool) -> None:
    now = 1.0
    queued = [cand(f"r{i}", arrival=a, deadline=now + d, weight=w, dry_in=dry, rows=rows, tenant=t)
              for i, (a, d, w, dry, rows, t) in enumerate(specs)]
    cfg = FleetConfig(rows_pass_while_dry=rows_pass)
    assert FleetStrategy(cfg).choose(now, queued, latency, max_size) == _Unpruned(cfg).choose(now, queued, latency, max_size)


def test_robots_of_different_control_rates_are_valued_by_time_not_rows() -> None:
    # Half a second of plan is worth the same at 10 Hz (5 rows) as at 50 Hz (25 rows).
    slow_rate = cand("10hz", rows=5, period=0.1, dry_in=0.5)
    fast_rate = cand("50hz", rows=25, period=0.02, dry_in=0.5)
    s = FleetStrategy()
    assert s.value(slow_rate, 0.1, 0.1) == pytest.approx(s.value(fast_rate, 0.1, 0.1)) == pytest.approx(0.5)
    # With the time-indexed plan, each waits out its own period: 0.15 s late is 2 rows at 10 Hz, 8 at 50 Hz.
    indexed = FleetStrategy(FleetConfig(rows_pass_while_dry=True))
    late_slow, late_fast = cand("10hz", rows=5, period=0.1, dry_in=0.0), cand("50hz", rows=25, period=0.02, dry_in=0.0)
    assert indexed.value(late_slow, 0.15, 0.0) == pytest.approx(0.3)
    assert indexed.value(late_fast, 0.15, 0.0) == pytest.approx(0.34)


def test_the_simulation_counts_rows_index_execution_runs_time_shifted() -> None:
    # Saturated: robots ask with 0.1 s of plan left, move on, hold, and resume the late chunk.
    m = fs.simulate(fs.armory_l40s(False), fs.RoundRobin())
    assert 0 < m.shifted <= m.useful
    # A GPU fast enough that no robot ever holds: no chunk runs time-shifted.
    w = fs.armory_l40s(False)
    fast = fs.Workload(w.robots, tuple(0.001 * b for b in range(1, 6)), w.max_batch, w.duration_s)
    m = fs.simulate(fast, fs.RoundRobin())
    assert m.shifted == 0 and m.starved < 0.01


def test_a_replacement_keeps_the_starvation_place_of_the_request_it_replaced() -> None:
    # "fresh" was received now (its urgency and observation count from now) but took the place
    # of a request queued 0.6 s ago: past the bound, it goes first however little it is worth.
    strategy = FleetStrategy(FleetConfig(starvation_bound_s=0.5))
    heavy = cand("heavy", arrival=1.0, weight=5.0, dry_in=0.0, rows=12, deadline=10.0)
    light = cand("fresh", arrival=1.0, weight=0.5, dry_in=1.0, rows=1, deadline=10.0)
    assert strategy.choose(1.0, [heavy, light], latency, 1).keys == ("heavy",)
    refreshed = FleetCandidate("fresh", "t", 1.0, 10.0, 0.5, light.urgency, robot="fresh", since=0.4)
    assert FleetStrategy(FleetConfig(starvation_bound_s=0.5)).choose(1.0, [heavy, refreshed], latency, 1).keys == ("fresh",)
