"""Robot-path overhead: chunkline against a bare ``websockets`` echo of the same bytes.

Requests of ALOHA's size from the fastest client this project can build, in alternating blocks
so that machine noise hits every server alike: round trip on one connection, server CPU per
request under ``--connections``, and the codec against a memcpy. The no-op by default,
``--lanes`` through a factory every checkout has, ``--policy REF`` a real policy;
``--baseline-src DIR`` (``git archive REV | tar -x -C DIR``) adds that checkout's server to the
alternation (new / base ratios). Writes ``results.jsonl``, ``round_trip_cdf.png``, ``codec.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from chunkline.bench.help_text import plain_help
from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.protocol import SUBPROTOCOL

from .report import Column, Progress, ResultsDir, default_out, format_table
from .serverproc import ServerProcess, cpu_times, signal_for_file
from .stats import percentiles

__all__ = ["main", "run_on_uvloop", "robot_request", "policy_request",
           "round_trips", "measure_codec", "measure_receive", "Target", "block_spread",
           "baseline_pythonpath", "baseline_env"]

#: the targets of the performance budget (docs/benchmarks.md)
TARGET_P50, TARGET_P99, TARGET_CPU, TARGET_DECODE = 1.2, 1.5, 1.5, 1.2


_SERVE_ARGS = ["--policy", "noop", "--no-ledger"]
#: The allocator settings every server of the run gets (echo, chunkline, a baseline): without heap
#: trimming and fresh mappings below 32 MiB, whether the echo faults its pages in on every message
#: no longer depends on its heap's history, and it is the transport floor at its best in every run.
SERVER_ENV = {"MALLOC_TRIM_THRESHOLD_": str(32 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
#: ``--lanes``: the no-op by a factory every checkout has, on a lane thread in each.
_LANES_ARGS = ["--policy", "chunkline.bench.overhead:noop_on_lanes", "--no-ledger"]


def noop_on_lanes() -> Any:
    """The ``noop`` policy (a ``module:factory`` for ``--lanes``)."""
    from chunkline.policies.embedded.noop import NoopPolicy

    return NoopPolicy()


def policy_request(ref: str, seed: int = 0) -> dict[str, Any]:
    """An example observation of the spec of the policy ``ref`` names (random, seeded)."""
    from chunkline.policies.base import example_observation
    from chunkline.policies.registry import load_policy

    return example_observation(load_policy(ref).spec, np.random.default_rng(seed))


def robot_request(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {f"images/{c}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
                           for c in ("cam_high", "cam_left_wrist", "cam_right_wrist")}
    obs["state"] = rng.standard_normal(14).astype(np.float32)
    return obs


@dataclass
class Target:
    """One server mode under test: where it listens, what it is sent, which process serves it."""

    name: str
    uri: str
    request: bytes
    pid: int
    subprotocols: list[Subprotocol] | None = None
    greeting: bool = False  # the server speaks first (native hello, openpi metadata)

    async def open(self) -> ClientConnection:
        ws = await connect(self.uri, subprotocols=self.subprotocols, compression=None, max_size=None)
        if self.greeting:
            await ws.recv(decode=False)
        return ws


def round_trips(ws: Any, request: bytes, n: int) -> list[float]:
    """Seconds of ``n`` send-and-receive round trips of ``request`` on an open synchronous
    ``websockets`` connection (for suites that drive a server from a thread)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ws.send(request)
        ws.recv()
        out.append(time.perf_counter() - t)
    return out


async def _round_trips(ws: ClientConnection, request: bytes, n: int) -> list[float]:
    """Seconds of ``n`` send-and-receive round trips of the pre-built ``request``."""
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t = clock()
        await ws.send(request)
        await ws.recv(decode=False)
        out.append(clock() - t)
    return out


