"""The proxy process: an asyncio relay of real sockets around the :mod:`.schedule` core, steered
over a control port (JSON lines: ``set``, ``outage``, ``stats``, ``quit``), and its command line."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import FaultProxyError
from .schedule import RTO_MIN_S, Direction, LinkFaults, Outage, Scenario

__all__ = ["check_loopback", "ProxyServer", "main"]


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


def _first_paragraph() -> str:
    doc = sys.modules[__package__].__doc__ or ""
    return doc.split("\n\n")[0]


def main(argv: list[str] | None = None) -> int:
    """The proxy process."""
    p = argparse.ArgumentParser(prog="python -m chunkline.bench.faultproxy", description=_first_paragraph())
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
