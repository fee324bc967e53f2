"""``--baseline-src``: a suite's baseline server runs another checkout's code, and the fleet suite
pairs its figures with this checkout's per robot count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import repo_paths

from chunkline.bench import fleet, overhead
from chunkline.bench.report import read_jsonl


def _step(label: str, robots: int, cpu: float, loop: float, p50: float, p99: float) -> dict:
    return {"label": label, "robots": robots, "server_ms_cpu_per_request": cpu, "server_loop_ms_cpu_per_request": loop,
            "latency": {"p50": p50, "p99": p99}}


def test_the_fleet_pairs_each_robot_count_both_configurations_ran() -> None:
    steps = [_step("new", 4, 2.0, 1.0, 0.010, 0.040), _step("base", 4, 4.0, 0.5, 0.020, 0.020),
             _step("new", 8, 1.0, 1.0, 0.010, 0.010)]  # the base stopped before 8 robots
    (four,) = fleet.paired_ratios(steps, "new", "base")
    assert four == {"robots": 4, "repeats": 1, "server_cpu_per_request": 0.5, "loop_cpu_per_request": 2.0, "p50": 0.5,
                    "p99": 2.0}
    # a count repeated: the medians over its repeats (an outlier step moves neither)
    steps += [_step("new", 4, 2.0, 1.0, 0.010, 0.040), _step("base", 4, 4.0, 0.5, 0.020, 0.020),
              _step("new", 4, 9.0, 9.0, 0.9, 0.9), _step("base", 4, 0.1, 0.1, 0.001, 0.001)]
    (four,) = fleet.paired_ratios(steps, "new", "base")
    assert four == {"robots": 4, "repeats": 3, "server_cpu_per_request": 0.5, "loop_cpu_per_request": 2.0, "p50": 0.5,
                    "p99": 2.0}


def test_the_baseline_env_puts_the_other_checkout_first(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for d in ("client", "server", "policies", "broker", "safety", "bench"):
        (src / d).mkdir(parents=True)
        (src / d / "__init__.py").write_text(f"WHERE = {str(src / d)!r}\n")
    env = {**os.environ, **overhead.baseline_env(src, tmp_path / "farm")}
    out = subprocess.run([sys.executable, "-c", "import chunkline.server as s; print(s.WHERE)"], capture_output=True,
                         text=True, env=env, check=True).stdout.strip()
    assert out == str(src / "server")


@pytest.mark.slow
def test_fleet_smoke_against_another_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # This checkout stands in for the other one: what is checked is the wiring, not a figure.
    rc = fleet.main(["--baseline-src", str(repo_paths.ROOT), "--policy", "noop", "--robots", "2", "--duration", "0.5",
                     "--warmup", "0.3", "--out", str(tmp_path)])
    assert rc == 0
    steps = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["kind"] == "step"]
    assert [s["label"] for s in steps] == ["new", f"base ({repo_paths.ROOT})"]
    (summary,) = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["kind"] == "summary"]
    assert [p["robots"] for p in summary["paired"]] == [2]
    assert f"new / base ({repo_paths.ROOT}) at 2 robots (median of 1): server cpu per request" in capsys.readouterr().out
