"""Every suite, run for real at tiny size against real server processes: its JSON lines and PNGs
exist and parse, and its counts add up. (No timing is asserted: the machine is shared.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import repo_paths

from chunkline.bench import breakdown, capacity, load, overhead, span_ab
from chunkline.bench.cli import SUITES
from chunkline.bench.cli import main as bench_main
from chunkline.bench.report import read_jsonl

PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow


def _pngs(folder: Path, *names: str) -> None:
    for name in names:
        assert (folder / name).read_bytes()[:8] == PNG, name


def _steps_match_requests(folder: Path) -> list[dict]:
    """Each step's offered count equals its per-request lines, and its outcomes add up."""
    steps = [r for r in read_jsonl(folder / "results.jsonl") if r["kind"] == "step"]
    lines = Counter((r["label"], r["phase"], r["rate"]) for r in read_jsonl(folder / "requests.jsonl"))
    assert steps
    for s in steps:
        assert s["offered"] == lines[(s["label"], s["phase"], s["rate"])]
        assert s["offered"] == s["completed"] + sum(s["refused"].values()) + sum(s["errors"].values())
        assert 0 <= s["good"] <= s["completed"] <= s["admitted"] <= s["sent"] <= s["offered"]
    return steps


def test_bench_help_lists_every_suite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in ("overhead", "breakdown", "load", "capacity"):
        assert name in SUITES and name in text


def test_span_ab_takes_the_variant_in_one_arm_only(tmp_path: Path) -> None:
    # A variant that sleeps 3 ms before each reply is written: its arm, and only its arm, is longer
    # by most of that (a lower bound with a millisecond to spare, not a timing: the toggle reaches
    # the server or it does not).
    variant = tmp_path / "slow.py"
    variant.write_text("import time\n"
                       "from chunkline.server.entrypoints import robot_native\n"
                       "_own = robot_native.result_timing\n"
                       "def slow(*a, **k):\n"
                       "    if FLAG[0]:\n"
                       "        time.sleep(0.003)\n"
                       "    return _own(*a, **k)\n"
                       "robot_native.result_timing = slow\n")
    out = tmp_path / "out"
    assert span_ab.main(["--variant", str(variant), "--processes", "1", "--blocks", "4", "--per-block", "10",
                         "--warmup", "10", "--out", str(out)]) == 0
    (result,) = read_jsonl(out / "results.jsonl")
    assert result["suite"] == "span-ab" and result["requests"] == {"off": 20, "on": 20}
    assert result["span_on_s"] - result["span_off_s"] >= 0.002


def test_overhead_smoke(tmp_path: Path) -> None:
    assert overhead.main(["--round-trips", "16", "--warmup", "4", "--blocks", "2", "--load-seconds", "0.4", "--connections", "2",
                          "--out", str(tmp_path)]) == 0
    (result,) = read_jsonl(tmp_path / "results.jsonl")
    assert result["suite"] == "overhead" and result["kind"] == "result"
    assert set(result["round_trip_s"]) == {"echo", "native", "openpi-compat"}
    assert all(result["load"][m]["requests"] > 0 and result["load"][m]["cpu_per_request_s"] > 0 for m in result["load"])
    assert all(len(result["load"][m]["block_p50_s"]) == len(result["load"][m]["block_cpu_per_request_s"]) == 2 for m in result["load"])
    median, least, greatest = overhead.block_spread(result["load"], "native", "block_cpu_per_request_s")
    assert 0 < least <= median <= greatest
    assert result["ratio_p50"] > 0 and result["request_bytes"] > 150_000
    assert {"receive (websockets reader)", "receive (server, own frame reader)"} <= set(result["codec_s"])
    _pngs(tmp_path, "round_trip_cdf.png", "codec.png")


def test_overhead_calls_counts_the_servers_python_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Short loads: the figure is a difference of two cProfile snapshots of the real server.
    monkeypatch.setattr(overhead, "_CALLS_WARMUP", 10)
    monkeypatch.setattr(overhead, "_CALLS_FIRST", 20)
    monkeypatch.setattr(overhead, "_CALLS_SECOND", 60)
    assert overhead.main(["--calls", "--calls-top", "3", "--connections", "2", "--out", str(tmp_path)]) == 0
    (result,) = read_jsonl(tmp_path / "results.jsonl")
    assert result["kind"] == "calls"
    calls = result["calls_per_request"]
    assert set(calls) == {"native", "openpi-compat"}
    # A request runs hundreds of Python calls (decode, checks, admission, websockets): a count
    # near zero means the snapshots did not see the requests.
    assert all(100 < c < 5000 for c in calls.values())


