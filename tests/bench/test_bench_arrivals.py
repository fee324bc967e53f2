"""Arrival processes: rates and burstiness within tolerance over many samples, deterministic
with a seed; trace files read, written and time-scaled."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.bench.arrivals import (
    Arrival,
    ArrivalError,
    ConstantArrivals,
    GammaArrivals,
    PoissonArrivals,
    index_of_dispersion,
    interarrival_cv,
    load_trace,
    make_process,
    save_trace,
    schedule,
    trace_rate,
    trace_schedule,
)

DURATION = 200.0
RATE = 100.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_rate_and_dispersion(seed: int) -> None:
    t = PoissonArrivals(RATE).times(DURATION, seed)
    # 20 000 expected; one standard deviation is 0.7 %.
    assert len(t) / DURATION == pytest.approx(RATE, rel=0.03)
    assert interarrival_cv(t) == pytest.approx(1.0, abs=0.05)
    assert index_of_dispersion(t, 1.0, DURATION) == pytest.approx(1.0, abs=0.3)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_rate_and_burstiness(seed: int, cv: float) -> None:
    t = GammaArrivals(RATE, cv).times(DURATION, seed)
    assert len(t) / DURATION == pytest.approx(RATE, rel=0.05)
    assert interarrival_cv(t) == pytest.approx(cv, rel=0.1)
    # For a renewal process, counts in windows much longer than a gap disperse as cv**2.
    assert index_of_dispersion(t, 1.0, DURATION) == pytest.approx(cv * cv, rel=0.4)


def test_bursty_gamma_is_burstier_than_poisson_at_the_same_rate() -> None:
    p = PoissonArrivals(RATE).times(DURATION, 7)
    g = GammaArrivals(RATE, 3.0).times(DURATION, 7)
    assert index_of_dispersion(g, 0.5, DURATION) > 3 * index_of_dispersion(p, 0.5, DURATION)


def test_constant_is_exact() -> None:
    t = ConstantArrivals(50.0).times(2.0)
    assert len(t) == 100
    assert np.allclose(np.diff(t), 0.02)
    assert t[0] == 0.0
    assert interarrival_cv(t) == pytest.approx(0.0, abs=1e-9)
    assert index_of_dispersion(ConstantArrivals(RATE).times(DURATION), 1.0, DURATION) == pytest.approx(0.0, abs=1e-9)
    shifted = ConstantArrivals(50.0, phase=0.5).times(2.0)
    assert shifted[0] == pytest.approx(0.01) and len(shifted) == 100


def test_constant_has_no_drift_over_long_runs() -> None:
    t = ConstantArrivals(3.0).times(100_000.0)
    assert len(t) == 300_000
    assert t[-1] == pytest.approx((300_000 - 1) / 3.0, abs=1e-9)


@pytest.mark.parametrize("kind", ["constant", "poisson", "gamma"])
def test_same_seed_same_schedule_other_seed_other_schedule(kind: str) -> None:
    a = make_process(kind, 40.0).times(10.0, seed=3)
    b = make_process(kind, 40.0).times(10.0, seed=3)
    assert np.array_equal(a, b)
    c = make_process(kind, 40.0).times(10.0, seed=4)
    if kind == "constant":
        assert np.array_equal(a, c)  # no randomness
    else:
        assert not np.array_equal(a, c)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["constant", "poisson", "gamma"]),
       rate=st.floats(0.5, 500.0),
       duration=st.floats(0.0, 5.0),
       robots=st.integers(1, 20),
       seed=st.integers(0, 2**31))
def test_schedules_are_sorted_in_range_and_dealt_evenly(kind: str, rate: float, duration: float, robots: int,
                                                        seed: int) -> None:
    arrivals = schedule(make_process(kind, rate), duration, robots, seed=seed, deadline_ms=50.0)
    t = np.array([a.t for a in arrivals])
    assert np.all(np.diff(t) >= 0)
    assert np.all((t >= 0) & (t < duration))
    counts = np.bincount([a.robot for a in arrivals], minlength=robots)
    assert counts.max() - counts.min() <= 1
    assert all(a.deadline_ms == 50.0 for a in arrivals)
    assert arrivals == schedule(make_process(kind, rate), duration, robots, seed=seed, deadline_ms=50.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_parameters_are_refused(bad: float) -> None:
    with pytest.raises(ArrivalError):
        PoissonArrivals(bad)
    with pytest.raises(ArrivalError):
        GammaArrivals(10.0, cv=bad)
    with pytest.raises(ArrivalError):
        make_process("poisson", 10.0).times(bad if bad != 0.0 else -1.0)
    with pytest.raises(ArrivalError):
        make_process("zipf", 10.0)
    with pytest.raises(ArrivalError):
        schedule(make_process("constant", 1.0), 1.0, 0)


# ---------------------------------------------------------------------------------- traces

def test_trace_round_trip(tmp_path: Path) -> None:
    arrivals = [
        Arrival(t=0.0, robot=0, tenant="acme"),
        Arrival(t=0.1, robot=1, tenant="acme", shape=(96, 96, 3), deadline_ms=80.0),
        Arrival(t=0.25, robot=0, cls="text", prompt_len=120, output_len=40),
    ]
    path = tmp_path / "trace.jsonl"
    save_trace(path, arrivals)
    assert load_trace(path) == arrivals


def test_trace_csv_origin_order_and_sessions(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("t,tenant,class,shape,prompt_len,output_len,deadline_ms\n"
                    "12.5,beta,policy,224x224x3,,,100\n"
                    "10.0,alpha,policy,,,,\n"
                    "11.0,alpha,text,,64,16,\n")
    trace = load_trace(path)
    assert [a.t for a in trace] == [0.0, 1.0, 2.5]
    # No robot column: one session per tenant, numbered by first appearance.
    assert [(a.tenant, a.robot) for a in trace] == [("alpha", 0), ("alpha", 0), ("beta", 1)]
    assert trace[1].cls == "text" and trace[1].prompt_len == 64 and trace[1].output_len == 16
    assert trace[2].shape == (224, 224, 3) and trace[2].deadline_ms == 100.0


@pytest.mark.parametrize("text", ['{"robot": 1}\n', '{"t": "soon"}\n', "not json\n", '{"t": 1, "shape": "0x3"}\n',
                                  '[1, 2]\n', '{"t": NaN}\n'])
def test_bad_trace_lines_are_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ArrivalError):
        load_trace(path)


def test_missing_trace_file_is_an_arrival_error(tmp_path: Path) -> None:
    with pytest.raises(ArrivalError):
        load_trace(tmp_path / "nope.jsonl")


def test_trace_scaled_to_a_rate_cut_and_folded() -> None:
    trace = [Arrival(t=i * 0.5, robot=i % 4) for i in range(21)]  # 2 per second over 10 s
    assert trace_rate(trace) == pytest.approx(2.0)
    fast = trace_schedule(trace, rate=8.0, robots=2, deadline_ms=60.0)
    assert [a.t for a in fast] == pytest.approx([i * 0.125 for i in range(21)])
    assert {a.robot for a in fast} == {0, 1}
    assert all(a.deadline_ms == 60.0 for a in fast)
    cut = trace_schedule(trace, rate=8.0, duration=1.0)
    assert len(cut) == 8
    assert trace_schedule(trace) == trace  # as recorded
    with pytest.raises(ArrivalError):
        trace_schedule([Arrival(t=0.0)], rate=5.0)
