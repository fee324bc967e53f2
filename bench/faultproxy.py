"""A TCP fault proxy: a separate process relaying a byte stream between a client and a server on
loopback, with network faults injected per direction.

The kernels here have no ``netem`` (``tc`` answers "Specified qdisc kind is unknown"), so this
is the fault layer between the robot process and the server process in the closed-loop
benchmark's real-time mode. Faults, per direction (``up``: client to server, ``down``: back):

* **one-way delay** and **jitter** (each read's delay drawn uniformly in ``delay +- jitter``;
  bytes are never reordered: a read is delivered no earlier than the one before it);
* **bandwidth cap** (bytes are serialised at the given rate, queueing behind each other);
* **stalls** that mimic a lost segment and its retransmission (at random times, Poisson at
  ``stall_rate_hz``, bytes in transit wait ``stall_s``, and everything behind them too, as
  TCP's in-order delivery makes them);
* **outages**, both directions at once: ``blackhole`` (nothing gets through; what was in
  transit or sent during the outage arrives at the first TCP retransmission after it ends,
  retransmissions backing off from 200 ms, doubling) or ``reset`` (every connection is reset
  at the start, new ones are refused until the end).

The delivery schedule is a sans-I/O core (:class:`Direction`, :class:`Scenario`: times in, times
out, no sockets, no clock); the discrete-event simulation of :mod:`chunkline.bench.closedloop`
uses the same core, so both modes run the same scenarios. The asyncio shell
(:class:`ProxyServer`) relays real sockets and takes commands on a control port (JSON lines:
``set``, ``outage``, ``stats``, ``quit``); :class:`FaultProxy` starts it as a child process.

Safety: the proxy listens on loopback only and connects only to loopback addresses; it ends by
itself after ``--max-seconds``; every loop is bounded by a connection, a deadline or both.

Run: ``python -m chunkline.bench.faultproxy --target-port 8000 --delay-ms 50 --port-file p``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "OUTAGE_MODES",
    "RTO_MIN_S",
    "FaultProxyError",
    "LinkFaults",
    "Outage",
    "Scenario",
    "Direction",
    "retransmit_arrival",
    "check_loopback",
    "ProxyServer",
    "FaultProxy",
    "main",
]

OUTAGE_MODES = ("blackhole", "reset")
RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout
_MAX_RETRANSMITS = 15  # TCP gives up after ~15 retransmissions (tcp_retries2)


class FaultProxyError(RuntimeError):
    """The proxy cannot do what was asked (a non-loopback address, a bad setting, a dead child)."""


@dataclasses.dataclass
class LinkFaults:
    """Faults of one direction.

    Args:
        delay_s: one-way delay.
        jitter_s: each read's delay is uniform in ``delay_s +- jitter_s`` (at least 0).
        bandwidth_bps: bits per second, ``None`` for no cap.
        stall_rate_hz: mean stalls per second (Poisson), 0 for none.
        stall_s: how long a stall holds the bytes in transit.
    """

    delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None
    stall_rate_hz: float = 0.0
    stall_s: float = RTO_MIN_S

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s", "stall_rate_hz", "stall_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FaultProxyError(f"{name} must be finite and >= 0, got {value}")
        if self.bandwidth_bps is not None and not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise FaultProxyError(f"bandwidth_bps must be > 0, got {self.bandwidth_bps}")

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LinkFaults:
        """From ``{"delay_ms", "jitter_ms", "bandwidth_mbps", "stall_rate_hz", "stall_ms"}``."""
        bw = doc.get("bandwidth_mbps")
        return cls(delay_s=float(doc.get("delay_ms", 0.0)) / 1000.0, jitter_s=float(doc.get("jitter_ms", 0.0)) / 1000.0,
                   bandwidth_bps=None if bw is None else float(bw) * 1e6,
                   stall_rate_hz=float(doc.get("stall_rate_hz", 0.0)),
                   stall_s=float(doc.get("stall_ms", RTO_MIN_S * 1000.0)) / 1000.0)


@dataclasses.dataclass(frozen=True)
class Outage:
    """Both directions down from ``start`` for ``duration`` seconds.

    Args:
        start: when it begins (the schedule's clock).
        duration: how long, seconds (> 0).
        mode: ``blackhole`` or ``reset``.
    """

    start: float
    duration: float
    mode: str = "blackhole"

    def __post_init__(self) -> None:
        if self.mode not in OUTAGE_MODES:
            raise FaultProxyError(f"outage mode must be one of {OUTAGE_MODES}, got {self.mode!r}")
        if not (math.isfinite(self.start) and math.isfinite(self.duration) and self.duration > 0):
            raise FaultProxyError("an outage needs a finite start and a duration > 0")

    @property
    def end(self) -> float:
        return self.start + self.duration

    def overlaps(self, a: float, b: float) -> bool:
        """Whether ``[a, b]`` (a transit) meets the outage."""
        return a < self.end and b >= self.start


def retransmit_arrival(sent: float, delay: float, outage_end: float, rto: float = RTO_MIN_S) -> float | None:
    """When a segment first sent at ``sent`` and lost to an outage arrives: at the first
    retransmission at or after ``outage_end`` (backing off ``rto, 2 rto, 4 rto, ...``) plus
    the one-way delay; ``None`` if TCP would have given up by then.

    Args:
        sent: first transmission.
        delay: one-way delay.
        outage_end: when the path works again.
        rto: the first retransmission timeout.
    """
    t = sent
    wait = rto
    for _ in range(_MAX_RETRANSMITS):
        t += wait
        if t >= outage_end:
            return t + delay
        wait *= 2
    return None


class Scenario:
    """The outages both directions share.

    Args:
        outages: the outages (any order; they should not overlap).
    """

    def __init__(self, outages: Sequence[Outage] = ()) -> None:
        self.outages: list[Outage] = sorted(outages, key=lambda o: o.start)

    def add(self, outage: Outage) -> None:
        """Schedule one more outage."""
        self.outages.append(outage)
        self.outages.sort(key=lambda o: o.start)

    def active(self, t: float) -> Outage | None:
        """The outage in force at ``t``, if any."""
        for o in self.outages:
            if o.start <= t < o.end:
                return o
        return None

    def hit(self, a: float, b: float) -> Outage | None:
        """The first outage that a transit over ``[a, b]`` meets, if any."""
        for o in self.outages:
            if o.overlaps(a, b):
                return o
        return None

    def resets(self, after: float, until: float) -> list[Outage]:
        """Reset outages starting in ``(after, until]``."""
        return [o for o in self.outages if o.mode == "reset" and after < o.start <= until]


class Direction:
    """The delivery schedule of one direction (sans-I/O).

    Call :meth:`schedule` with the time bytes were read and their count; it returns when to
    deliver them, never earlier than the bytes before (no reordering), or ``None`` when a
    reset outage destroyed them (the connection is gone).

    Args:
        faults: this direction's faults (may be replaced between calls).
        scenario: the outages.
        seed: seed of the jitter and stall draws.
    """

    def __init__(self, faults: LinkFaults, scenario: Scenario | None = None, seed: int = 0) -> None:
        self.faults = faults
        self.scenario = scenario if scenario is not None else Scenario()
        self._rng = random.Random(seed)
        self.last_delivery = -math.inf
        self._link_free = -math.inf
        self._stalls: list[float] = []
        self._stall_horizon = -math.inf
        self.delivered_bytes = 0
        self.dropped_bytes = 0

    def _stall_end(self, a: float, b: float) -> float | None:
        f = self.faults
        if f.stall_rate_hz <= 0:
            return None
        if self._stall_horizon == -math.inf:
            self._stall_horizon = a
        # Draw stall start times (Poisson) up to b; keep them (bounded: old ones are dropped).
        while self._stall_horizon <= b:
            self._stall_horizon += self._rng.expovariate(f.stall_rate_hz)
            self._stalls.append(self._stall_horizon)
        self._stalls = [s for s in self._stalls if s + f.stall_s >= a - 60.0][-10_000:]
        end = None
        for s in self._stalls:
            if s <= b and s + f.stall_s > a:
                end = max(end or -math.inf, s + f.stall_s)
        return end

    def schedule(self, t: float, nbytes: int) -> float | None:
        """When the ``nbytes`` read at ``t`` are delivered (``None``: lost with the connection).

        Args:
            t: when the bytes were read.
            nbytes: how many.
        """
        f = self.faults
        start = t
        if f.bandwidth_bps is not None:
            start = max(t, self._link_free)
            self._link_free = start + nbytes * 8.0 / f.bandwidth_bps
            start = self._link_free
        delay = f.delay_s
        if f.jitter_s > 0:
            delay = max(0.0, delay + self._rng.uniform(-f.jitter_s, f.jitter_s))
        arrival = start + delay
        outage = self.scenario.hit(t, arrival)
        if outage is not None:
            if outage.mode == "reset":
                self.dropped_bytes += nbytes
                return None
            late = retransmit_arrival(start, delay, outage.end)
            if late is None:
                self.dropped_bytes += nbytes
                return None
            arrival = late
        stall = self._stall_end(t, arrival)
        if stall is not None:
            arrival = max(arrival, stall + delay)
        arrival = max(arrival, self.last_delivery)  # a byte stream: never reordered
        self.last_delivery = arrival
        self.delivered_bytes += nbytes
        return arrival

    def reset(self) -> None:
        """Forget the stream (a new connection)."""
        self.last_delivery = -math.inf
        self._link_free = -math.inf


# ---------------------------------------------------------------------------------------- shell


def check_loopback(host: str, port: int) -> tuple[str, int]:
    """Resolve ``host`` and refuse anything that is not a loopback address.

    Raises:
        FaultProxyError: the address is not loopback (or does not resolve).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FaultProxyError(f"cannot resolve {host!r}: {exc}") from exc
    for _family, _, _, _, addr in infos:
        ip = ipaddress.ip_address(addr[0])
        if not ip.is_loopback:
            raise FaultProxyError(f"the fault proxy only relays to loopback, and {host!r} is {ip}")
    return str(infos[0][4][0]), int(port)


def _rst_close(writer: asyncio.StreamWriter) -> None:
    # SO_LINGER with a zero timeout makes close() send RST: the peer sees a reset connection.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Pipe:
    """One direction of one connection: read, schedule, deliver in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: Direction,
                 clock: Callable[[], float]) -> None:
        self.reader = reader
        self.writer = writer
        self.direction = direction
        self.clock = clock
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def read_loop(self) -> None:
        try:
            while True:  # bounded by the connection: ends at EOF or a reset
                data = await self.reader.read(65536)
                if not data:
                    break
                at = self.direction.schedule(self.clock(), len(data))
                if at is None:
                    break  # destroyed by a reset outage: the relay closes
                self.queue.put_nowait((at, data))
        except (ConnectionError, OSError):
            pass
        finally:
            self.queue.put_nowait(None)

    async def write_loop(self) -> None:
        try:
            while True:  # bounded by the connection: ends with the read side
                item = await self.queue.get()
                if item is None:
                    break
                at, data = item
                wait = at - self.clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                self.writer.write(data)
                await self.writer.drain()
            if self.writer.can_write_eof():
                self.writer.write_eof()
        except (ConnectionError, OSError):
            pass


class ProxyServer:
    """The asyncio relay (runs in the proxy process).

    Args:
        target: ``(host, port)`` of the server, loopback only.
        up, down: the two directions' faults.
        seed: seed of the random draws.
        clock: monotonic clock.

    Raises:
        FaultProxyError: the target is not loopback.
    """

    def __init__(self, target: tuple[str, int], up: LinkFaults, down: LinkFaults, *, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = check_loopback(*target)
        self.scenario = Scenario()
        self.up = up
        self.down = down
        self.seed = seed
        self.clock = clock
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._count = 0
        self.stats: dict[str, int] = {"connections": 0, "refused": 0, "resets": 0, "up_bytes": 0, "down_bytes": 0}
        self._reset_tasks: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection."""
        now = self.clock()
        outage = self.scenario.active(now)
        if outage is not None and outage.mode == "reset":
            self.stats["refused"] += 1
            _rst_close(writer)
            return
        try:
            sreader, swriter = await asyncio.wait_for(asyncio.open_connection(*self.target), 5.0)
        except (OSError, asyncio.TimeoutError):
            _rst_close(writer)
            return
        self._count += 1
        self.stats["connections"] += 1
        up = Direction(self.up, self.scenario, seed=self.seed * 1000 + 2 * self._count)
        down = Direction(self.down, self.scenario, seed=self.seed * 1000 + 2 * self._count + 1)
        pair = (writer, swriter)
        self._conns.add(pair)
        pipes = [_Pipe(reader, swriter, up, self.clock), _Pipe(sreader, writer, down, self.clock)]
        try:
            await asyncio.gather(*(p.read_loop() for p in pipes), *(p.write_loop() for p in pipes))
        finally:
            self._conns.discard(pair)
            self.stats["up_bytes"] += up.delivered_bytes
            self.stats["down_bytes"] += down.delivered_bytes
            for w in pair:
                w.close()

    def set_faults(self, up: LinkFaults | None = None, down: LinkFaults | None = None) -> None:
        """Change the faults (new reads follow them; connections keep their order)."""
        if up is not None:
            self.up = up
        if down is not None:
            self.down = down

    def outage(self, duration: float, mode: str, start_in: float = 0.0) -> Outage:
        """Schedule an outage ``start_in`` seconds from now."""
        o = Outage(self.clock() + max(0.0, start_in), duration, mode)
        self.scenario.add(o)
        if mode == "reset":
            task = asyncio.get_running_loop().create_task(self._reset_at(o))
            self._reset_tasks.add(task)
            task.add_done_callback(self._reset_tasks.discard)
        return o

    async def _reset_at(self, o: Outage) -> None:
        await asyncio.sleep(max(0.0, o.start - self.clock()))
        for pair in list(self._conns):
            self.stats["resets"] += 1
            for w in pair:
                _rst_close(w)

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The control port: one JSON command per line, one JSON answer per line."""
        try:
            for _ in range(100_000):  # bounded: a control client sends a handful of commands
                line = await reader.readline()
                if not line:
                    break
                try:
                    answer = self._command(json.loads(line))
                except (ValueError, KeyError, TypeError, FaultProxyError) as exc:
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                writer.write((json.dumps(answer) + "\n").encode())
                await writer.drain()
                if answer.get("quit"):
                    asyncio.get_running_loop().call_soon(self._stop.set)
                    break
        finally:
            writer.close()

    def _command(self, doc: dict[str, Any]) -> dict[str, Any]:
        op = doc["op"]
        if op == "set":
            self.set_faults(LinkFaults.from_dict(doc["up"]) if "up" in doc else None,
                            LinkFaults.from_dict(doc["down"]) if "down" in doc else None)
            return {"ok": True}
        if op == "outage":
            o = self.outage(float(doc["seconds"]), str(doc.get("mode", "blackhole")), float(doc.get("start_in", 0.0)))
            return {"ok": True, "start": o.start, "end": o.end}
        if op == "stats":
            return {"ok": True, "now": self.clock(), **self.stats, "open": len(self._conns)}
        if op == "quit":
            return {"ok": True, "quit": True}
        raise FaultProxyError(f"unknown op {op!r}")

    async def serve(self, listen_port: int, control_port: int, max_seconds: float,
                    ready: Callable[[int, int], None]) -> None:
        """Listen on loopback and relay until ``quit`` or ``max_seconds``."""
        self._stop = asyncio.Event()
        relay = await asyncio.start_server(self.handle, "127.0.0.1", listen_port)
        ctl = await asyncio.start_server(self.control, "127.0.0.1", control_port)
        ready(relay.sockets[0].getsockname()[1], ctl.sockets[0].getsockname()[1])
        try:
            await asyncio.wait_for(self._stop.wait(), max_seconds)
        except asyncio.TimeoutError:
            pass
        finally:
            relay.close()
            ctl.close()
            for pair in list(self._conns):
                for w in pair:
                    w.transport.abort()


def _faults_from_args(args: argparse.Namespace, which: str) -> LinkFaults:
    def pick(name: str) -> Any:
        specific = getattr(args, f"{which}_{name}")
        return specific if specific is not None else getattr(args, name)

    bw = pick("bandwidth_mbps")
    return LinkFaults(delay_s=pick("delay_ms") / 1000.0, jitter_s=pick("jitter_ms") / 1000.0,
                      bandwidth_bps=None if bw is None else bw * 1e6, stall_rate_hz=pick("stall_rate_hz"),
                      stall_s=pick("stall_ms") / 1000.0)


def main(argv: list[str] | None = None) -> int:
    """The proxy process."""
    p = argparse.ArgumentParser(prog="python -m chunkline.bench.faultproxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--target-host", default="127.0.0.1", help="the server (loopback only)")
    p.add_argument("--target-port", type=int, required=True)
    p.add_argument("--listen-port", type=int, default=0, help="relay port on 127.0.0.1 (0: any free)")
    p.add_argument("--control-port", type=int, default=0, help="control port on 127.0.0.1 (0: any free)")
    p.add_argument("--port-file", type=Path, default=None, help="write 'relay_port control_port' here when ready")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long in any case")
    p.add_argument("--seed", type=int, default=0)
    for which in ("", "up_", "down_"):
        scope = {"": "both directions", "up_": "client to server", "down_": "server to client"}[which]
        default = 0.0 if not which else None
        p.add_argument(f"--{which.replace('_', '-')}delay-ms", type=float, default=default, dest=f"{which}delay_ms",
                       help=f"one-way delay, {scope}")
        p.add_argument(f"--{which.replace('_', '-')}jitter-ms", type=float, default=default, dest=f"{which}jitter_ms",
                       help=f"delay jitter (uniform +-), {scope}")
        p.add_argument(f"--{which.replace('_', '-')}bandwidth-mbps", type=float, default=None,
                       dest=f"{which}bandwidth_mbps", help=f"bandwidth cap, {scope}")
        p.add_argument(f"--{which.replace('_', '-')}stall-rate-hz", type=float, default=default,
                       dest=f"{which}stall_rate_hz", help=f"mean stalls per second, {scope}")
        p.add_argument(f"--{which.replace('_', '-')}stall-ms", type=float, default=RTO_MIN_S * 1000.0 if not which else None,
                       dest=f"{which}stall_ms", help=f"stall length, {scope}")
    args = p.parse_args(argv)
    try:
        server = ProxyServer((args.target_host, args.target_port), _faults_from_args(args, "up"),
                             _faults_from_args(args, "down"), seed=args.seed)
    except FaultProxyError as exc:
        print(f"faultproxy: {exc}", file=sys.stderr)
        return 2

    def ready(relay: int, control: int) -> None:
        line = f"{relay} {control}"
        if args.port_file is not None:
            tmp = args.port_file.with_suffix(".tmp")
            tmp.write_text(line)
            os.replace(tmp, args.port_file)  # atomic: a reader never sees half a line
        print(f"faultproxy: relaying 127.0.0.1:{relay} -> {server.target[0]}:{server.target[1]}, control {control}",
              flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(server.serve(args.listen_port, args.control_port, args.max_seconds, ready))
    return 0


class FaultProxy:
    """Start the proxy as a child process and steer it (context manager).

    Args:
        target_port: the server's port on 127.0.0.1.
        up, down: initial faults per direction.
        seed: seed of the proxy's random draws.
        max_seconds: the child exits after this long in any case.
        ready_timeout: seconds to wait for it to listen.
    """

    def __init__(self, target_port: int, *, up: LinkFaults | None = None, down: LinkFaults | None = None,
                 seed: int = 0, max_seconds: float = 3600.0, ready_timeout: float = 20.0) -> None:
        self.target_port = target_port
        self.up = up or LinkFaults()
        self.down = down or LinkFaults()
        self.seed = seed
        self.max_seconds = max_seconds
        self.ready_timeout = ready_timeout
        self.port = 0
        self.control_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="chunkline-proxy-")
        self._ctl: socket.socket | None = None
        self._buf = b""

    @staticmethod
    def _fault_args(prefix: str, f: LinkFaults) -> list[str]:
        out = [f"--{prefix}delay-ms", str(f.delay_s * 1000.0), f"--{prefix}jitter-ms", str(f.jitter_s * 1000.0),
               f"--{prefix}stall-rate-hz", str(f.stall_rate_hz), f"--{prefix}stall-ms", str(f.stall_s * 1000.0)]
        if f.bandwidth_bps is not None:
            out += [f"--{prefix}bandwidth-mbps", str(f.bandwidth_bps / 1e6)]
        return out

    @property
    def uri(self) -> str:
        """``ws://127.0.0.1:<relay port>``: what the robot connects to."""
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Start the child and wait until it listens.

        Raises:
            FaultProxyError: it exited or did not listen in time.
        """
        port_file = Path(self._tmp.name) / "ports"
        cmd = [sys.executable, "-m", "chunkline.bench.faultproxy", "--target-port", str(self.target_port),
               "--port-file", str(port_file), "--max-seconds", str(self.max_seconds), "--seed", str(self.seed),
               *self._fault_args("up-", self.up), *self._fault_args("down-", self.down)]
        self._log = open(Path(self._tmp.name) / "proxy.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + self.ready_timeout
        while time.monotonic() < give_up:  # bounded by ready_timeout
            if self.proc.poll() is not None:
                raise FaultProxyError(f"the proxy exited with {self.proc.returncode}: {self.log()}")
            if port_file.exists():
                relay, control = port_file.read_text().split()
                self.port, self.control_port = int(relay), int(control)
                self._ctl = socket.create_connection(("127.0.0.1", self.control_port), timeout=5.0)
                return self
            time.sleep(0.02)
        self.stop()
        raise FaultProxyError(f"the proxy did not start within {self.ready_timeout} s: {self.log()}")

    def log(self) -> str:
        """The child's output so far."""
        try:
            return (Path(self._tmp.name) / "proxy.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def command(self, doc: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        """Send one control command and return the answer.

        Raises:
            FaultProxyError: the proxy refused it or did not answer.
        """
        if self._ctl is None:
            raise FaultProxyError("the proxy is not running")
        self._ctl.settimeout(timeout)
        self._ctl.sendall((json.dumps(doc) + "\n").encode())
        give_up = time.monotonic() + timeout
        while b"\n" not in self._buf:  # bounded by the timeout
            if time.monotonic() > give_up:
                raise FaultProxyError("no answer from the proxy")
            chunk = self._ctl.recv(65536)
            if not chunk:
                raise FaultProxyError("the proxy closed its control port")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise FaultProxyError(str(answer.get("error")))
        return answer

    def set(self, up: dict[str, Any] | None = None, down: dict[str, Any] | None = None) -> None:
        """Change the faults (``{"delay_ms", "jitter_ms", "bandwidth_mbps", "stall_rate_hz", "stall_ms"}``)."""
        doc: dict[str, Any] = {"op": "set"}
        if up is not None:
            doc["up"] = up
        if down is not None:
            doc["down"] = down
        self.command(doc)

    def outage(self, seconds: float, mode: str = "blackhole", start_in: float = 0.0) -> dict[str, Any]:
        """Schedule an outage of both directions."""
        return self.command({"op": "outage", "seconds": seconds, "mode": mode, "start_in": start_in})

    def stats(self) -> dict[str, Any]:
        """Connections, refusals, resets and bytes relayed so far."""
        return self.command({"op": "stats"})

    def stop(self, timeout: float = 5.0) -> int | None:
        """Ask the child to quit; terminate it if it does not."""
        if self._ctl is not None:
            try:
                self.command({"op": "quit"}, timeout=2.0)
            except (FaultProxyError, OSError):
                pass
            self._ctl.close()
            self._ctl = None
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