def test_overhead_baseline_farm_imports_the_other_checkout(tmp_path: Path) -> None:
    """The baseline server imports chunkline from the checkout named, not from the installed one."""
    import os
    import subprocess
    import sys

    src = tmp_path / "src"
    for d in ("client", "server", "policies", "broker", "safety", "bench"):
        (src / d).mkdir(parents=True)
        (src / d / "__init__.py").write_text(f"WHERE = {str(src / d)!r}\n")
    path = overhead.baseline_pythonpath(src, tmp_path / "farm")
    out = subprocess.run([sys.executable, "-c", "import chunkline.server as s; print(s.WHERE)"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, check=True).stdout.strip()
    assert out == str(src / "server")
    with pytest.raises(SystemExit, match="not a chunkline checkout"):
        overhead.baseline_pythonpath(tmp_path / "nowhere", tmp_path / "farm2")


def test_breakdown_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = breakdown.main(["--policy", "noop", "--rate", "20", "--duration", "0.5", "--cold-duration", "0.25",
                         "--out", str(tmp_path)])
    assert rc == 0
    steps = _steps_match_requests(tmp_path)
    assert [s["phase"] for s in steps] == ["cold", "warm"]
    stages = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["kind"] == "stages" and r["phase"] == "warm"]
    (warm,) = stages
    assert {"client_encode", "send", "server_decode", "queue_wait", "inference", "server_encode", "return",
            "client_decode", "handover", "total"} <= set(warm["stages"])
    assert warm["stages"]["total"]["n"] == steps[1]["completed"]
    _pngs(tmp_path, "stage_breakdown.png", "latency_cdf.png")
    assert "latency breakdown per stage" in capsys.readouterr().out


@pytest.mark.slow
def test_load_smoke_against_a_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = load.main(["--policy", "noop", "--baseline-args", "--policy sleep:0.001", "--baseline-label", "sleepy",
                    "--rates", "auto", "--min-rate", "10", "--max-rate", "20", "--arrival", "gamma",
                    "--duration", "0.5", "--robots", "2", "--repeats", "2", "--cold-duration", "0.25",
                    "--out", str(tmp_path)])
    assert rc == 0
    steps = _steps_match_requests(tmp_path)
    assert [(s["label"], s["phase"], s["rate"]) for s in steps] == [
        ("default", "cold", 10.0), ("sleepy", "cold", 10.0),
        ("default", "warm", 10.0), ("sleepy", "warm", 10.0),
        ("default", "warm", 20.0), ("sleepy", "warm", 20.0)]
    assert all(s["repeats"] == 2 for s in steps if s["phase"] == "warm")
    # Alternation: per warm rate, the per-request lines come in rounds A, B, A, B.
    order = [(r["label"], r["round"]) for r in read_jsonl(tmp_path / "requests.jsonl") if r["phase"] == "warm"
             and r["rate"] == 10.0]
    assert list(dict.fromkeys(order)) == [("default", 0), ("sleepy", 0), ("default", 1), ("sleepy", 1)]
    kinds = Counter(r["kind"] for r in read_jsonl(tmp_path / "results.jsonl"))
    assert kinds["config"] == 1 and kinds["sustained"] == 2
    _pngs(tmp_path, "latency_vs_load.png", "goodput_vs_load.png", "resources_vs_load.png", "latency_cdf.png")
    out = capsys.readouterr().out
    assert "comparison: default / sleepy" in out


def test_load_smoke_trace_replay_over_two_processes(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"t": 100.0 + 0.05 * i, "robot": f"r{i % 3}", "tenant": "acme"} for i in range(12)]
    rows.append({"t": 100.3, "robot": "r0", "class": "text", "prompt_len": 10, "output_len": 5})
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    rc = load.main(["--policy", "noop", "--arrival", "trace", "--trace", str(trace), "--workers", "2",
                    "--cold-duration", "0", "--out", str(out)])
    assert rc == 0
    (step,) = _steps_match_requests(out)
    assert step["offered"] == 13
    assert step["errors"] == {"unsupported": 1}  # the text row is counted, not sent
    assert step["sent"] == 12
    robots = {r["robot"] for r in read_jsonl(out / "requests.jsonl")}
    assert robots == {0, 1, 2}


