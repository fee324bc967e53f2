"""Retry storms: goodput when robots retry refused requests at once, against robots that wait the
``retry_after_ms`` the server gives.

A ``sleep:<service>`` policy with one request per batch (capacity ``1 / service``) is offered
``--overload`` times its capacity. Blocks alternate: the peak (1x, measured in the same run),
**immediate** (retry at once), **honouring** (not before ``retry_after_ms``) and **mixed** (half
of each: a storm must not starve the robots that wait). Goodput counts chunks in time on the
robot's own clock; each robot leaves its own transport out of the budget it sends, since the
server counts ``deadline_ms`` from receipt. Targets: goodput >= 90 % of the peak for both
behaviours; a refusal <= 25 % of a served request's CPU; honouring robots >= 80 % of the
immediate ones' per-robot goodput. ``--baseline-src DIR`` runs every block against another
checkout too."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http.client
import math
import os
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.server.entrypoints.sessions import SENT_EARLY

from .overhead import baseline_pythonpath, robot_request, run_on_uvloop
from .report import Column, Progress, ResultsDir, default_out, format_table
from .serverproc import ServerProcess, cpu_times, http_get

__all__ = ["main", "Tally", "ServerCounts", "scrape_counts", "check_targets"]

#: What the door's answer to a request sent inside its session's retry window says.
DOOR_MARK = SENT_EARLY

#: Targets (see the module's docstring).
GOODPUT_TARGET = 0.9
CHEAP_REFUSAL = 0.25
NO_STARVATION = 0.8

#: Chunks whose transport times a robot keeps, to budget for the trip.
_TRANSPORT_WINDOW = 20

#: Refusals that a wait can cure, which should carry a retry time.
_CURABLE = frozenset({"overloaded", "deadline_unmeetable", "quota_exceeded"})

BEHAVIOURS = ("peak (1x)", "immediate", "honouring", "mixed: immediate", "mixed: honouring")


@dataclass
class ServerCounts:
    """What the server's ``/metrics`` says about the policy class (cumulative, or a difference)."""

    batches: float = 0.0
    infer_s: float = 0.0
    infer_n: float = 0.0
    outcomes: dict[str, float] = field(default_factory=dict)

    def __sub__(self, other: ServerCounts) -> ServerCounts:
        return ServerCounts(self.batches - other.batches, self.infer_s - other.infer_s, self.infer_n - other.infer_n,
                            {k: v - other.outcomes.get(k, 0.0) for k, v in self.outcomes.items()
                             if v - other.outcomes.get(k, 0.0)})

    def add(self, other: ServerCounts) -> None:
        self.batches += other.batches
        self.infer_s += other.infer_s
        self.infer_n += other.infer_n
        for k, v in other.outcomes.items():
            self.outcomes[k] = self.outcomes.get(k, 0.0) + v

    @property
    def busy_s(self) -> float:
        """Seconds the lanes ran batches: batches times the mean inference time."""
        return self.batches * self.infer_s / self.infer_n if self.infer_n else math.nan


