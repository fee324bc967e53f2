"""``make demo``'s verdicts: the load sized to the machine, refusals by design told apart from failures."""

from __future__ import annotations

from chunkline.bench.demo import Calibration, Plan, _Tally, open_loop_verdict, plan_load

QUIET = Calibration(round_trip_p50_s=0.005, round_trip_p99_s=0.012, infer_p50_ms=3.0, requests=200)
BUSY = Calibration(round_trip_p50_s=0.080, round_trip_p99_s=0.150, infer_p50_ms=40.0, requests=20)


def _tally(answered: int, errors: dict[str, int], late: int = 0, infer_ms: float = 5.0) -> _Tally:
    t = _Tally()
    t.latencies = [0.01] * answered
    t.infer_ms = [infer_ms] * answered
    t.errors.update(errors)
    t.late = late
    t.sent = answered + sum(errors.values())
    return t


def test_a_quiet_machine_gets_the_asked_load_and_a_busy_one_less() -> None:
    quiet = plan_load(QUIET, robots=4, rate_hz=10, deadline_ms=100)
    assert (quiet.rate_hz, quiet.deadline_ms) == (10, 100) and "serves the requested load" in quiet.why
    busy = plan_load(BUSY, robots=4, rate_hz=10, deadline_ms=100)
    # half of one-at-a-time capacity (1 / 80 ms = 12.5/s) over 4 robots; 3 x p99 = 450 ms
    assert busy.rate_hz == 0.5 * 12.5 / 4 and busy.deadline_ms == 450
    assert "rate lowered" in busy.why and "deadline raised" in busy.why


def test_the_verdict_passes_refusals_by_design_and_says_why() -> None:
    plan = Plan(10, 100, "")
    ok, line = open_loop_verdict(_tally(790, {"deadline_unmeetable": 10}), QUIET, plan, 4)
    assert ok and line.startswith("PASS: ") and "10 refused by design" in line and "got 790 on time" in line
    ok, line = open_loop_verdict(_tally(150, {"deadline_unmeetable": 650}, infer_ms=40), QUIET, plan, 4)
    assert ok and line.startswith("PASS (refusals by design)")
    assert "from 3.0 ms" in line and "to 40.0 ms" in line and "busy" in line and "\n" not in line


def test_late_answers_count_against_the_expectation_and_are_named() -> None:
    plan = Plan(10, 100, "")
    ok, line = open_loop_verdict(_tally(800, {}, late=3), QUIET, plan, 4)
    assert ok and "got 797 on time" in line and "3 answered and marked late by design" in line
    ok, line = open_loop_verdict(_tally(400, {"deadline_unmeetable": 100}, late=300), QUIET, plan, 4)
    assert ok and line.startswith("PASS (refusals by design)") and "100 refused, 300 answered and marked late" in line


def test_the_verdict_fails_unexpected_errors_and_silence() -> None:
    plan = Plan(10, 100, "")
    assert not open_loop_verdict(_tally(0, {}), QUIET, plan, 4)[0]
    ok, line = open_loop_verdict(_tally(700, {"internal": 100}), QUIET, plan, 4)
    assert not ok and "unexpected errors {'internal': 100}" in line
