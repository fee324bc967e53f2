"""``chunkline bench link``: observation-to-action latency over a shaped uplink, raw against JPEG
against adaptive, and what JPEG does to a vision policy's actions.

The server (a fixed-weight CNN) and the robot run in two network namespaces joined by a veth pair
rate-limited with ``tbf`` (the fault proxy's cap where namespaces cannot be made, said in the
output); observations are three 224x224x3 MuJoCo renders and a 14-d state (441 KiB raw). Per rate
the modes alternate in blocks (A B A B), each block closed-loop requests after uncounted warm-up
ones. Reported: p50/p99 observation to chunk, server CPU per request, bytes sent, the adaptive
choices, and the relative action deviation of a JPEG round trip per quality (``--deviation``: of
the policy a running server serves instead, see :mod:`.deviation`). Targets: at 25 Mbit/s
adaptive p50 >= 4x lower than raw; at 1 Gbit/s within 1.1x of raw."""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.bench.help_text import plain_help
from chunkline.bench.report import Column, ResultsDir, default_out, format_table
from chunkline.bench.serverproc import ServerProcess, cpu_times, stop_child
from chunkline.bench.stats import percentiles

from .deviation import QUALITIES, action_deviation, served_deviation
from .netns import Link, open_link
from .vision import VisionCNN, render_frames

__all__ = ["main", "action_deviation", "MODES"]

MODES = ("raw", "jpeg", "adaptive")
TARGET_GAIN_25, TARGET_RATIO_1000 = 4.0, 1.1


def _save_frames(observations: list[dict[str, np.ndarray]], path: Path) -> None:
    arrays: dict[str, Any] = {name: np.stack([o[name] for o in observations]) for name in observations[0]}
    np.savez(path, **arrays)


class _Robot:
    """The robot's process (:mod:`chunkline.bench.link.robot`) where the link puts it."""

    def __init__(self, link: Link, uri: str, frames: Path, budget_ms: float, jpeg_quality: int) -> None:
        cmd = [*link.client_prefix(), sys.executable, "-m", "chunkline.bench.link.robot", "--uri", uri, "--frames", str(frames),
               "--budget-ms", str(budget_ms), "--jpeg-quality", str(jpeg_quality)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, mode: str, n: int, warmup: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": "run", "mode": mode, "n": n, "warmup": warmup}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the robot process ended (exit {self.proc.wait(5)})")
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
        stop_child(self.proc, 10.0, ("terminate", "kill"))


def _summarise(rate: float, mode: str, samples: dict[str, list[Any]], cpu_s: float, count: int) -> dict[str, Any]:
    pct = percentiles(samples["latency_ms"], (50, 99))
    choices = collections.Counter(samples["encoding"])
    return {"rate_mbit": rate, "mode": mode, "n": len(samples["latency_ms"]), "p50_ms": pct["p50"], "p99_ms": pct["p99"],
            "cpu_ms_per_req": cpu_s * 1000.0 / max(count, 1), "kib_per_req": float(np.mean(samples["uplink_bytes"])) / 1024.0,
            "compress_ms": float(np.median(samples["compress_ms"])), "image_decode_ms": float(np.median(samples["image_decode_ms"])),
            "choices": dict(choices.most_common()), "choice": choices.most_common(1)[0][0] if choices else "",
            "quality": float(np.median(samples["jpeg_quality"])) if samples["jpeg_quality"] else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench link", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,25,50,100,1000", help="uplink rates in Mbit/s, comma-separated")
    parser.add_argument("--requests", type=int, default=30, help="counted requests per block")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted requests at the start of each block")
    parser.add_argument("--reps", type=int, default=2, help="blocks per mode and rate (A B A B)")
    parser.add_argument("--budget-ms", type=float, default=50.0, help="the adaptive mode's latency budget")
    parser.add_argument("--jpeg-quality", type=int, default=90, help="the jpeg mode's fixed quality")
    parser.add_argument("--frames", type=int, default=8, help="rendered observations cycled through")
    parser.add_argument("--link", choices=("auto", "netns", "proxy"), default="auto",
                        help="netns: namespaces + tbf (root); proxy: the fault proxy's cap; auto: netns if possible")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/link)")
    served = parser.add_argument_group("the action deviation of a served policy (--deviation)")
    served.add_argument("--deviation", action="store_true",
                        help="instead of the link: how far JPEG moves the actions of the model a running server serves")
    served.add_argument("--uri", default=None, help="that server (default: $CHUNKLINE_URI, else ws://127.0.0.1:8000)")
    served.add_argument("--api-key", default=None, help="its API key (default: $CHUNKLINE_API_KEY)")
    served.add_argument("--model", default=None, help="the model (default: the server's default)")
    served.add_argument("--qualities", default=",".join(map(str, QUALITIES)), help="JPEG qualities, comma-separated")
    args = parser.parse_args(argv)
    if args.deviation:
        qualities = tuple(int(q) for q in args.qualities.split(",") if q.strip().isdigit())
        if not qualities or len(qualities) != len(args.qualities.split(",")) or not all(1 <= q <= 100 for q in qualities):
            parser.error("--qualities: JPEG qualities 1..100")
        return served_deviation(args.uri, args.api_key, args.model, args.frames, qualities,
                                ResultsDir(args.out or default_out("link"), "link"))
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates) or not (1 <= args.requests <= 10_000) or not (1 <= args.reps <= 10):
        parser.error("rates must be positive; requests 1..10000; reps 1..10")
    out = ResultsDir(args.out or default_out("link"), "link")

    print("rendering MuJoCo frames ...", flush=True)
    observations = render_frames(args.frames)
    deviation = action_deviation(VisionCNN(), observations)

    link, why = open_link(("netns", "proxy") if args.link == "auto" else (args.link,))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chunkline-link-") as tmp, link:
        frames = Path(tmp) / "frames.npz"
        _save_frames(observations, frames)
        server = ServerProcess(["--policy", "chunkline.bench.link.vision:vision_policy"], host=link.server_host,
                               prefix=link.server_prefix(), probe=link.probe)
        robot: _Robot | None = None
        try:
            server.start()
            assert server.proc is not None
            uri = link.client_uri(server.port)
            print(f"link: {link.kind}" + (f" (namespaces unavailable: {why})" if why else "") + f"; server {uri}", flush=True)
            robot = _Robot(link, uri, frames, args.budget_ms, args.jpeg_quality)
            for rate in rates:
                link.set_rate(rate)
                pooled: dict[str, dict[str, list[Any]]] = {m: collections.defaultdict(list) for m in MODES}
                cpu = dict.fromkeys(MODES, 0.0)
                for _ in range(args.reps):
                    for mode in MODES:
                        before = cpu_times(server.proc.pid)
                        result = robot.run(mode, args.requests, args.warmup)
                        after = cpu_times(server.proc.pid)
                        if before is not None and after is not None:
                            cpu[mode] += (after - before).total
                        for key, values in result.items():
                            pooled[mode][key].extend(values)
                for mode in MODES:
                    # CPU over the block's requests, warm-up included: the server served those too.
                    count = len(pooled[mode]["latency_ms"]) + args.warmup * args.reps
                    row = _summarise(rate, mode, pooled[mode], cpu[mode], count)
                    rows.append(row)
                    out.write("latency", row)
                print(f"  {rate:g} Mbit/s: " + ", ".join(f"{r['mode']} p50 {r['p50_ms']:.1f} ms" for r in rows[-3:]), flush=True)
        finally:
            if robot is not None:
                robot.close()
            server.stop()
    for row in deviation:
        out.write("deviation", row)
    return _report(rows, deviation, link.kind, args.budget_ms)