def scrape_counts(uri: str) -> ServerCounts | None:
    """The policy class's batches, inference time and outcomes from the server's ``/metrics``
    (on its own port: the benchmark's server has no authentication); ``None`` if unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    parts = urllib.parse.urlsplit(uri)
    try:
        status, body = http_get(parts.hostname or "127.0.0.1", parts.port or 80, "/metrics", timeout=5.0)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    out = ServerCounts()
    for family in text_string_to_metric_families(body.decode(errors="replace")):
        for s in family.samples:
            if s.name == "chunkline_batch_size_count":
                out.batches += s.value
            elif s.labels.get("class") != "policy":
                continue
            elif s.name == "chunkline_inference_seconds_sum":
                out.infer_s += s.value
            elif s.name == "chunkline_inference_seconds_count":
                out.infer_n += s.value
            elif s.name == "chunkline_requests_total":
                outcome = s.labels.get("outcome", "?")
                out.outcomes[outcome] = out.outcomes.get(outcome, 0.0) + s.value
    return out


@dataclass
class Tally:
    """What one behaviour got in one block (or several, added)."""

    robots: int = 0
    sent: int = 0
    good: int = 0
    late: int = 0  # chunks that were not in time, for any reason
    server_late: int = 0  # of which the server flagged late (finished past the deadline)
    transport_late: int = 0  # of which in time by the server, late on the robot's clock
    refused: int = 0
    door: int = 0  # refusals at the door: sent inside the session's retry window
    no_hint: int = 0  # refusals that carried no retry_after_ms
    closed: int = 0
    seconds: float = 0.0
    server_cpu_s: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)
    retry_after_ms: list[float] = field(default_factory=list)
    transport_ms: list[float] = field(default_factory=list)  # per chunk: round trip less the server's time
    server: ServerCounts = field(default_factory=ServerCounts)

    def add(self, other: Tally) -> None:
        self.robots = max(self.robots, other.robots)  # per block
        for name in ("sent", "good", "late", "server_late", "transport_late", "refused", "door", "no_hint",
                     "closed", "seconds", "server_cpu_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for code, n in other.codes.items():
            self.codes[code] = self.codes.get(code, 0) + n
        self.retry_after_ms += other.retry_after_ms
        self.transport_ms += other.transport_ms
        self.server.add(other.server)

    def rate(self, count: float) -> float:
        return count / self.seconds if self.seconds > 0 else math.nan

    @property
    def goodput(self) -> float:
        return self.rate(self.good)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("retry_after_ms", "transport_ms", "server")}
        out["retry_after_ms_p50"] = _quantile(self.retry_after_ms, 0.5)
        out["transport_ms_p50"] = _quantile(self.transport_ms, 0.5)
        out["transport_ms_p99"] = _quantile(self.transport_ms, 0.99)
        out["server"] = vars(self.server)
        return out


class Robot:
    """One robot: a chunk per period, refused requests retried within the period."""

    def __init__(self, uri: str, obs_bytes: Any, period: float, deadline_ms: float, honour: bool, tally: Tally) -> None:
        self.uri, self.period, self.deadline_ms, self.honour, self.tally = uri, period, deadline_ms, honour, tally
        self.encoder = Encoder()
        self.obs = obs_bytes
        self.ids = 0
        self.ws: ClientConnection | None = None
        # The robot's recent transport times (round trip less the server's own time): the
        # deadline it sends leaves them out, since the server counts from its receipt.
        self.transport: collections.deque[float] = collections.deque(maxlen=_TRANSPORT_WINDOW)

    async def _connection(self) -> ClientConnection:
        if self.ws is None:
            self.ws = await connect(self.uri, subprotocols=[Subprotocol(SUBPROTOCOL)], compression=None, max_size=None)
            await self.ws.recv(decode=False)  # hello
        return self.ws

    async def run(self, start: float, stop: float) -> None:
        tally = self.tally
        slot = start
        not_before = 0.0  # an honouring robot sends nothing before the retry time it was given
        while slot + self.period <= stop:
            await asyncio.sleep(max(0.0, slot - time.perf_counter()))
            end = slot + self.period
            while time.perf_counter() < end:
                if not_before > time.perf_counter():
                    # the wait may run past this period: its request then goes to the next one
                    await asyncio.sleep(min(not_before, end) - time.perf_counter())
                    continue
                self.ids += 1
                budget = self.deadline_ms - self.transport_allowance_ms()
                frame = self.encoder.encode({"type": "infer", "id": self.ids, "obs": self.obs, "deadline_ms": budget})
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
                    rtt_ms = (time.perf_counter() - sent) * 1000.0
                    server_ms = (reply.get("timing") or {}).get("server_ms")
                    if server_ms is not None:
                        transport = rtt_ms - float(server_ms)
                        tally.transport_ms.append(transport)
                        self.transport.append(max(0.0, transport))
                    server_late = bool(reply.get("late"))
                    in_time = rtt_ms <= self.deadline_ms and not server_late
                    tally.good += in_time
                    tally.late += not in_time
                    tally.server_late += server_late
                    tally.transport_late += not in_time and not server_late
                    break
                tally.refused += 1
                code = str(reply.get("code"))
                tally.codes[code] = tally.codes.get(code, 0) + 1
                tally.door += DOOR_MARK in str(reply.get("message", ""))
                retry = reply.get("retry_after_ms")
                if retry is not None:
                    tally.retry_after_ms.append(float(retry))
                elif code in _CURABLE:
                    tally.no_hint += 1
                if self.honour and retry is not None:
                    not_before = time.perf_counter() + float(retry) / 1000.0
            slot = end

    def transport_allowance_ms(self) -> float:
        """What the robot leaves out of its budget for the trip: the 90th percentile of its last
        transport times, at most a quarter of the deadline (a robot whose link takes more has
        another problem than this benchmark's)."""
        if not self.transport:
            return 0.0
        recent = sorted(self.transport)
        return min(recent[int(0.9 * (len(recent) - 1))], self.deadline_ms / 4.0)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


async def _block(uri: str, pid: int, period: float, deadline_ms: float, seconds: float, obs: Any,
                 fleet: list[tuple[str, bool]]) -> dict[str, Tally]:
    """One block: ``fleet`` lists each robot's behaviour name and whether it honours retry hints.
    Returns a tally per behaviour; the server's CPU and counts go to the first behaviour named."""
    tallies: dict[str, Tally] = {}
    robots = []
    for name, honour in fleet:
        tally = tallies.setdefault(name, Tally(seconds=seconds))
        tally.robots += 1
        robots.append(Robot(uri, obs, period, deadline_ms, honour, tally))
    before, counts_before = cpu_times(pid), await asyncio.to_thread(scrape_counts, uri)
    start = time.perf_counter() + 0.05
    # robots staggered evenly across the period
    await asyncio.gather(*(r.run(start + i * period / len(robots), start + seconds) for i, r in enumerate(robots)))
    after, counts_after = cpu_times(pid), await asyncio.to_thread(scrape_counts, uri)
    first = tallies[fleet[0][0]]
    if before is not None and after is not None:
        first.server_cpu_s = after.total - before.total
    if counts_before is not None and counts_after is not None:
        first.server = counts_after - counts_before
    await asyncio.gather(*(r.close() for r in robots))
    return tallies


async def _measure(servers: list[tuple[str, str, int]], args: argparse.Namespace) -> dict[str, dict[str, Tally]]:
    """Every block against every server (``(label, uri, pid)``), alternating: per server, a tally
    per behaviour."""
    encoder = Encoder()
    obs = encoder.preencode(robot_request())
    capacity = 1000.0 / args.service_ms
    out = {label: {name: Tally() for name in BEHAVIOURS} for label, _, _ in servers}
    progress = Progress(args.blocks, "alternating blocks")
    n = args.robots
    overloaded = n / (capacity * args.overload)
    blocks = [
        # 1x capacity: the peak goodput this policy allows, in this run.
        (n / capacity, [("peak (1x)", True)] * n),
        (overloaded, [("immediate", False)] * n),
        (overloaded, [("honouring", True)] * n),
        # interleaved, so that neither kind has the better places in the stagger
        (overloaded, [("mixed: immediate", False) if i % 2 == 0 else ("mixed: honouring", True) for i in range(n)]),
    ]
    for _ in range(args.blocks):
        for period, fleet in blocks:
            for label, uri, pid in servers:
                for name, tally in (await _block(uri, pid, period, args.deadline_ms, args.seconds, obs, fleet)).items():
                    out[label][name].add(tally)
        progress.update(advance=1)
    progress.close()
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_per_refusal(t: Tally, peak: Tally) -> float:
    """The server's CPU per refused request in a block: its CPU less what the chunks it served
    would have cost at the peak, over its refusals."""
    if not t.refused or not peak.sent:
        return math.nan
    per_chunk = peak.server_cpu_s / peak.sent
    return max(0.0, t.server_cpu_s - (t.good + t.late) * per_chunk) / t.refused


def check_targets(tallies: dict[str, Tally]) -> list[tuple[str, bool, str]]:
    """The target checks: ``(what, passed, figures)`` each (see the module's docstring)."""
    peak = tallies["peak (1x)"]
    checks: list[tuple[str, bool, str]] = []
    for name in ("immediate", "honouring"):
        ratio = tallies[name].goodput / peak.goodput if peak.goodput else math.nan
        checks.append((f"{name} goodput >= {GOODPUT_TARGET:.0%} of peak", ratio >= GOODPUT_TARGET,
                       f"{tallies[name].goodput:.1f}/s = {ratio:.2f} of {peak.goodput:.1f}/s"))
    per_refusal = _cpu_per_refusal(tallies["immediate"], peak)
    per_request = peak.server_cpu_s / peak.sent if peak.sent else math.nan
    checks.append((f"refusals cheap: server CPU per refusal <= {CHEAP_REFUSAL:.0%} of a served request's",
                   per_refusal <= CHEAP_REFUSAL * per_request,
                   f"{per_refusal * 1e3:.3f} ms against {per_request * 1e3:.2f} ms"))
    imm, hon = tallies["mixed: immediate"], tallies["mixed: honouring"]
    imm_each = imm.goodput / imm.robots if imm.robots else math.nan
    hon_each = hon.goodput / hon.robots if hon.robots else math.nan
    share = hon_each / imm_each if imm_each else math.nan
    checks.append((f"no starvation: honouring robots >= {NO_STARVATION:.0%} of immediate ones' goodput (mixed)",
                   share >= NO_STARVATION, f"{hon_each:.2f}/s against {imm_each:.2f}/s per robot = {share:.2f}"))
    return checks


def reasons(name: str, tallies: dict[str, Tally], service_s: float) -> str:
    """What the tallies show about where a behaviour's goodput went (the lane's figures are the
    block's: for the mixed block, on its first row, counting both kinds' chunks)."""
    t = tallies[name]
    s = t.server
    parts = []
    if s.batches:
        block = [x for k, x in tallies.items() if k.split(":")[0] == name.split(":")[0]]
        good = sum(x.good for x in block)
        busy = s.busy_s if not math.isnan(s.busy_s) else s.batches * service_s
        parts.append(f"lane busy {min(1.0, busy / t.seconds):.0%} ({s.batches:.0f} batches, {good / s.batches:.0%} gave a chunk "
                     "in time)")
    dropped = s.outcomes.get("deadline_exceeded", 0.0)
    if t.late or dropped:
        parts.append(f"not in time: {t.server_late} answered late, {t.transport_late} late only on the robot's clock"
                     + (f", {dropped:.0f} admitted and then dropped or stopped at their deadline" if dropped else ""))
    if t.transport_ms:
        parts.append(f"transport p50 {_quantile(t.transport_ms, 0.5):.1f} ms, p99 {_quantile(t.transport_ms, 0.99):.1f} ms")
    if t.refused:
        hint = f", retry_after p50 {_quantile(t.retry_after_ms, 0.5):.0f} ms" if t.retry_after_ms else ""
        parts.append(f"refusals: {t.door / t.refused:.0%} at the door (sent before their retry time), {t.no_hint} without "
                     f"a retry time{hint}")
    if t.closed:
        parts.append(f"{t.closed} sessions closed (1013) and reconnected")
    return f"  {name}: " + "; ".join(parts) if parts else f"  {name}: -"


def _report(label: str, tallies: dict[str, Tally], args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    peak = tallies["peak (1x)"].goodput
    print()
    print(format_table(list(tallies.items()), [
        Column("behaviour", lambda r: r[0], align="<"),
        Column("robots", lambda r: r[1].robots, "d"),
        Column("goodput/s", lambda r: r[1].goodput, ".1f"),
        Column("of peak", lambda r: r[1].goodput / peak if peak else float("nan"), ".2f"),
        Column("sent/s", lambda r: r[1].rate(r[1].sent), ".1f"),
        Column("refused/s", lambda r: r[1].rate(r[1].refused), ".1f"),
        Column("late", lambda r: r[1].late, "d"),
        Column("closed", lambda r: r[1].closed, "d"),
        Column("server cpu ms/answer", lambda r: 1e3 * r[1].server_cpu_s / max(r[1].sent, 1) if r[1].server_cpu_s else None, ".2f"),
    ], title=f"{label}:"))
    print("why:")
    for name in tallies:
        print(reasons(name, tallies, args.service_ms / 1000.0))
    checks = check_targets(tallies)
    print(f"target check ({label}):")
    for what, ok, figures in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {what}: {figures}")
    return checks


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
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="a checkout of another revision: its server joins the alternation, block by block")
    args = parser.parse_args(argv)
    if args.robots < 2:
        parser.error("--robots must be at least 2 (the mixed block has robots of both kinds)")

    server_args = ["--policy", f"sleep:{args.service_ms / 1000.0:g}", "--max-batch-size", "1", "--no-ledger",
                   "--max-connections-per-address", str(max(64, 4 * args.robots))]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ServerProcess(server_args))
        assert server.proc is not None
        servers = [("this server", server.uri, server.proc.pid)]
        if args.baseline_src is not None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            path = baseline_pythonpath(args.baseline_src, tmp / "baseline")
            base = stack.enter_context(ServerProcess(server_args, env={"PYTHONPATH": os.pathsep.join(
                p for p in (path, os.environ.get("PYTHONPATH")) if p)}))
            assert base.proc is not None
            servers.append((f"baseline ({args.baseline_src})", base.uri, base.proc.pid))
        results = run_on_uvloop(_measure(servers, args))

    print()
    print(f"{args.robots} robots at {args.overload:g}x the capacity of a {args.service_ms:g} ms policy "
          f"({1000.0 / args.service_ms:.0f}/s), deadline {args.deadline_ms:g} ms, {args.blocks} x {args.seconds:g} s per "
          "behaviour; the peak is the 1x block's goodput (the block's edges leave it below the capacity)")
    record: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    for i, (label, tallies) in enumerate(results.items()):
        checks = _report(label, tallies, args)
        doc = {"peak_goodput": tallies["peak (1x)"].goodput, "tallies": {name: t.as_dict() for name, t in tallies.items()},
               "checks": [{"target": w, "pass": ok, "figures": f} for w, ok, f in checks]}
        if i == 0:
            record.update(doc)
        else:
            record["baseline"] = {"src": str(args.baseline_src), **doc}
    if len(results) > 1:
        new, base = results.values()
        print()
        print("goodput, this server / baseline: " + ", ".join(
            f"{name} {new[name].goodput / base[name].goodput:.2f}" if base[name].goodput else f"{name} n/a"
            for name in BEHAVIOURS))
    out = ResultsDir(args.out or default_out("retry"), "retry")
    out.write("result", record)
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
