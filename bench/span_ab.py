"""A change to the server's request path, measured inside one server process.

Two processes of the same code differ in what a request costs them (memory layout, hash tables)
by as much as most changes do. Here the change (a *variant*, Python run in the server before it
serves, which finds ``FLAG`` in its globals and takes the variant while ``FLAG[0]`` is true) is
switched by a signal between blocks of single-connection round trips, and the server stamps each
request's span (first read of its frame to the start of its reply's write) with the flag: the same
process serves both arms. The request is the overhead suite's (ALOHA-sized, no-op, native mode).

    chunkline bench span-ab --variant FILE [--processes 2] [--blocks 40] [--per-block 100]
    chunkline bench span-ab --variant null           # the code against itself: the noise floor

Prints the span's median per arm (pooled and per process) and the round trip; writes results.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from websockets.typing import Subprotocol

from chunkline.bench.help_text import plain_help
from chunkline.client.wire.codec import Encoder
from chunkline.client.wire.protocol import SUBPROTOCOL

from .overhead import _SERVE_ARGS, SERVER_ENV, Target, _round_trips, robot_request, run_on_uvloop
from .report import ResultsDir, default_out
from .serverproc import ServerProcess, signal_for_file

__all__ = ["main"]

#: The server under the probe: ``python -c THIS LOG VARIANT python -m chunkline.server serve ARGS``
#: (the ``prefix`` of :class:`ServerProcess`). SIGUSR2 switches the variant; SIGUSR1 writes the
#: spans so far, ``[flag, seconds]`` pairs, to ``LOG.K`` (K = 0, 1, ...) and starts afresh.
_SPAN_SERVE = """
import json, os, signal, sys, time
from chunkline.server.entrypoints import connection
from chunkline.server.entrypoints.cli import main as serve
log_path, variant, sys.argv = sys.argv[1], sys.argv[2], ["chunkline.server", *sys.argv[6:]]
FLAG, spans, first_read, dumps = [False], [], [None], [0]
clock = time.perf_counter
read = connection.BudgetedConnection.buffer_updated
def buffer_updated(self, nbytes):
    if first_read[0] is None:
        first_read[0] = clock()
    read(self, nbytes)
connection.BudgetedConnection.buffer_updated = buffer_updated
write = connection.BudgetedConnection.send_now
def send_now(self, data):
    if first_read[0] is not None:
        spans.append((FLAG[0], clock() - first_read[0]))
        first_read[0] = None
    return write(self, data)
connection.BudgetedConnection.send_now = send_now
def toggle(*_):
    FLAG[0] = not FLAG[0]
def dump(*_):
    path = f"{log_path}.{dumps[0]}"
    with open(path + ".tmp", "w") as f:
        json.dump(spans, f)
    os.replace(path + ".tmp", path)  # the reader sees whole files only
    spans.clear()
    dumps[0] += 1
signal.signal(signal.SIGUSR2, toggle)
signal.signal(signal.SIGUSR1, dump)
if variant != "null":
    with open(variant) as f:
        exec(compile(f.read(), variant, "exec"), {"FLAG": FLAG, "__name__": "variant"})
sys.exit(serve())
"""

def _spans(server: ServerProcess, log: str, k: int) -> list[tuple[bool, float]]:
    """Ask the server for its spans so far (dump ``k``)."""
    path = signal_for_file(server, signal.SIGUSR1, Path(f"{log}.{k}"), "spans")
    return [(bool(flag), float(s)) for flag, s in json.loads(path.read_text())]


def _one_process(variant: str, blocks: int, per_block: int, warmup: int, request: bytes,
                 tmp: Path, index: int) -> tuple[list[tuple[bool, float]], dict[bool, list[float]]]:
    log = str(tmp / f"spans{index}")
    prefix = [sys.executable, "-c", _SPAN_SERVE, log, variant]
    round_trips: dict[bool, list[float]] = {False: [], True: []}
    with ServerProcess(_SERVE_ARGS, prefix=prefix, env=SERVER_ENV) as server:
        assert server.proc is not None
        target = Target("native", server.uri, request, server.proc.pid, [Subprotocol(SUBPROTOCOL)], greeting=True)

        async def drive() -> None:
            ws = await target.open()
            await _round_trips(ws, request, warmup)
            flag = False
            for _ in range(blocks):
                round_trips[flag] += await _round_trips(ws, request, per_block)
                assert server.proc is not None
                server.proc.send_signal(signal.SIGUSR2)
                await asyncio.sleep(0.02)  # the server, idle, handles it before the next request's frame
                flag = not flag
            await ws.close()

        _spans(server, log, 0)  # nothing measured yet: starts the log afresh
        run_on_uvloop(drive())
        spans = _spans(server, log, 1)
    warm = len(spans) - blocks * per_block  # the warm-up's requests, if the first dump came before them
    return spans[max(0, warm):], round_trips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench span-ab", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", required=True, help="a Python file installing the variant behind FLAG[0], or 'null'")
    parser.add_argument("--processes", type=int, default=2, help="server processes, one after the other")
    parser.add_argument("--blocks", type=int, default=40, help="blocks per process, the arms alternating")
    parser.add_argument("--per-block", type=int, default=100, help="round trips per block")
    parser.add_argument("--warmup", type=int, default=300, help="round trips per process before measuring")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/span-ab)")
    args = parser.parse_args(argv)
    variant = args.variant if args.variant == "null" else str(Path(args.variant).resolve())
    if variant != "null" and not Path(variant).is_file():
        parser.error(f"--variant {args.variant}: no such file")

    request = Encoder().encode_oob({"type": "infer", "id": 1, "obs": robot_request(), "obs_time": 0.0, "deadline_ms": 1000.0})
    pooled: dict[bool, list[float]] = {False: [], True: []}
    rt: dict[bool, list[float]] = {False: [], True: []}
    per_process: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            spans, round_trips = _one_process(variant, args.blocks, args.per_block, args.warmup, request, Path(tmp), i)
            arms = {flag: [s for f, s in spans if f is flag] for flag in (False, True)}
            if not arms[False] or not arms[True]:
                raise SystemExit(f"process {i}: a request path that never reached the probe (spans: {len(spans)})")
            per_process.append(float(np.median(arms[True]) / np.median(arms[False])))
            for flag in (False, True):
                pooled[flag] += arms[flag]
                rt[flag] += round_trips[flag]
    off, on = (float(np.median(pooled[f])) for f in (False, True))
    rt_off, rt_on = (float(np.median(rt[f])) for f in (False, True))
    print(f"variant {args.variant}: {args.processes} processes x {args.blocks} blocks x {args.per_block} round trips")
    print(f"first read -> reply write, median: off {off * 1e6:.1f} us, on {on * 1e6:.1f} us, "
          f"on - off {(on - off) * 1e6:+.1f} us ({on / off:.3f}); per process {', '.join(f'{r:.3f}' for r in per_process)}")
    print(f"client round trip, median: off {rt_off * 1e6:.1f} us, on {rt_on * 1e6:.1f} us ({rt_on / rt_off:.3f})")
    result: dict[str, Any] = {
        "variant": args.variant, "processes": args.processes, "blocks": args.blocks, "per_block": args.per_block,
        "span_off_s": off, "span_on_s": on, "span_ratio": on / off, "span_ratio_per_process": per_process,
        "requests": {"off": len(pooled[False]), "on": len(pooled[True])},
        "round_trip_off_s": rt_off, "round_trip_on_s": rt_on,
    }
    out = ResultsDir(args.out or default_out("span-ab"), "span-ab")
    out.write("result", result)
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
