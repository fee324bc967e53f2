"""What the research output says: the breakdown's median remainder and inconclusive runs, plot
labels and ticks, the capacity planner's curve warnings and cost units."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from chunkline.bench import plots
from chunkline.bench.breakdown import inconclusive_labels, median_remainder, stage_table, stage_times, summarize_stages
from chunkline.bench.capacity_plan import ServicePoint, curve_warnings, format_cost

SERVER = {"decode_ms": 0.2, "queue_ms": 1.0, "infer_ms": 6.0, "encode_ms": 0.1, "server_ms": 7.5}
CLIENT = {"encode_ms": 0.3, "send_ms": 0.4, "round_trip_ms": 9.0, "decode_ms": 0.2}


def _rows() -> list[dict[str, float]]:
    # Two stages that are slow on different requests: the medians of the parts miss the median of the sum.
    rows = []
    for i in range(101):
        queue = 10.0 if i % 2 else 0.0
        infer = 10.0 if i % 3 == 0 else 1.0
        rows.append(stage_times(SERVER | {"queue_ms": queue, "infer_ms": infer, "server_ms": 0.3 + queue + infer},
                                CLIENT | {"round_trip_ms": 1.5 + queue + infer}))
    return rows


def test_the_table_shows_what_the_stage_medians_leave_unexplained() -> None:
    stats = summarize_stages(_rows())
    remainder = median_remainder(stats)
    assert remainder == pytest.approx(stats["total"]["p50"] - sum(v["p50"] for k, v in stats.items() if k != "total"))
    assert abs(remainder) > 1.0  # medians do not add
    table = stage_table({"A": stats})
    row = next(line for line in table.splitlines() if line.startswith("unexplained by the p50s"))
    assert f"{remainder:.3f}" in row and "medians do not add" in table


def test_a_lagging_load_generator_marks_the_run_inconclusive() -> None:
    def step(label: str, phase: str, lag_s: float) -> Any:
        return types.SimpleNamespace(label=label, phase=phase, gen_lag={"p99": lag_s})

    steps = [step("A", "warm", 0.001), step("B", "warm", 0.030), step("B", "cold", 0.5), step("A", "cold", 0.5)]
    assert inconclusive_labels(steps, max_lag_ms=5.0) == {"B": pytest.approx(30.0)}
    stats = summarize_stages(_rows())
    table = stage_table({"A": stats, "B": stats}, {"B": 30.0})
    assert "B p50 (inconclusive)" in table and "A p50 (inconclusive)" not in table
    assert "INCONCLUSIVE B" in table and "30.0 ms" in table


def test_a_service_curve_that_speeds_up_with_the_batch_is_flagged() -> None:
    good = [ServicePoint(1, 0.010, 0.011, 9), ServicePoint(4, 0.012, 0.013, 9), ServicePoint(8, 0.0121, 0.013, 9)]
    assert curve_warnings(good) == []
    bad = [ServicePoint(1, 0.010, 0.011, 9), ServicePoint(4, 0.006, 0.013, 9), ServicePoint(8, 0.020, 0.03, 9)]
    (warning,) = curve_warnings(bad)
    assert "batch 4" in warning and "batch 1" in warning and "--repeats" in warning


@pytest.mark.parametrize(("cost", "text"), [
    (3.47222e-05, "34.72 per million chunks"),
    (0.00025, "0.250 per thousand chunks"),
    (2.5, "2.50 per chunk"),
    (float("inf"), "unbounded (no request qualified)"),
])
def test_costs_print_with_their_unit(cost: float, text: str) -> None:
    assert format_cost(cost) == text
    assert "e-" not in format_cost(cost)


@pytest.fixture()
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the plot functions draw (drawn, not written)."""
    drawn: list[Any] = []

    def keep(fig: Any, path: Path | str) -> Path:
        plots._plain_log_ticks(fig)
        fig.canvas.draw()
        drawn.append(fig)
        return Path(path)

    monkeypatch.setattr(plots, "_save", keep)
    return drawn


def _labels(axis: Any) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True) if t.get_text()]


def test_log_axes_read_as_plain_numbers_and_the_tail_shows_the_maximum(figures: list[Any], tmp_path: Path) -> None:
    latencies = [0.040 + 0.0005 * i for i in range(100)]  # 40 to 89.5 ms: inside one decade
    plots.plot_latency_cdf({"A": latencies}, tmp_path / "cdf.png")
    (fig,) = figures
    _, tail = fig.axes
    xs = [x for line in tail.get_lines() for x in line.get_xdata()]
    assert max(xs) == pytest.approx(89.5)  # the slowest request is on the tail panel
    labels = _labels(tail.xaxis) + _labels(tail.yaxis)
    assert labels and not any("10^" in t or "times" in t or "mathdefault" in t for t in labels), labels
    assert any(t == "60" for t in _labels(tail.xaxis)), _labels(tail.xaxis)


def test_latency_vs_load_says_which_side_measured(figures: list[Any], tmp_path: Path) -> None:
    steps = [{"label": "A", "offered_rate": r, "latency": {"p50": 0.01 * r, "p99": 0.02 * r},
              "server_latency": {"p50": 0.005 * r}} for r in (1.0, 2.0, 4.0)]
    plots.plot_latency_vs_load(steps, tmp_path / "lat.png")
    (fig,) = figures
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["A client-side p50", "A client-side p99", "A server-side p50"]
