"""Robot-path overhead: chunkline (no-op policy) vs a bare ``websockets`` echo of the same bytes.

One client, ALOHA-sized requests (3 x 224x224x3 uint8 images + 14-d float32 state in, 50x14
float32 chunk out), the two servers measured in alternating blocks (A B A B ...) in one run, so
machine noise hits both alike. Also the codec against a memcpy of the same bytes.

    python -m chunkline.bench.overhead [--round-trips 2000] [--out results/overhead]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from websockets.sync.client import connect

from chunkline.client.codec import Encoder, decode
from chunkline.client.protocol import SUBPROTOCOL

from .serverproc import ServerProcess
from .stats import percentiles

__all__ = ["main", "robot_request", "measure_codec"]


def robot_request(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {f"images/{c}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
                           for c in ("cam_high", "cam_left_wrist", "cam_right_wrist")}
    obs["state"] = rng.standard_normal(14).astype(np.float32)
    return obs


def _round_trips(ws: Any, request: bytes, n: int) -> list[float]:
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
    parser = argparse.ArgumentParser(prog="chunkline bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=2000, help="measured round trips per server")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks per server")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.jsonl")
    args = parser.parse_args(argv)

    obs = robot_request()
    enc = Encoder()
    request = enc.encode({"type": "infer", "id": 1, "obs": obs, "obs_time": 0.0, "deadline_ms": 1000.0})
    print(f"request {len(request) / 1024:.1f} KiB; {args.round_trips} round trips per server in {args.blocks} alternating blocks")

    with tempfile.TemporaryDirectory() as tmp, ServerProcess(["--policy", "noop"]) as chunkline_server:
        ws_c = connect(chunkline_server.uri, subprotocols=[SUBPROTOCOL], compression=None, max_size=None)
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
            ws_e = connect(f"ws://127.0.0.1:{port_file.read_text()}", compression=None, max_size=None)
            _round_trips(ws_e, request, args.warmup)
            _round_trips(ws_c, request, args.warmup)
            samples: dict[str, list[float]] = {"echo": [], "chunkline": []}
            per = max(1, args.round_trips // args.blocks)
            for _ in range(args.blocks):
                samples["echo"] += _round_trips(ws_e, request, per)
                samples["chunkline"] += _round_trips(ws_c, request, per)
            ws_e.close()
            ws_c.close()
        finally:
            echo.terminate()
            echo.wait(10)

    rt = {k: percentiles(v) for k, v in samples.items()}
    codec = measure_codec(obs, args.round_trips, args.blocks)
    ratio50 = rt["chunkline"]["p50"] / rt["echo"]["p50"]
    ratio99 = rt["chunkline"]["p99"] / rt["echo"]["p99"]
    print("\nrobot-path round trip (ms)        p50      p95      p99")
    for name in ("echo", "chunkline"):
        p = rt[name]
        print(f"  {name:<28} {p['p50'] * 1e3:8.3f} {p['p95'] * 1e3:8.3f} {p['p99'] * 1e3:8.3f}")
    print(f"  ratio chunkline/echo         {ratio50:8.2f}x          {ratio99:8.2f}x   (target p50 <= 1.2x, p99 <= 1.5x)")
    print("\ncodec (us)                        p50      p99    p50 ratio to memcpy")
    for name in ("memcpy", "encode", "decode"):
        p = codec[name]
        print(f"  {name:<28} {p['p50'] * 1e6:8.1f} {p['p99'] * 1e6:8.1f}    {p['p50'] / codec['memcpy']['p50']:6.2f}x")
    print("  (target: encode and decode within 2x of memcpy)")
    result = {"suite": "overhead", "request_bytes": len(request), "reply_bytes": len(reply), "round_trip_s": rt,
              "ratio_p50": ratio50, "ratio_p99": ratio99, "codec_s": codec, "n": args.round_trips}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
