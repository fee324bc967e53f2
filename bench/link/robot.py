"""The robot's process of ``chunkline bench link``: runs where the link puts it (inside the client
namespace), sends observations one after the other and reports what each took.

Commands arrive as JSON lines on stdin, answers leave as JSON lines on stdout:
``{"op": "run", "mode": "raw"|"jpeg"|"adaptive", "n": 30, "warmup": 3}`` runs ``warmup``
uncounted requests then ``n`` counted ones (at most ``--phase-max-s`` seconds) on that mode's
own connection (kept across phases: the adaptive mode keeps what it learned, as a robot would);
``{"op": "quit"}`` ends it. Every loop is bounded by a count and a time.

Run: ``python -m chunkline.bench.link.robot --uri ws://... --frames frames.npz``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from chunkline.client import Client
from chunkline.client.compression import Compression

__all__ = ["main", "run_phase"]


def _observations(path: str) -> list[dict[str, Any]]:
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    count = len(arrays["state"])
    return [{name: np.ascontiguousarray(arr[i]) for name, arr in arrays.items()} for i in range(count)]


def run_phase(client: Client, observations: list[dict[str, Any]], n: int, warmup: int, max_s: float) -> dict[str, Any]:
    """``warmup`` uncounted then ``n`` counted requests, one after the other (the next
    observation is taken when the previous action arrives); stops early after ``max_s``."""
    out: dict[str, list[Any]] = {key: [] for key in ("latency_ms", "encoding", "compress_ms", "uplink_bytes", "server_ms",
                                                      "image_decode_ms", "jpeg_quality")}
    give_up = time.monotonic() + max_s
    for i in range(warmup + n):
        if time.monotonic() > give_up:
            break
        obs = observations[i % len(observations)]
        taken = time.perf_counter()  # the observation is taken: the latency counts from here
        chunk = client.infer(obs, obs_time=time.monotonic(), timeout=30.0)
        latency = time.perf_counter() - taken
        if i < warmup:
            continue
        ct = chunk.client_timing
        out["latency_ms"].append(latency * 1000.0)
        out["encoding"].append(chunk.encoding)
        out["compress_ms"].append(ct.get("compress_ms", 0.0))
        out["uplink_bytes"].append(ct.get("uplink_bytes", 0.0))
        out["jpeg_quality"].append(ct.get("jpeg_quality", 0.0))
        out["server_ms"].append(chunk.timing.get("server_ms", 0.0))
        out["image_decode_ms"].append(chunk.timing.get("image_decode_ms", 0.0))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkline.bench.link.robot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", required=True, help="the server (through the shaped link)")
    parser.add_argument("--frames", required=True, help=".npz of observations (one array per field, first axis the observation)")
    parser.add_argument("--budget-ms", type=float, default=50.0, help="the adaptive mode's latency budget")
    parser.add_argument("--jpeg-quality", type=int, default=90, help="the jpeg mode's quality")
    parser.add_argument("--phase-max-s", type=float, default=120.0, help="longest one phase may run")
    args = parser.parse_args(argv)
    observations = _observations(args.frames)
    settings = {"raw": Compression(), "jpeg": Compression(mode="jpeg", quality=args.jpeg_quality),
                "adaptive": Compression(mode="adaptive", latency_budget_ms=args.budget_ms)}
    clients: dict[str, Client] = {}
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("op") == "quit":
                break
            mode = command["mode"]
            client = clients.get(mode)
            if client is None:
                client = clients[mode] = Client.connect(args.uri, compression=settings[mode], connect_timeout=60.0)
            result = run_phase(client, observations, int(command["n"]), int(command.get("warmup", 0)), args.phase_max_s)
            print(json.dumps(result), flush=True)
    finally:
        for client in clients.values():
            client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
