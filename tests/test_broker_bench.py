"""The broker benchmark runs end to end on a short setting and writes its results."""

from __future__ import annotations

import json

import numpy as np

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


def test_tick_cost_with_rtc_re_plans_once_per_round_trip_and_runs_the_policy() -> None:
    rows = {merge: {r["what"]: r for r in broker_bench.tick_cost(3000, merge=merge)} for merge in ("replace", "rtc")}
    asked = {m: r["tick (ticks issuing a request)"]["n"] for m, r in rows.items()}
    # 50 +- 20 ms round trips: rtc asks again as soon as each answer is in (every ~3 ticks);
    # replace only when the 1 s plan runs short (every ~47 ticks).
    assert asked["rtc"] > 600 > 100 > asked["replace"]
    # Every request answers (several may be in flight): the policy runs all along.
    assert rows["rtc"]["tick (all ticks)"]["policy_fraction"] > 0.99
