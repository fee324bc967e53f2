"""The broker benchmark runs end to end on a short setting and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chunkline.bench import broker_bench


def test_bench_smoke(tmp_path, capsys) -> None:
    assert broker_bench.main(["--ticks", "3000", "--sim-s", "10", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "Broker.tick cost" in printed and "Prefetch accuracy" in printed
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    cost = [r for r in rows if r["kind"] == "tick_cost"]
    assert len(cost) == 5 and all(r["p50_us"] > 0 for r in cost)
    pre = {(r["trace"], r["broker"]): r for r in rows if r["kind"] == "prefetch"}
    ours = pre[("50+-20 ms", "chunkline")]
    naive = pre[("50+-20 ms", "naive openpi-style")]
    assert ours["stale_fraction"] == 0.0 and ours["blocked_fraction"] == 0.0 and ours["commands_in_limits"]
    assert ours["valid_fraction"] > 0.95
    # Round trips of 30-70 ms at 50 Hz: every action the naive broker replays is late.
    assert naive["stale_fraction"] > 0.8 and naive["blocked_fraction"] > 0.05
    assert ours["tracking_error"] < naive["tracking_error"]


def test_naive_model_matches_openpi_semantics() -> None:
    # Constant 50 ms round trips: block 3 ticks (0, 20, 40 ms), then 25 steps each one
    # 60 ms late (the first runs at the 60 ms tick, due at 0).
    res = broker_bench.naive_openpi(np.full(100, 0.05), duration_s=2.8, action_horizon=25)
    assert res["ticks"] == 140 and res["requests"] == 5
    assert res["blocked_fraction"] == 15 / 140
    assert abs(res["max_age_ms"] - 60.0) < 1e-6 and res["stale_fraction"] == 125 / 140


def test_tick_cost_with_rtc_re_plans_once_per_execution_horizon_and_runs_the_policy() -> None:
    variants = {"replace": {"merge": "replace"}, "rtc": {"merge": "rtc"},
                "rtc-continuous": {"merge": "rtc", "rtc_min_replan_s": 0.0}}
    rows = {name: {r["what"]: r for r in broker_bench.tick_cost(3000, config=v, parts=False)} for name, v in variants.items()}
    asked = {m: r["tick (ticks issuing a request)"]["n"] for m, r in rows.items()}
    # 50 +- 20 ms round trips: rtc asks once per 0.1 s execution horizon (every 5 ticks); without
    # it as soon as each answer is in (every ~3 ticks); replace only when the 1 s plan runs short
    # (every ~47 ticks).
    assert asked["rtc-continuous"] > 900 > 620 > asked["rtc"] >= 580 > 100 > asked["replace"]
    assert rows["rtc"]["tick (all ticks)"]["requests_per_s"] == asked["rtc"] / (3000 * broker_bench.DT)
    # Every request answers (several may be in flight): the policy runs all along.
    assert rows["rtc"]["tick (all ticks)"]["policy_fraction"] > 0.99


def test_compare_alternates_rounds_and_reports_each_setting() -> None:
    a, b = broker_bench.parse_variant("rtc"), broker_bench.parse_variant("rtc, rtc_min_replan_s=0")
    assert b == {"merge": "rtc", "rtc_min_replan_s": 0}
    rows = broker_bench.compare_tick_cost([a, b], ticks=1000, rounds=2)
    by = {(r["variant"], r["what"]): r for r in rows}
    assert len(rows) == 6 and {r["rounds"] for r in rows} == {2}
    slow, fast = by[("rtc", "tick (all ticks)")], by[("rtc,rtc_min_replan_s=0", "tick (all ticks)")]
    assert slow["requests_per_s"] < fast["requests_per_s"]
    assert all(r["p99_min_us"] <= r["p99_us"] <= r["p99_max_us"] for r in rows)
    for bad in ("fastest", "rtc,rtc_min_replan_s=-1", "rtc,no_such_field=1", "rtc,rtc_min_replan_s"):
        with pytest.raises(ValueError):
            broker_bench.parse_variant(bad)


def test_the_cli_compares_in_one_run(tmp_path, capsys) -> None:
    assert broker_bench.main(["--ticks", "500", "--sim-s", "2", "--merge", "rtc", "--compare", "replace", "--rounds", "1",
                              "--out", str(tmp_path)]) == 0
    assert "alternating rounds" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["variant"] for r in rows if r["kind"] == "tick_compare"} == {"rtc", "replace"}


def test_baseline_src_times_another_checkouts_broker_in_its_own_processes(tmp_path) -> None:
    root = Path(broker_bench.__file__).resolve().parents[1]  # this checkout, standing in for another
    rows = broker_bench.baseline_tick_cost(root, "rtc", ticks=300, rounds=1)
    assert [r["variant"] for r in rows] == [f"rtc: {root} (baseline)"] * 3 + ["rtc: this checkout"] * 3
    assert all(r["n"] > 0 and r["p50_us"] > 0 for r in rows)
    with pytest.raises(ValueError, match="not a chunkline checkout"):
        broker_bench.baseline_tick_cost(tmp_path, "rtc", ticks=300, rounds=1)
