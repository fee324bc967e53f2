"""The delay-in-steps sweep: Wilson intervals, targets, the generated docs section, one real unit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from chunkline.bench.closedloop.steps_report import BEGIN, END, steps_table, steps_targets, update_page, wilson


def test_wilson_matches_known_intervals() -> None:
    lo, hi = wilson(180, 200)
    assert lo == pytest.approx(0.8506, abs=1e-3) and hi == pytest.approx(0.9342, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-3)
    assert wilson(10, 10)[1] == pytest.approx(1.0)
    assert all(math.isnan(x) for x in wilson(0, 0))


def _row(task: str, strategy: str, d: int, rate: float, *, policy: str = "expert", diverging: int = 0) -> dict[str, Any]:
    n = 200
    lo, hi = wilson(round(rate * n), n)
    return {"task": task, "policy": policy, "strategy": strategy, "steps": d, "delay_ms": 20.0 * d, "episodes": n,
            "success_rate": rate, "success_lo": lo, "success_hi": hi, "error_mm": 5.0, "diverging": diverging,
            "stale_per_episode": 0.0, "violations_per_episode": 0.0}


def test_targets_fail_on_a_diverging_episode_and_on_losing_to_index() -> None:
    rows = [_row("reach", "chunkline-rtc", 0, 1.0), _row("reach", "chunkline-rtc", 10, 0.95, diverging=1),
            _row("reach", "chunkline-rtc", 20, 0.1), _row("reach", "index", 20, 0.2), _row("reach", "index-filtered", 20, 0.0),
            _row("reach", "chunkline-rtc", 10, 0.80, policy="reach-flow")]
    strict, versus, learned = steps_targets(rows)
    assert [strict["passed"], versus["passed"], learned["passed"]] == [False, False, False]
    assert "d=10" in strict["value"] and "d=20" in versus["value"] and "80 [" in learned["value"]
    ok = steps_targets([_row("reach", "chunkline-rtc", 10, 0.95), _row("reach", "index", 10, 0.9),
                        _row("reach", "chunkline-rtc", 10, 0.90, policy="reach-flow")])
    assert all(c["passed"] for c in ok) and len(ok) == 3


def test_table_and_page_section(tmp_path: Path) -> None:
    rows = [_row("reach", "chunkline-rtc", 0, 1.0), _row("reach", "index", 0, 0.5)]
    table = steps_table(rows)
    assert "| reach | 0 | 0 | 100 [98-100] | 50 [43-57] |" in table
    page = tmp_path / "page.md"
    page.write_text(f"# title\n\nintro\n\n{BEGIN}\nold\n{END}\n\nrest\n")
    plot = tmp_path / "p.png"
    plot.write_bytes(b"png")
    update_page(page, f"{BEGIN}\nnew\n{END}", [plot])
    text = page.read_text()
    assert "old" not in text and "new" in text and text.endswith("rest\n") and text.startswith("# title")
    assert (tmp_path / "closed_loop" / "p.png").read_bytes() == b"png"


def test_a_unit_runs_the_given_seeds_and_its_records_report_again(tmp_path: Path) -> None:
    pytest.importorskip("mujoco")
    from chunkline.bench.closedloop.delay_steps import StepsPlan, Unit, from_results, run_unit, units
    from chunkline.bench.report import ResultsDir

    recs = run_unit(Unit("reach", "expert", "chunkline-rtc", 2, (7, 8), 1.0))
    assert [r["seed"] for r in recs] == [7, 8] and all(r["steps"] == 2 for r in recs)
    assert all(r["success"] and r["stale_actions"] == 0 for r in recs)
    out = ResultsDir(tmp_path, "steps")
    for r in recs:
        out.write("episode", r)  # reach has no scene change: its reaction time is NaN, null in JSON
    (row,) = from_results(out.results)
    assert row["episodes"] == 2 and row["success_rate"] == 1.0 and row["successes"] == 2 and math.isnan(row["reaction_s"])
    other = ResultsDir(tmp_path / "other", "steps")
    for r in [recs[1], {**recs[0], "seed": 9, "success": False}, {**recs[0], "steps": 4}]:
        other.write("episode", r)
    joined = {r["steps"]: r for r in from_results([out.results, other.results])}
    # seed 8 at d = 2 is in both files: counted once
    assert joined[2]["episodes"] == 3 and joined[2]["successes"] == 2 and joined[4]["episodes"] == 1
    plan = StepsPlan(tasks=("reach",), steps=(0, 4), seeds=(5, 6, 7), strategies=("index",), learned=None, workers=2)
    parts = list(units(plan, split=2))
    assert sorted(s for u in parts for s in u.seeds if u.steps == 4) == [5, 6, 7] and len(parts) == 4
