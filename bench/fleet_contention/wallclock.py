"""Wall-clock mode: a real chunkline server over loopback on the latency-curve policy, and per
robot a real :class:`~chunkline.client.AsyncClient` and :class:`~chunkline.broker.Broker`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from chunkline.broker import ActionChunk, Broker, BrokerConfig
from chunkline.client import AsyncClient, ServerError
from chunkline.client.exceptions import RequestTimeout

from ..serverproc import ServerProcess
from .metrics import RobotRecord
from .workload import Robot, Workload

__all__ = ["server_args", "run_wallclock", "ACTION_DIM"]

ACTION_DIM = 2
POLICY = "chunkline.bench.fleet_contention.policy:latency_curve"


def server_args(w: Workload) -> list[str]:
    """``serve`` arguments: the latency-curve policy at the workload's curve and largest batch."""
    curve = ",".join(f"{x:g}" for x in w.batch_latency_ms)
    return ["--policy", POLICY, "--policy-arg", f"curve_ms={curve}", "--policy-arg", f"horizon={w.max_horizon}",
            "--policy-arg", f"dt={min(r.period for r in w.robots)}", "--policy-arg", f"action_dim={ACTION_DIM}",
            "--max-batch-size", str(w.max_batch)]


def retimed(reply: Any, robot: Robot, request_id: int, received_at: float) -> ActionChunk:
    """The reply as this robot runs it: its first ``horizon`` rows, one per control period."""
    period = robot.period
    t0 = float(reply.t0)
    return ActionChunk(np.asarray(reply.actions)[: robot.horizon], t0, period, t0 + robot.horizon * period,
                       request_id=request_id, received_at=received_at, timing=dict(reply.timing or {}))


async def _robot(uri: str, robot: Robot, config: BrokerConfig, t_start: float, duration: float) -> RobotRecord:
    rec = RobotRecord(robot.weight)
    period = robot.period
    broker = Broker(config, initial_position=np.zeros(ACTION_DIM), limits=None, verify_fallback=False)
    obs_times: dict[int, float] = {}
    tasks: set[asyncio.Task[None]] = set()
    clock = time.monotonic
    async with AsyncClient(uri) as client:

        async def ask(req: Any) -> None:
            try:
                reply = await client.infer(dict(req.observation), obs_time=req.obs_time, deadline_ms=req.deadline_ms,
                                           prefix=req.prefix, prefix_delay=req.prefix_delay, urgency=req.urgency,
                                           timeout=req.deadline_ms / 1000.0 + 0.5)
                if robot.network_ms:
                    await asyncio.sleep(robot.network_ms / 1000.0)
                t = clock()
                broker.on_chunk(retimed(reply, robot, req.request_id, t), t)
                rec.chunks += 1
            except ServerError as exc:
                rec.refusals += 1
                retry = None if exc.retry_after_ms is None else exc.retry_after_ms / 1000.0
                broker.on_error(clock(), request_id=req.request_id, code=str(getattr(exc.code, "value", exc.code)),
                                retry_after_s=retry)
            except RequestTimeout:
                broker.on_error(clock(), request_id=req.request_id, code="timeout")

        begin = t_start + robot.start_s
        state = np.zeros(ACTION_DIM)
        k = 0
        while True:
            due = begin + k * period
            if due - t_start > duration:
                break
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            now = clock()
            cmd = broker.tick(now, {"state": state.astype(np.float32)}, state=state)
            if k > 0:  # FleetVLA's first control tick is one period after the start
                rec.ticks += 1
                if cmd.chunk_id is not None:
                    rec.executed += 1
                    obs_time = obs_times.get(int(cmd.chunk_id))
                    if obs_time is not None:
                        rec.ages.append(now - obs_time)
            state = np.asarray(cmd.action, dtype=np.float64)
            if cmd.request is not None:
                broker.on_sent(cmd.request.request_id, clock())
                obs_times[cmd.request.request_id] = cmd.request.obs_time
                rec.requests += 1
                task = asyncio.create_task(ask(cmd.request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            k += 1
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rec


async def _fleet(uri: str, w: Workload, config_for: Any) -> list[RobotRecord]:
    t_start = time.monotonic() + 0.5
    return list(await asyncio.gather(*(_robot(uri, r, config_for(r), t_start, w.duration_s) for r in w.robots)))


def run_wallclock(w: Workload, config_for: Any, uri: str | None = None) -> list[RobotRecord]:
    """One run of ``w``; ``config_for(robot)`` gives each robot's broker settings. Starts a
    server unless ``uri`` names one."""
    if uri is not None:
        return asyncio.run(_fleet(uri, w, config_for))
    with ServerProcess(server_args(w)) as server:
        return asyncio.run(_fleet(server.uri, w, config_for))