def _report(rows: list[dict[str, Any]], deviation: list[dict[str, Any]], link_kind: str, budget_ms: float) -> int:
    print()
    print(format_table(rows, [
        Column("Mbit/s", "rate_mbit", "g"), Column("mode", "mode", align="<"), Column("n", "n"),
        Column("p50 ms", "p50_ms", ".1f"), Column("p99 ms", "p99_ms", ".1f"), Column("KiB/req", "kib_per_req", ".0f"),
        Column("compress ms", "compress_ms", ".2f"), Column("img decode ms", "image_decode_ms", ".2f"),
        Column("server CPU ms/req", "cpu_ms_per_req", ".2f"), Column("choice (most)", "choice", align="<"),
    ], title=f"observation-to-action latency over a shaped uplink ({link_kind}; adaptive budget {budget_ms:g} ms)"))
    print()
    print(format_table(deviation, [
        Column("jpeg quality", "quality"), Column("bytes/camera", "bytes", ".0f"), Column("rel. deviation p50", "rel_median", ".4f"),
        Column("rel. deviation max", "rel_max", ".4f"), Column("mean |da|", "abs_mean", ".5f"),
    ], title="action deviation of the vision policy (fixed-weight CNN), jpeg vs raw, on MuJoCo renders"))
    by = {(r["rate_mbit"], r["mode"]): r for r in rows}
    dev = {d["quality"]: d for d in deviation}
    ok = True
    print()
    if (25.0, "raw") in by and (25.0, "adaptive") in by:
        raw, ada = by[(25.0, "raw")], by[(25.0, "adaptive")]
        gain = raw["p50_ms"] / ada["p50_ms"]
        quality = int(ada["quality"])
        d = dev.get(quality)
        shown = f"deviation at q{quality}: {d['rel_median']:.4f} p50, {d['rel_max']:.4f} max" if d else f"chose {ada['choice']}"
        ok &= gain >= TARGET_GAIN_25
        verdict = "met" if gain >= TARGET_GAIN_25 else "MISSED"
        print(f"target 25 Mbit/s: raw p50 / adaptive p50 = {gain:.2f}x (>= {TARGET_GAIN_25:g}x: {verdict}); "
              f"adaptive chose {ada['choices']}; {shown}")
    if (1000.0, "raw") in by and (1000.0, "adaptive") in by:
        ratio = by[(1000.0, "adaptive")]["p50_ms"] / by[(1000.0, "raw")]["p50_ms"]
        ok &= ratio <= TARGET_RATIO_1000
        print(f"target 1000 Mbit/s: adaptive p50 / raw p50 = {ratio:.2f}x (<= {TARGET_RATIO_1000:g}x: "
              f"{'met' if ratio <= TARGET_RATIO_1000 else 'MISSED'}); adaptive chose {by[(1000.0, 'adaptive')]['choices']}")
    return 0 if ok else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)")
    raise SystemExit(code)