async def _load(target: Target, connections: list[ClientConnection], seconds: float) -> tuple[int, float, float]:
    """Closed-loop load on every connection for ``seconds``: (requests answered, server CPU
    seconds, those of its event loop's thread alone)."""
    stop = time.perf_counter() + seconds
    before = cpu_times(target.pid)

    async def drive(ws: ClientConnection) -> int:
        n = 0
        while time.perf_counter() < stop:
            await ws.send(target.request)
            await ws.recv(decode=False)
            n += 1
        return n

    done = sum(await asyncio.gather(*(drive(ws) for ws in connections)))
    after = cpu_times(target.pid)
    if before is None or after is None:
        return done, float("nan"), float("nan")
    used = after - before
    return done, used.total, used.main


async def _measure(targets: list[Target], args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    latency_ws = {t.name: await t.open() for t in targets}
    load_ws = {t.name: [await t.open() for _ in range(args.connections)] for t in targets}
    for t in targets:  # warm every path up
        await _round_trips(latency_ws[t.name], t.request, args.warmup)
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    requests = {t.name: 0 for t in targets}
    cpu = {t.name: 0.0 for t in targets}
    loop_cpu = {t.name: 0.0 for t in targets}  # the event loop's thread alone (lanes: the rest)
    # Each block's p50 and CPU per request, for the spread of the ratios over blocks.
    block_p50: dict[str, list[float]] = {t.name: [] for t in targets}
    block_cpu: dict[str, list[float]] = {t.name: [] for t in targets}
    per = max(1, args.round_trips // args.blocks)
    progress = Progress(args.blocks, "alternating blocks")
    for _ in range(args.blocks):
        for t in targets:
            block = await _round_trips(latency_ws[t.name], t.request, per)
            samples[t.name] += block
            block_p50[t.name].append(float(np.median(block)))
        for t in targets:
            n, seconds, loop_seconds = await _load(t, load_ws[t.name], args.load_seconds / args.blocks)
            requests[t.name] += n
            cpu[t.name] += seconds
            loop_cpu[t.name] += loop_seconds
            block_cpu[t.name].append(seconds / n if n else float("nan"))
        progress.update(advance=1)
    progress.close()
    for conn in [*latency_ws.values(), *(w for group in load_ws.values() for w in group)]:
        await conn.close()
    load = {name: {"requests": float(requests[name]), "cpu_s": cpu[name],
                   "cpu_per_request_s": cpu[name] / requests[name] if requests[name] else float("nan"),
                   "loop_cpu_per_request_s": loop_cpu[name] / requests[name] if requests[name] else float("nan"),
                   "rate": requests[name] / args.load_seconds,
                   "block_p50_s": block_p50[name], "block_cpu_per_request_s": block_cpu[name]} for name in requests}
    return samples, load


def block_spread(load: dict[str, dict[str, Any]], name: str, key: str, baseline: str = "echo") -> tuple[float, float, float]:
    """The median, least and greatest over blocks of ``name``'s figure ``key`` (a per-block list)
    over the baseline's in the same block: how much the one ratio the summary gives moves."""
    ratios = [a / b for a, b in zip(load[name][key], load[baseline][key], strict=True) if b > 0 and a == a]
    if not ratios:
        return float("nan"), float("nan"), float("nan")
    return float(np.median(ratios)), min(ratios), max(ratios)


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure_codec(obs: dict[str, Any], n: int, blocks: int = 8) -> dict[str, dict[str, float]]:
    """Encode and decode of ``obs`` in both array layouts (arrays inside the msgpack message, and
    out of band) vs a memcpy (fresh buffer + copy) of the same bytes, alternating."""
    enc = Encoder()
    data, oob = enc.encode(obs), enc.encode_oob(obs)
    raw = bytearray(data)
    samples: dict[str, list[float]] = {"memcpy": [], "encode": [], "decode": [], "encode (oob)": [], "decode (oob)": []}
    per = max(1, n // blocks)
    for _ in range(blocks):
        samples["memcpy"] += _timed(lambda: bytes(raw), per)
        samples["encode"] += _timed(lambda: enc.encode(obs), per)
        samples["encode (oob)"] += _timed(lambda: enc.encode_oob(obs), per)
        samples["memcpy"] += _timed(lambda: bytes(raw), per)
        samples["decode"] += _timed(lambda: decode(data), per)
        samples["decode (oob)"] += _timed(lambda: decode(oob), per)
    return {k: percentiles(v) for k, v in samples.items()}


#: How much one read of the transport hands the protocol (uvloop's read buffer).
_READ_BYTES = 256 * 1024


def measure_receive(message: bytes, n: int, blocks: int = 8) -> dict[str, dict[str, float]]:
    """Receiving ``message`` as one masked frame, in reads of up to :data:`_READ_BYTES` as a
    transport makes them, alternating: the echo's way (websockets' sans-I/O server protocol and
    its stream reader; each read copied into the loop's read buffer, as the kernel does, then
    handed on as a new ``bytes``, as the loop does) and the server's
    (:class:`~chunkline.server.entrypoints.frame_reader.FrameReader`: each read copied into the
    buffer the reader hands out, a large payload's own, and unmasked there). The parsing and
    copies of the receive path, the kernel's copy included, without the system calls."""
    from websockets.frames import Frame, Opcode
    from websockets.protocol import State
    from websockets.server import ServerProtocol

    from chunkline.server.entrypoints.frame_reader import FrameReader

    wire = memoryview(Frame(Opcode.BINARY, message).serialize(mask=True))

    # One connection each, receiving message after message (the server's payload buffers are reused).
    plain = ServerProtocol(max_size=None)
    plain.state = State.OPEN  # past the handshake: the parser restarts in the open state
    plain.parser = plain.parse()
    next(plain.parser)
    loop_buffer = memoryview(bytearray(_READ_BYTES))

    def websockets_way() -> Any:
        for pos in range(0, len(wire), _READ_BYTES):
            chunk = wire[pos:pos + _READ_BYTES]
            loop_buffer[:len(chunk)] = chunk
            plain.receive_data(bytes(loop_buffer[:len(chunk)]))
        (frame,) = plain.events_received()
        assert isinstance(frame, Frame)
        return frame.data

    delivered: list[bytes | memoryview] = []
    lean = FrameReader(delivered.append, lambda data: None, lambda: True, 64 << 20)

    def read(data: bytes | memoryview) -> None:
        pos = 0
        while pos < len(data):
            into = lean.get_buffer(-1)
            k = min(len(into), len(data) - pos, _READ_BYTES)
            into[:k] = data[pos:pos + k]
            pos += k
            lean.buffer_updated(k)

    read(b"GET / HTTP/1.1\r\n\r\n")  # the handshake (whose bytes go to websockets), alone in its read

    def server_way() -> Any:
        read(wire)
        return delivered.pop()

    assert websockets_way() == bytes(server_way()) == message
    samples: dict[str, list[float]] = {"receive (websockets reader)": [], "receive (server, own frame reader)": []}
    per = max(1, n // blocks)
    for _ in range(blocks):
        samples["receive (websockets reader)"] += _timed(websockets_way, per)
        samples["receive (server, own frame reader)"] += _timed(server_way, per)
    return {k: percentiles(v) for k, v in samples.items()}


#: ``--calls``: the bounded loads whose difference is counted (start-up and warm-up excluded).
_CALLS_FIRST, _CALLS_SECOND = 1000, 3000
_CALLS_WARMUP = 200


#: ``--calls``: the server under ``cProfile`` (builtins counted); each SIGUSR1 writes the counts so
#: far to ``OUT.K`` (K = 0, 1, ...). Run as ``python -c THIS OUT python -m chunkline.server serve
#: ARGS`` (the ``prefix`` of :class:`ServerProcess`). Source text rather than a function here, so that
#: a ``--baseline-src`` server, whose ``chunkline.bench`` is the baseline's, is profiled alike.
_PROFILED_SERVE = """
import cProfile, os, signal, sys
from chunkline.server.entrypoints.cli import main as serve
out, sys.argv = sys.argv[1], ["chunkline.server", *sys.argv[5:]]  # drop "python -m chunkline.server"
profiler, taken = cProfile.Profile(builtins=True), [0]
def snapshot(*_):
    profiler.dump_stats(f"{out}.{taken[0]}.tmp")  # disables the profiler; the counts are kept
    os.replace(f"{out}.{taken[0]}.tmp", f"{out}.{taken[0]}")  # the reader sees whole files only
    taken[0] += 1
    profiler.enable()
signal.signal(signal.SIGUSR1, snapshot)
profiler.enable()
try:
    code = serve()
finally:
    profiler.disable()
sys.exit(code)
"""


def _calls(path: str) -> dict[tuple[str, int, str], int]:
    """Calls per function (primitive and recursive) in a ``cProfile`` dump."""
    import pstats

    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(path).stats  # type: ignore[attr-defined]
    return {func: row[1] for func, row in stats.items()}


async def _bounded(target: Target, connections: list[ClientConnection], n: int) -> None:
    """Exactly ``n`` requests, closed loop, spread over ``connections``."""
    async def drive(ws: ClientConnection, k: int) -> None:
        for _ in range(k):
            await ws.send(target.request)
            await ws.recv(decode=False)

    share, extra = divmod(n, len(connections))
    await asyncio.gather(*(drive(ws, share + (i < extra)) for i, ws in enumerate(connections)))


def _where(func: tuple[str, int, str]) -> str:
    """A function's module, short: ``server/robot/runner.py``, ``websockets/protocol.py``, ``builtins``."""
    path = func[0]
    if path == "~":
        return "builtins"
    if "/site-packages/" in path:
        return path.rsplit("/site-packages/", 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(Path(__file__).resolve().parent.parent))
    return path


def _count_calls(serve_args: list[str], targets: list[tuple[str, bytes, list[Subprotocol] | None]], connections: int,
                 top: int, env: dict[str, str] | None = None) -> dict[str, float]:
    """Python calls per request (cProfile, builtins included) of one server process, per mode: the
    difference of a ``_CALLS_FIRST``- and a ``_CALLS_SECOND``-request bounded load, so that start-up,
    connecting and warming up are excluded."""
    import signal

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dump = str(Path(tmp) / "calls")
        prefix = [sys.executable, "-c", _PROFILED_SERVE, dump]
        with ServerProcess(serve_args, prefix=prefix, env=env) as server:
            assert server.proc is not None
            taken = 0

            def snapshot() -> dict[tuple[str, int, str], int]:
                nonlocal taken
                path = signal_for_file(server, signal.SIGUSR1, Path(f"{dump}.{taken}"), "call counts")
                taken += 1
                return _calls(str(path))

            for name, request, sub in targets:
                target = Target(name, server.uri, request, server.proc.pid, sub, greeting=True)

                async def first_then_second(target: Target) -> tuple[dict[Any, int], dict[Any, int]]:
                    conns = [await target.open() for _ in range(connections)]
                    await _bounded(target, conns, _CALLS_WARMUP)  # warm every path up
                    await _bounded(target, conns, _CALLS_FIRST)
                    first = snapshot()
                    await _bounded(target, conns, _CALLS_SECOND - _CALLS_FIRST)
                    second = snapshot()
                    for ws in conns:
                        await ws.close()
                    return first, second

                first, second = run_on_uvloop(first_then_second(target))
                per = {f: (second.get(f, 0) - first.get(f, 0)) / (_CALLS_SECOND - _CALLS_FIRST) for f in second}
                out[name] = sum(per.values())
                modules: dict[str, float] = {}
                for f, v in per.items():
                    modules[_where(f)] = modules.get(_where(f), 0.0) + v
                print(f"{name}: {out[name]:.1f} Python calls per request (cProfile, builtins included)")
                if top:
                    for mod, v in sorted(modules.items(), key=lambda kv: -kv[1])[:top]:
                        print(f"  {v:7.2f}  {mod}")
                    for f, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
                        print(f"  {v:7.2f}  {_where(f)}:{f[1]}({f[2]})")
    return out


def _start_echo(tmp: Path, reply: bytes) -> tuple[subprocess.Popen[bytes], int]:
    reply_file, port_file = tmp / "reply", tmp / "port"
    reply_file.write_bytes(reply)
    echo = subprocess.Popen([sys.executable, "-m", "chunkline.bench.echo_server", "--port-file", str(port_file),
                             "--reply-file", str(reply_file)], env={**os.environ, **SERVER_ENV})
    give_up = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text()):
        if time.monotonic() > give_up or echo.poll() is not None:
            echo.kill()
            raise RuntimeError("echo server did not start")
        time.sleep(0.02)
    return echo, int(port_file.read_text())


_PACKAGES = ("client", "server", "policies", "broker", "safety", "bench")


def baseline_pythonpath(src: Path, farm: Path) -> str:
    """A ``PYTHONPATH`` under which ``chunkline`` is imported from the checkout ``src``.

    The editable install maps each ``chunkline.<folder>`` to this checkout through a finder that
    Python consults after ``sys.path``; a folder of links named as the installed packages (as
    ``make lint`` builds) placed on ``PYTHONPATH`` therefore wins, for that child process only.
    """
    missing = [d for d in _PACKAGES if not (src / d).is_dir()]
    if missing:
        raise SystemExit(f"--baseline-src {src}: not a chunkline checkout (no {', '.join(missing)})")
    pkg = farm / "chunkline"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").touch()
    for d in _PACKAGES:
        (pkg / d).symlink_to((src / d).resolve(), target_is_directory=True)
    return str(farm)


def baseline_env(src: Path, farm: Path) -> dict[str, str]:
    """The environment additions that make a child process (a ``chunkline serve``) run the
    checkout ``src``: its :func:`baseline_pythonpath` ahead of the ``PYTHONPATH`` in force."""
    path = baseline_pythonpath(src, farm)
    return {"PYTHONPATH": os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)}


def run_on_uvloop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the server extra
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _first_reply(uri: str, request: bytes, subprotocols: list[Subprotocol] | None) -> bytes:
    async with connect(uri, subprotocols=subprotocols, compression=None, max_size=None) as ws:
        await ws.recv(decode=False)  # hello / metadata
        await ws.send(request)
        reply = await ws.recv(decode=False)
    assert isinstance(reply, bytes)
    return reply


def _main_calls(args: argparse.Namespace, serve_args: list[str], native: bytes, compat: bytes) -> int:
    modes = [("native", native, [Subprotocol(SUBPROTOCOL)]), ("openpi-compat", compat, None)]
    calls = _count_calls(serve_args, modes, args.connections, args.calls_top)
    result: dict[str, Any] = {"calls_per_request": calls, "connections": args.connections, "lanes": args.lanes}
    if args.baseline_src is not None:
        with tempfile.TemporaryDirectory() as tmp:
            env = baseline_env(args.baseline_src, Path(tmp) / "baseline")
            base = _count_calls(serve_args, [(f"{n} (base)", r, s) for n, r, s in modes], args.connections, args.calls_top, env)
        result["calls_per_request_base"] = base
        for name in calls:
            print(f"{name} calls per request new / base ({args.baseline_src}): {calls[name]:.1f} / {base[f'{name} (base)']:.1f}")
    out = ResultsDir(args.out or default_out("overhead"), "overhead")
    out.write("calls", result)
    print(out.listing())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench overhead", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=2000, help="measured round trips per server mode")
    parser.add_argument("--warmup", type=int, default=200, help="round trips per mode before measuring")
    parser.add_argument("--blocks", type=int, default=8, help="alternating blocks")
    parser.add_argument("--connections", type=int, default=4, help="concurrent connections of the CPU-per-request load")
    parser.add_argument("--load-seconds", type=float, default=8.0, help="seconds of load per mode, over all blocks")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/overhead)")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="a checkout of another revision: its server joins the alternation (new / base ratios)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="the servers' batch limit (default: theirs); 1 keeps the load phase's concurrent requests "
                             "from being stacked into batches, a copy of their images the echo does not make")
    parser.add_argument("--calls", action="store_true",
                        help=f"instead: Python calls per request (cProfile with builtins, the difference of a {_CALLS_FIRST}- and "
                             f"a {_CALLS_SECOND}-request load) of the native and openpi-compatible modes (and the baseline's)")
    parser.add_argument("--calls-top", type=int, default=0, metavar="N",
                        help="with --calls: also the N modules and the N functions with the most calls per request")
    parser.add_argument("--lanes", action="store_true",
                        help="serve the no-op by the noop_on_lanes factory (older baselines ran the plain noop on their loop)")
    parser.add_argument("--policy", default=None, metavar="REF",
                        help="serve this policy instead of the no-op (e.g. reach-bc), sent an example observation of its spec")
    args = parser.parse_args(argv)
    if args.policy is not None and args.lanes:
        parser.error("--policy and --lanes are exclusive: --policy serves a real policy wherever the server runs it")

    obs = robot_request() if args.policy is None else policy_request(args.policy)
    enc = Encoder()
    # What chunkline's own client sends: the out-of-band layout the server offers in its hello.
    native = enc.encode_oob({"type": "infer", "id": 1, "obs": obs, "obs_time": 0.0, "deadline_ms": 1000.0})
    compat = enc.encode(obs)  # openpi-compatible: the bare observation, arrays inside the msgpack message
    print(f"request {len(native) / 1024:.1f} KiB; {args.round_trips} round trips per mode in {args.blocks} alternating blocks; "
          f"CPU per request under {args.connections} connections, {args.load_seconds:g} s per mode")

    batching = [] if args.max_batch_size is None else ["--max-batch-size", str(args.max_batch_size)]
    policy = ["--policy", args.policy, "--no-ledger"] if args.policy is not None else _LANES_ARGS if args.lanes else _SERVE_ARGS
    serve_args = [*policy, *batching]
    if args.calls:
        return _main_calls(args, serve_args, native, compat)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = stack.enter_context(ServerProcess(serve_args, env=SERVER_ENV))
        base = None
        if args.baseline_src is not None:  # the same mode (inline or --lanes): the baseline has noop_on_lanes too
            base = stack.enter_context(ServerProcess(serve_args, env={**SERVER_ENV, **baseline_env(args.baseline_src, tmp / "baseline")}))
        sub = [Subprotocol(SUBPROTOCOL)]
        reply = run_on_uvloop(_first_reply(server.uri, native, sub))
        assert decode(reply)["type"] == "chunk", "chunkline did not answer with a chunk"
        echo, echo_port = _start_echo(tmp, reply)
        try:
            assert server.proc is not None
            targets = [
                Target("echo", f"ws://127.0.0.1:{echo_port}", native, echo.pid),
                Target("native", server.uri, native, server.proc.pid, sub, greeting=True),
                Target("openpi-compat", server.uri, compat, server.proc.pid, None, greeting=True),
            ]
            if base is not None:
                assert base.proc is not None
                targets += [Target("native (base)", base.uri, native, base.proc.pid, sub, greeting=True),
                            Target("openpi-compat (base)", base.uri, compat, base.proc.pid, None, greeting=True)]
            samples, load = run_on_uvloop(_measure(targets, args))
        finally:
            echo.terminate()
            echo.wait(10)

    rt = {k: percentiles(v) for k, v in samples.items()}
    codec = {**measure_codec(obs, args.round_trips, args.blocks), **measure_receive(native, args.round_trips, args.blocks)}
    ratios = {name: {"p50": rt[name]["p50"] / rt["echo"]["p50"], "p99": rt[name]["p99"] / rt["echo"]["p99"],
                     "cpu_per_request": load[name]["cpu_per_request_s"] / load["echo"]["cpu_per_request_s"]}
              for name in ("native", "openpi-compat")}
    versus_base = {name: {"p50": rt[name]["p50"] / rt[f"{name} (base)"]["p50"],
                          "p99": rt[name]["p99"] / rt[f"{name} (base)"]["p99"],
                          "cpu_per_request": load[name]["cpu_per_request_s"] / load[f"{name} (base)"]["cpu_per_request_s"],
                          "loop_cpu_per_request": (load[name]["loop_cpu_per_request_s"]
                                                   / load[f"{name} (base)"]["loop_cpu_per_request_s"])}
                   for name in ("native", "openpi-compat") if f"{name} (base)" in rt}

    def scaled(q: str, scale: float = 1e3) -> Callable[[Any], float]:
        return lambda row: float(row[1][q]) * scale

    print()
    print(format_table([(k, {**rt[k], **load[k]}) for k in rt], [
        Column("robot path", lambda row: row[0], align="<"),
        Column("p50 ms", scaled("p50"), ".3f"), Column("p99 ms", scaled("p99"), ".3f"),
        Column("p50 / echo", lambda row: row[1]["p50"] / rt["echo"]["p50"], ".2f"),
        Column("p99 / echo", lambda row: row[1]["p99"] / rt["echo"]["p99"], ".2f"),
        Column("req/s (load)", lambda row: row[1]["rate"], ".0f"),
        Column("server cpu us/req", scaled("cpu_per_request_s", 1e6), ".0f"),
        Column("of it loop", scaled("loop_cpu_per_request_s", 1e6), ".0f"),
        Column("cpu / echo", lambda row: row[1]["cpu_per_request_s"] / load["echo"]["cpu_per_request_s"], ".2f")]))
    print(f"targets: p50 <= {TARGET_P50}x, p99 <= {TARGET_P99}x, server CPU per request <= {TARGET_CPU}x the echo's")
    for name in ("native", "openpi-compat"):
        p50_m, p50_lo, p50_hi = block_spread(load, name, "block_p50_s")
        cpu_m, cpu_lo, cpu_hi = block_spread(load, name, "block_cpu_per_request_s")
        print(f"{name} / echo over {args.blocks} blocks (median, least-greatest): p50 {p50_m:.2f} ({p50_lo:.2f}-{p50_hi:.2f}), "
              f"server cpu per request {cpu_m:.2f} ({cpu_lo:.2f}-{cpu_hi:.2f})")
    for name, r in versus_base.items():
        print(f"{name} new / base ({args.baseline_src}): server cpu per request {r['cpu_per_request']:.2f} "
              f"(its event loop's {r['loop_cpu_per_request']:.2f}), p50 {r['p50']:.2f}, p99 {r['p99']:.2f}")
    print()
    print(format_table(list(codec.items()), [Column("codec (us)", lambda row: row[0], align="<"),
                                             Column("p50", scaled("p50", 1e6), ".1f"), Column("p99", scaled("p99", 1e6), ".1f"),
                                             Column("p50 / memcpy", lambda row: row[1]["p50"] / codec["memcpy"]["p50"], ".2f")]))
    print(f"(target: decode within {TARGET_DECODE}x of a memcpy of the same bytes; the native client sends the oob layout;\n"
          f" receive: the native request as one masked frame through websockets' parser, in reads of up to {_READ_BYTES // 1024} KiB,\n"
          f" the kernel's copy into the read buffer included: the echo's way, and the server's own frame reader)")
    result = {"request_bytes": len(native), "compat_request_bytes": len(compat), "reply_bytes": len(reply), "round_trip_s": rt,
              "load": load, "ratios": ratios, "ratio_p50": ratios["native"]["p50"], "ratio_p99": ratios["native"]["p99"],
              "codec_s": codec, "versus_base": versus_base, "lanes": args.lanes, "policy": args.policy,
              "max_batch_size": args.max_batch_size, "n": args.round_trips, "connections": args.connections}
    out = ResultsDir(args.out or default_out("overhead"), "overhead")
    out.write("result", result)
    from . import plots

    plots.plot_latency_cdf(samples, out.file("round_trip_cdf.png"), title="robot-path round trip (ALOHA-sized request)")
    plots.plot_bars({k: {q: v[q] for q in ("p50", "p99")} for k, v in codec.items()}, out.file("codec.png"),
                    title="codec vs memcpy of the same bytes", ylabel="us", scale=1e6)
    print(out.listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
