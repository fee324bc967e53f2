"""Retry storms: goodput when robots retry refused requests at once, against robots that wait
the ``retry_after_ms`` the server gives.

A slow policy (``sleep:<service>`` with one request per batch, so its capacity is known:
``1 / service`` requests per second) is offered ``--overload`` times that capacity by
``--robots`` robots, each wanting one chunk per period with a deadline. A refused request is
retried within the same period:

- **immediate**: at once, ignoring the retry hint (what a naive client does; every retry uploads
  its ALOHA-sized observation again);
- **honouring**: after ``retry_after_ms`` (what chunkline's clients and broker do).

Each block also runs at 1x capacity first, to measure the peak goodput in the same run. The
behaviours alternate (peak, immediate, honouring, peak, ...) so machine noise hits all alike.
Goodput counts chunks that arrived within their deadline. A session the server closes for
ignoring retry hints (1013) reconnects, as a robot would.

    chunkline bench retry [--robots 8] [--service-ms 50] [--overload 2] [--seconds 4] [--blocks 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from chunkline.client.codec import Encoder, decode
from chunkline.client.protocol import SUBPROTOCOL

from .overhead import robot_request, run_on_uvloop
from .report import Column, Progress, ResultsDir, default_out, format_table
from .serverproc import ServerProcess, cpu_times

__all__ = ["main"]


@dataclass
class Tally:
    """What one behaviour got in one block."""

    sent: int = 0
    good: int = 0
    late: int = 0
    refused: int = 0
    closed: int = 0
    seconds: float = 0.0
    server_cpu_s: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        for name in ("sent", "good", "late", "refused", "closed", "seconds", "server_cpu_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for code, n in other.codes.items():
            self.codes[code] = self.codes.get(code, 0) + n


class Robot:
    """One robot: a chunk per period, refused requests retried within the period."""

    def __init__(self, uri: str, obs_bytes: Any, period: float, deadline_ms: float, honour: bool) -> None:
        self.uri, self.period, self.deadline_ms, self.honour = uri, period, deadline_ms, honour
        self.encoder = Encoder()
        self.obs = obs_bytes
        self.ids = 0
        self.ws: ClientConnection | None = None

    async def _connection(self) -> ClientConnection:
        if self.ws is None:
            self.ws = await connect(self.uri, subprotocols=[Subprotocol(SUBPROTOCOL)], compression=None, max_size=None)
            await self.ws.recv(decode=False)  # hello
        return self.ws

    async def run(self, start: float, stop: float, tally: Tally) -> None:
        slot = start
        while slot + self.period <= stop:
            await asyncio.sleep(max(0.0, slot - time.perf_counter()))
            end = slot + self.period
            while time.perf_counter() < end:
                self.ids += 1
                frame = self.encoder.encode({"type": "infer", "id": self.ids, "obs": self.obs, "deadline_ms": self.deadline_ms})
                sent = time.perf_counter()
                try:
                    ws = await self._connection()
                    await ws.send(frame)
                    reply = decode(await ws.recv(decode=False))
                except (ConnectionClosed, OSError):
                    self.ws = None
                    tally.closed += 1
                    continue
                tally.sent += 1
                if reply.get("type") == "chunk":
                    in_time = (time.perf_counter() - sent) * 1000.0 <= self.deadline_ms and not reply.get("late")
                    tally.good += in_time
                    tally.late += not in_time
                    break
                tally.refused += 1
                code = str(reply.get("code"))
                tally.codes[code] = tally.codes.get(code, 0) + 1
                retry = reply.get("retry_after_ms")
                if self.honour and retry is not None:
                    await asyncio.sleep(min(float(retry) / 1000.0, max(0.0, end - time.perf_counter())))
            slot = end

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


async def _block(uri: str, pid: int, robots: int, period: float, deadline_ms: float, honour: bool, seconds: float,
                 obs: Any) -> Tally:
    fleet = [Robot(uri, obs, period, deadline_ms, honour) for _ in range(robots)]
    tally = Tally(seconds=seconds)
    before = cpu_times(pid)
    start = time.perf_counter() + 0.05
    # robots staggered evenly across the period
    await asyncio.gather(*(r.run(start + i * period / robots, start + seconds, tally) for i, r in enumerate(fleet)))
    after = cpu_times(pid)
    if before is not None and after is not None:
        tally.server_cpu_s = after.total - before.total
    await asyncio.gather(*(r.close() for r in fleet))
    return tally


async def _measure(uri: str, pid: int, args: argparse.Namespace) -> dict[str, Tally]:
    encoder = Encoder()
    obs = encoder.preencode(robot_request())
    capacity = 1000.0 / args.service_ms
    out = {name: Tally() for name in ("peak (1x)", "immediate", "honouring")}
    progress = Progress(args.blocks, "alternating blocks")
    for _ in range(args.blocks):
        # 1x capacity: the peak goodput this policy allows, in this run.
        out["peak (1x)"].add(await _block(uri, pid, args.robots, args.robots / capacity, args.deadline_ms, True, args.seconds, obs))
        period = args.robots / (capacity * args.overload)
        for name, honour in (("immediate", False), ("honouring", True)):
            out[name].add(await _block(uri, pid, args.robots, period, args.deadline_ms, honour, args.seconds, obs))
        progress.update(advance=1)
    progress.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench retry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", type=int, default=8, help="robots (one connection each)")
    parser.add_argument("--service-ms", type=float, default=50.0, help="the slow policy's time per request")
    parser.add_argument("--overload", type=float, default=2.0, help="offered load as a multiple of capacity")
    parser.add_argument("--deadline-ms", type=float, default=150.0, help="each request's deadline budget")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per block and behaviour")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/retry)")
    args = parser.parse_args(argv)

    server_args = ["--policy", f"sleep:{args.service_ms / 1000.0:g}", "--max-batch-size", "1", "--no-ledger",
                   "--max-connections-per-address", str(max(64, 4 * args.robots))]
    with ServerProcess(server_args) as server:
        assert server.proc is not None
        tallies = run_on_uvloop(_measure(server.uri, server.proc.pid, args))

    peak = tallies["peak (1x)"].good / max(tallies["peak (1x)"].seconds, 1e-9)
    rows = [(name, t) for name, t in tallies.items()]
    print()
    print(format_table(rows, [
        Column("behaviour", lambda r: r[0], align="<"),
        Column("goodput/s", lambda r: r[1].good / max(r[1].seconds, 1e-9), ".1f"),
        Column("of peak", lambda r: r[1].good / max(r[1].seconds, 1e-9) / peak if peak else float("nan"), ".2f"),
        Column("sent/s", lambda r: r[1].sent / max(r[1].seconds, 1e-9), ".1f"),
        Column("refused/s", lambda r: r[1].refused / max(r[1].seconds, 1e-9), ".1f"),
        Column("late", lambda r: r[1].late, "d"),
        Column("closed", lambda r: r[1].closed, "d"),
        Column("server cpu ms/answer", lambda r: 1e3 * r[1].server_cpu_s / max(r[1].sent, 1), ".2f"),
    ]))
    print(f"{args.robots} robots at {args.overload:g}x the capacity of a {args.service_ms:g} ms policy "
          f"({1000.0 / args.service_ms:.0f}/s); target: goodput >= 90% of peak with immediate retries")
    out = ResultsDir(args.out or default_out("retry"), "retry")
    out.write("result", {"peak_goodput": peak, "args": {k: v for k, v in vars(args).items() if k != "out"},
                         "tallies": {name: vars(t) for name, t in tallies.items()}})
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
