"""Report plumbing: tables, progress lines, JSON lines, plots, server targets, sweep helpers."""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from chunkline.bench import plots
from chunkline.bench.load import auto_rates_done, build_parser, comparison_lines, parse_rates, sustained_rate
from chunkline.bench.records import OK, RequestRecord, summarize
from chunkline.bench.report import Column, Progress, ResultsDir, format_table, jsonable, read_jsonl
from chunkline.bench.resources import ProcessMonitor
from chunkline.bench.targets import Target, TargetError, add_target_arguments, alternation, targets_from_args


def test_table_aligns_and_shows_missing_values() -> None:
    rows = [{"name": "echo", "p50": 1.23456, "n": 10}, {"name": "chunkline", "p50": math.nan, "n": None}]
    text = format_table(rows, [Column("name", "name", align="<"), Column("p50", "p50", ".2f"), Column("n", "n")],
                        title="t")
    lines = text.splitlines()
    assert lines[0] == "t"
    assert lines[1].split() == ["name", "p50", "n"]
    assert lines[3].split() == ["echo", "1.23", "10"]
    assert lines[4].split() == ["chunkline", "n/a", "n/a"]
    assert len({len(line) for line in lines[1:4]}) == 1  # header, rule and full rows line up


def test_progress_lines_are_rate_limited_by_the_injected_clock() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress(10, "step", stream=out, interval=1.0, clock=lambda: now[0])
    p.update(1)
    p.update(2)  # same instant: no new line
    now[0] = 1.5
    p.update(5, extra="sent 5")
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 == p.lines
    assert "10.0%" in lines[0] and "1/10" in lines[0]
    assert "50.0%" in lines[1] and "eta" in lines[1] and lines[1].endswith("sent 5")
    assert "50.0%" in lines[2]
    unknown = Progress(0, "open", stream=io.StringIO(), clock=lambda: 0.0)
    unknown.update(3)
    assert "3 done" in unknown.render()


def test_jsonable_makes_strict_json() -> None:
    obj = {"a": np.float32(1.5), "b": np.int64(3), "c": math.nan, "d": (1, math.inf), "e": np.arange(2), "f": Path("x")}
    text = json.dumps(jsonable(obj), allow_nan=False)
    assert json.loads(text) == {"a": 1.5, "b": 3, "c": None, "d": [1, None], "e": [0, 1], "f": "x"}


def test_results_dir_writes_fresh_json_lines(tmp_path: Path) -> None:
    out = ResultsDir(tmp_path / "r", "demo")
    out.write("step", {"x": 1.0, "y": math.nan})
    out.write_requests([{"i": 1}, {"i": 2}])
    again = ResultsDir(tmp_path / "r", "demo")  # a new run starts a fresh file
    again.write("step", {"x": 2})
    assert read_jsonl(again.results) == [{"suite": "demo", "kind": "step", "x": 2}]
    assert not again.requests.exists()
    assert "results.jsonl" in again.listing()


def _steps() -> list:
    def step(label: str, rate: float, good: int, p99_ms: float) -> object:
        recs = [RequestRecord(scheduled=0, sent=0, robot=0, outcome=OK, latency_s=p99_ms / 1000, deadline_ms=100.0)
                for _ in range(good)]
        recs += [RequestRecord(scheduled=0, sent=0, robot=0, outcome="overloaded", latency_s=0.001)] * (100 - good)
        return summarize(recs, duration=100 / rate, label=label, rate=rate)

    return [step("A", 10, 100, 20), step("A", 20, 100, 40), step("A", 40, 70, 90),
            step("B", 10, 100, 30), step("B", 20, 95, 60), step("B", 40, 40, 99)]


