"""Robot-path overhead: chunkline (no-op policy) vs a bare ``websockets`` echo of the same bytes.

One client, ALOHA-sized requests (3 x 224x224x3 uint8 images + 14-d float32 state in, 50x14
float32 chunk out), the two servers measured in alternating blocks (A B A B ...) in one run, so
machine noise hits both alike. Also the codec against a memcpy of the same bytes.

    python -m chunkline.bench.overhead [--round-trips 2000] [--out results/overhead]

Writes ``results.jsonl`` (one ``result`` object: percentiles in seconds, the ratios),
``round_trip_cdf.png`` (both servers' round trips) and ``codec.png`` into the results folder.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from chunkline.bench.help_text import plain_help
from chunkline.client.codec import Encoder, decode
from chunkline.client.protocol import SUBPROTOCOL

from .report import Column, Progress, ResultsDir, default_out, format_table
from .serverproc import ServerProcess
from .stats import percentiles

__all__ = ["main", "robot_request", "round_trips", "measure_codec"]


def robot_request(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {f"images/{c}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
                           for c in ("cam_high", "cam_left_wrist", "cam_right_wrist")}
    obs["state"] = rng.standard_normal(14).astype(np.float32)
    return obs


def round_trips(ws: Any, request: bytes, n: int) -> list[float]:
    """Seconds of ``n`` send-and-receive round trips of ``request`` on the open connection ``ws``."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ws.send(request)
        ws.recv()
        out.append(time.perf_counter() - t)
    return out


def _timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure_codec(obs: dict[str, Any], n: int, blocks: int = 8) -> dict[str, dict[str, float]]:
    """Encode and decode of ``obs`` vs a memcpy (fresh buffer + copy) of the same bytes, alternating."""
    enc = Encoder()
    data = enc.encode(obs)
    raw = bytearray(data)
    samples: dict[str, list[float]] = {"memcpy": [], "encode": [], "decode": []}
    per = max(1, n // blocks)
    for _ in range(blocks):
        samples["memcpy"] += _timed(lambda: bytes(raw), per)
        samples["encode"] += _timed(lambda: enc.encode(obs), per)
        samples["memcpy"] += _timed(lambda: bytes(raw), per)
        samples["decode"] += _timed(lambda: decode(data), per)
    return {k: percentiles(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench overhead", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=2000, help="measured round trips per server")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks per server")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/overhead)")
    args = parser.parse_args(argv)

    obs = robot_request()
    enc = Encoder()
    request = enc.encode({"type": "infer", "id": 1, "obs": obs, "obs_time": 0.0, "deadline_ms": 1000.0})
    print(f"request {len(request) / 1024:.1f} KiB; {args.round_trips} round trips per server in {args.blocks} alternating blocks")

    with tempfile.TemporaryDirectory() as tmp, ServerProcess(["--policy", "noop"]) as chunkline_server:
        ws_c = connect(chunkline_server.uri, subprotocols=[Subprotocol(SUBPROTOCOL)], compression=None, max_size=None).__enter__()
        ws_c.recv()  # hello
        ws_c.send(request)
        reply = ws_c.recv()
        assert isinstance(reply, bytes) and decode(reply)["type"] == "chunk", "chunkline did not answer with a chunk"
        reply_file, port_file = Path(tmp) / "reply", Path(tmp) / "port"
        reply_file.write_bytes(reply)
        echo = subprocess.Popen([sys.executable, "-m", "chunkline.bench.echo_server", "--port-file", str(port_file),
                                 "--reply-file", str(reply_file)])
        try:
            give_up = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text()):
                if time.monotonic() > give_up or echo.poll() is not None:
                    raise RuntimeError("echo server did not start")
                time.sleep(0.02)
            ws_e = connect(f"ws://127.0.0.1:{port_file.read_text()}", compression=None, max_size=None).__enter__()
            round_trips(ws_e, request, args.warmup)
            round_trips(ws_c, request, args.warmup)
            samples: dict[str, list[float]] = {"echo": [], "chunkline": []}
            per = max(1, args.round_trips // args.blocks)
            progress = Progress(args.blocks, "alternating blocks")
            for _ in range(args.blocks):
                samples["echo"] += round_trips(ws_e, request, per)
                samples["chunkline"] += round_trips(ws_c, request, per)
                progress.update(advance=1)
            progress.close()
            ws_e.close()
            ws_c.close()
        finally:
            echo.terminate()
            echo.wait(10)

    rt = {k: percentiles(v) for k, v in samples.items()}
    codec = measure_codec(obs, args.round_trips, args.blocks)
    ratio50 = rt["chunkline"]["p50"] / rt["echo"]["p50"]
    ratio99 = rt["chunkline"]["p99"] / rt["echo"]["p99"]
    def ms(q: str, scale: float = 1e3) -> Any:
        return lambda row: row[1][q] * scale

    print()
    print(format_table(list(rt.items()), [Column("robot-path round trip (ms)", lambda row: row[0], align="<"),
                                          Column("p50", ms("p50"), ".3f"), Column("p95", ms("p95"), ".3f"),
                                          Column("p99", ms("p99"), ".3f")]))
    print(f"ratio chunkline/echo: p50 {ratio50:.2f}x, p99 {ratio99:.2f}x   (target p50 <= 1.2x, p99 <= 1.5x)")
    print()
    print(format_table(list(codec.items()), [Column("codec (us)", lambda row: row[0], align="<"),
                                             Column("p50", ms("p50", 1e6), ".1f"), Column("p99", ms("p99", 1e6), ".1f"),
                                             Column("p50 / memcpy", lambda row: row[1]["p50"] / codec["memcpy"]["p50"], ".2f")]))
    print("(target: encode and decode within 2x of memcpy)")
    result = {"suite": "overhead", "request_bytes": len(request), "reply_bytes": len(reply), "round_trip_s": rt,
              "ratio_p50": ratio50, "ratio_p99": ratio99, "codec_s": codec, "n": args.round_trips}
    out = ResultsDir(args.out or default_out("overhead"), "overhead")
    out.write("result", {k: v for k, v in result.items() if k != "suite"})
    from . import plots

    plots.plot_latency_cdf(samples, out.file("round_trip_cdf.png"), title="robot-path round trip (ALOHA-sized request)")
    plots.plot_bars({k: {q: v[q] for q in ("p50", "p99")} for k, v in codec.items()}, out.file("codec.png"),
                    title="codec vs memcpy of the same bytes", ylabel="us", scale=1e6)
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
