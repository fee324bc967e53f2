"""``make demo``: a server on the embedded default policy and simulated robots streaming to it,
then one simulated robot on a MuJoCo task in closed loop.

Each robot sends ALOHA-sized observations (3 x 224x224x3 uint8 + 14-d state) at a fixed rate
with a deadline, on a drift-free schedule, over the native protocol; a live line shows
observation-to-chunk latency, and a summary is printed at the end. Then (when gymnasium[mujoco]
is installed) a Reacher arm tracks a moving target, driven in real time through the broker by
the remote ``reach-expert`` policy over a delayed link, next to the synchronous loop on the same
episode (:mod:`chunkline.bench.closedloop.demo`): a success line each and a plot in
``results/demo/``.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from typing import Any

import numpy as np

from chunkline.client import AsyncClient, ChunklineError, ServerError

from .serverproc import ServerProcess
from .stats import fmt_ms, percentiles

__all__ = ["run_demo"]


def _observation(rng: np.random.Generator) -> dict[str, Any]:
    obs: dict[str, Any] = {f"images/{cam}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
                           for cam in ("cam_high", "cam_left_wrist", "cam_right_wrist")}
    obs["state"] = rng.standard_normal(14).astype(np.float32)
    obs["prompt"] = "fold the towel"
    return obs


class _Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.window: collections.deque[float] = collections.deque(maxlen=200)
        self.infer_ms: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.late = 0


async def _robot(uri: str, index: int, rate_hz: float, deadline_ms: float, stop_at: float, tally: _Tally) -> None:
    rng = np.random.default_rng(index)
    obs = _observation(rng)
    async with AsyncClient(uri, connect_timeout=30.0) as client:
        period = 1.0 / rate_hz
        next_at = time.monotonic() + period * index / 8  # stagger robots a little
        while next_at < stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            obs["state"] = rng.standard_normal(14).astype(np.float32)
            taken = time.monotonic()
            try:
                reply = await client.infer(obs, obs_time=taken, deadline_ms=deadline_ms)
            except ServerError as exc:
                tally.errors[str(exc.code.value if hasattr(exc.code, "value") else exc.code)] += 1
            except ChunklineError as exc:
                tally.errors[type(exc).__name__] += 1
            else:
                latency = reply.received_at - taken
                tally.latencies.append(latency)
                tally.window.append(latency)
                tally.infer_ms.append(reply.timing.get("infer_ms", float("nan")))
                tally.late += reply.late
            next_at += period  # drift-free: the schedule, not the reply, sets the next send


async def _live(tally: _Tally, started: float, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        await asyncio.sleep(1.0)
        p = percentiles(list(tally.window))
        sys.stdout.write(
            f"\r  t={time.monotonic() - started:5.1f}s  chunks={len(tally.latencies):6d}  "
            f"obs->chunk p50={fmt_ms(p['p50'])} ms p99={fmt_ms(p['p99'])} ms  "
            f"errors={sum(tally.errors.values())}   "
        )
        sys.stdout.flush()
    sys.stdout.write("\n")


async def _drive(uri: str, robots: int, seconds: float, rate_hz: float, deadline_ms: float) -> _Tally:
    tally = _Tally()
    started = time.monotonic()
    stop_at = started + seconds
    await asyncio.gather(_live(tally, started, stop_at),
                         *(_robot(uri, i, rate_hz, deadline_ms, stop_at, tally) for i in range(robots)))
    return tally


def run_demo(*, robots: int = 4, seconds: float = 20.0, rate_hz: float = 10.0, policy: str = "loadtest",
             deadline_ms: float = 100.0) -> int:
    """Run the demo; returns the process exit code (0 when chunks flowed)."""
    print(f"chunkline demo: starting a server on the embedded '{policy}' policy ...")
    with ServerProcess(["--policy", policy]) as server:
        print(f"server ready at {server.uri}; {robots} robots at {rate_hz:g} Hz, deadline {deadline_ms:g} ms, {seconds:g} s")
        tally = asyncio.run(_drive(server.uri, robots, seconds, rate_hz, deadline_ms))
    p = percentiles(tally.latencies)
    pi = percentiles(tally.infer_ms)
    sent = len(tally.latencies) + sum(tally.errors.values())
    print("\nsummary")
    print(f"  requests sent        {sent}")
    print(f"  chunks received      {len(tally.latencies)}  (late: {tally.late})")
    print(f"  errors               {dict(tally.errors) or 0}")
    print(f"  obs->chunk latency   p50 {fmt_ms(p['p50'])} ms   p99 {fmt_ms(p['p99'])} ms")
    print(f"  server inference     p50 {pi['p50']:6.2f} ms   p99 {pi['p99']:6.2f} ms")
    code = 0 if tally.latencies else 1
    from .closedloop.demo import closed_loop_available, run_closed_loop_demo

    if closed_loop_available():
        code = max(code, run_closed_loop_demo())
    else:
        print("\nclosed loop: skipped (needs gymnasium[mujoco]: pip install 'chunkline[sim]')")
    return code