def test_capacity_smoke(tmp_path: Path) -> None:
    rc = capacity.main(["--policy", "noop", "--robots", "4", "--rate-hz", "5", "--deadline-ms", "200",
                        "--batch-sizes", "1,2", "--repeats", "2", "--check-duration", "0.5",
                        "--price-per-device-hour", "1.0", "--max-extra-replicas", "0", "--out", str(tmp_path)])
    results = read_jsonl(tmp_path / "results.jsonl")
    points = [r for r in results if r["kind"] == "service_point"]
    assert [p["batch_size"] for p in points] == [1, 2]
    (result,) = [r for r in results if r["kind"] == "result"]
    assert result["replicas"] == result["lower_bound"] == 1
    assert result["qualified_fraction_measured"] is True
    checks = [r for r in results if r["kind"] == "check"]
    assert len(checks) == 1 and checks[0]["peak"]["rate"] == pytest.approx(30.0)
    assert rc == (0 if checks[0]["passed"] else 1)
    if result["qualified_fraction"] > 0:
        assert result["cost_per_qualified_result"] == pytest.approx(1.0 / (20 * 3600 * result["qualified_fraction"]))
    _steps_match_requests(tmp_path)
    _pngs(tmp_path, "service_curve.png", "check_latency_vs_load.png", "check_goodput_vs_load.png")
    assert "replicas: 1" in (tmp_path / "report.md").read_text()


def test_retry_storm_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chunkline.bench import retry_storm

    assert retry_storm.main(["--robots", "2", "--seconds", "0.6", "--blocks", "1", "--service-ms", "20", "--out", str(tmp_path)]) == 0
    (result,) = read_jsonl(tmp_path / "results.jsonl")
    assert result["suite"] == "retry" and set(result["tallies"]) == {"peak (1x)", "immediate", "honouring", "mixed: immediate",
                                                                     "mixed: honouring"}
    assert result["peak_goodput"] > 0 and all(t["sent"] > 0 for t in result["tallies"].values())
    assert result["tallies"]["peak (1x)"]["server"]["batches"] > 0  # read from the server's /metrics
    assert [c["target"].split(":")[0].split(" goodput")[0] for c in result["checks"]] == [
        "immediate", "honouring", "refusals cheap", "no starvation"]
    out = capsys.readouterr().out
    assert "target check (this server):" in out and "lane busy" in out and ("PASS" in out or "FAIL" in out)


def test_startup_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "startup.json"
    assert bench_main(["startup", "--policy", "noop", "--rounds", "1", "--max-batch-size", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    first, one = doc["runs"]["all sizes first"], doc["runs"]["batch 1 first"]
    assert len(first) == len(one) == 1
    assert first[0][1] == first[0][0], "all sizes first: every size is timed when ready"
    assert one[0][1] is not None and one[0][1] >= one[0][0], "batch 1 first: the rest are timed after ready"
    assert "time to ready, batch 1 first / all sizes first" in capsys.readouterr().out


def test_admission_smoke_against_a_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    # The baseline is this very checkout, run in the child process the option starts: every cell
    # has both figures and their ratio.
    root = repo_paths.ROOT
    assert bench_main(["admission", "--depths", "4", "16", "--offers", "20", "--rounds", "2",
                       "--baseline-src", str(root)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    cells = [row for row in lines if row and row[0] in ("4", "16")]
    assert len(cells) == 2 * 3
    for row in cells:
        assert float(row[-1]) > 0  # p50 new/base


def test_admission_cycle_smoke_against_a_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    # The same checkout on both sides: the Python calls per request, counted the same way over
    # the same deterministic cycles, are equal; the times are there and positive.
    root = repo_paths.ROOT
    assert bench_main(["admission", "--cycle", "--robots", "1", "3", "--batch", "2", "--cycles", "30", "--rounds", "2",
                       "--baseline-src", str(root)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    cells = [row for row in lines if len(row) == 10 and row[0] in ("1", "3")]
    assert [row[:2] for row in cells] == [["1", "2"], ["3", "2"]]
    for row in cells:
        us, calls, base_calls, calls_ratio = float(row[2]), float(row[4]), float(row[7]), float(row[9])
        assert us > 0 and calls > 20
        assert calls == base_calls and calls_ratio == 1.0