def test_sweep_helpers() -> None:
    assert parse_rates("5, 10,20") == [5.0, 10.0, 20.0]
    assert parse_rates("auto") is None
    for bad in ("", "x", "0", "-5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    steps = _steps()
    assert sustained_rate([s for s in steps if s.label == "A"], 100.0) == pytest.approx(20.0)
    assert sustained_rate([s for s in steps if s.label == "A"], 30.0) == pytest.approx(10.0)
    assert sustained_rate([s for s in steps if s.label == "B"], 100.0) == pytest.approx(10.0)
    assert not auto_rates_done([steps[2], steps[4]], 40.0, 1000.0)  # B at 95 % is not saturated
    assert auto_rates_done([steps[2], steps[5]], 40.0, 1000.0)  # both below 80 %
    assert auto_rates_done([steps[0]], 600.0, 1000.0)  # the next rate would pass the maximum
    lines = comparison_lines(steps, ["A", "B"], 100.0)
    assert "goodput x1.00" in lines[1] and lines[-2].endswith("x2.00")
    assert "peak goodput" in lines[-1] and "% of peak" in lines[-1]


def test_plots_write_pngs(tmp_path: Path) -> None:
    rows = [s.as_dict() for s in _steps()]
    paths = [
        plots.plot_latency_vs_load(rows, tmp_path / "a.png", deadline_ms=100.0),
        plots.plot_goodput_vs_load(rows, tmp_path / "b.png"),
        plots.plot_resources_vs_load(rows, tmp_path / "c.png"),
        plots.plot_latency_cdf({"A": [0.001, 0.002, 0.01], "empty": []}, tmp_path / "d.png", deadline_ms=5.0),
        plots.plot_stage_breakdown({"A": {"inference": {"p50": 1.0, "p99": 2.0, "mean": 1.1},
                                          "return": {"p50": -0.1, "p99": 0.5, "mean": 0.2}}}, tmp_path / "e.png"),
        plots.plot_service_curve([{"batch_size": 1, "seconds": 0.006, "p90": 0.007},
                                  {"batch_size": 8, "seconds": 0.01, "p90": 0.012}], tmp_path / "f.png", chosen=8,
                                 deadline_ms=50.0),
        plots.plot_bars({"encode": {"p50": 1e-5, "p99": 2e-5}}, tmp_path / "g.png", title="t", ylabel="us", scale=1e6),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _target_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_target_arguments(parser, default_policy="noop")
    return parser.parse_args(argv)


def test_targets_and_alternation() -> None:
    ts = targets_from_args(_target_args(["--server-args", "--max-batch-size 16", "--baseline-args", "--max-batch-size 1"]))
    assert ts == [Target("--max-batch-size 16", ("--policy", "noop", "--max-batch-size", "16")),
                  Target("--max-batch-size 1", ("--policy", "noop", "--max-batch-size", "1"))]
    own = targets_from_args(_target_args(["--baseline-args", "--policy sleep:0.01", "--baseline-label", "slow"]))
    assert own[0].server_args == ("--policy", "noop") and own[0].label == "default"
    assert own[1].server_args == ("--policy", "sleep:0.01") and own[1].label == "slow"
    remote = targets_from_args(_target_args(["--uri", "ws://127.0.0.1:1", "--server-pid", "12"]))
    assert remote == [Target("server", None, "ws://127.0.0.1:1", 12)]
    with pytest.raises(TargetError):
        targets_from_args(_target_args(["--uri", "ws://x", "--server-args", "--port 1"]))
    with pytest.raises(TargetError):
        targets_from_args(_target_args(["--label", "x", "--baseline-args", "", "--baseline-label", "x"]))
    same = targets_from_args(_target_args(["--baseline-args", ""]))  # the same server twice: an A/A run
    assert [t.label for t in same] == ["default", "baseline"]
    assert alternation(["A", "B"], 2) == [(0, "A"), (0, "B"), (1, "A"), (1, "B")]
    with pytest.raises(ValueError):
        alternation(["A"], 0)


def test_load_parser_distinguishes_auto_from_unset() -> None:
    assert not hasattr(build_parser().parse_args([]), "rates")
    assert build_parser().parse_args(["--rates", "auto"]).rates is None


def test_monitor_without_a_process_reports_nan() -> None:
    m = ProcessMonitor(None)
    m.start()
    m.sample()
    usage = m.stop()
    assert not m.available
    assert math.isnan(usage.cpu_percent) and math.isnan(usage.rss_mb)


def test_monitor_measures_this_process() -> None:
    import os

    now = [100.0]
    m = ProcessMonitor(os.getpid(), clock=lambda: now[0])
    if not m.available:
        pytest.skip("psutil is not installed")
    m.start()
    sum(i * i for i in range(200_000))  # some CPU time
    now[0] += 10.0
    usage = m.stop()
    assert usage.rss_mb > 1.0
    assert 0.0 <= usage.cpu_percent < 100.0
