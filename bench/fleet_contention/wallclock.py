"""Wall-clock mode: a real chunkline server over loopback on the latency-curve policy, and per
robot a real :class:`~chunkline.client.AsyncClient` and :class:`~chunkline.broker.Broker`.

The server is started from a config file (the policy, its largest batch, its ``batch_strategy``)
and a tenants file with one tenant whose robots may weigh up to the workload's heaviest; each
robot's client asks for its weight at the handshake. A reply reaches its robot the workload's
network delay after it is received (:class:`ReplyInbox`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from chunkline.broker import ActionChunk, Broker, BrokerConfig
from chunkline.client import AsyncClient, ServerError
from chunkline.client.exceptions import RequestTimeout
from chunkline.server.core.tenants import add_key

from ..serverproc import ServerProcess
from .metrics import RobotRecord
from .workload import Robot, Workload, chunk_rows

__all__ = ["server_args", "server_files", "run_wallclock", "ACTION_DIM", "Landed", "ReplyInbox"]

ACTION_DIM = 2
POLICY = "chunkline.bench.fleet_contention.policy:latency_curve"


def server_args(w: Workload) -> list[str]:
    """``serve`` arguments: the latency-curve policy at the workload's curve and largest batch."""
    curve = ",".join(f"{x:g}" for x in w.batch_latency_ms)
    return ["--policy", POLICY, "--policy-arg", f"curve_ms={curve}", "--policy-arg", f"horizon={_policy_rows(w)}",
            "--policy-arg", f"dt={min(r.period for r in w.robots)}", "--policy-arg", f"action_dim={ACTION_DIM}",
            "--max-batch-size", str(w.max_batch)]


def server_files(w: Workload, strategy: str, folder: Path) -> tuple[list[str], str]:
    """``serve`` arguments for ``w`` with ``batch_strategy = strategy``, from a config file and a
    tenants file written in ``folder``, and the API key of the tenant its robots use."""
    tenants = folder / "tenants.toml"
    max_weight = max(r.weight for r in w.robots)
    tenants.write_text(f'version = 1\n[tenants.fleet]\n[tenants.fleet.robots]\nweight = 1.0\nmax_weight = {max_weight!r}\n')
    key = add_key(tenants, "fleet")[0]
    args = {"curve_ms": ",".join(f"{x:g}" for x in w.batch_latency_ms), "horizon": _policy_rows(w),
            "dt": min(r.period for r in w.robots), "action_dim": ACTION_DIM}
    config = folder / "server.toml"
    lines = [f"tenants = {json.dumps(str(tenants))}", "", "[[policies]]", f"ref = {json.dumps(POLICY)}",
             f"max_batch_size = {w.max_batch}", f"batch_strategy = {json.dumps(strategy)}", "[policies.args]",
             *(f"{k} = {json.dumps(v)}" for k, v in args.items())]
    config.write_text("\n".join(lines) + "\n")
    return ["--config", str(config)], key


def _policy_rows(w: Workload) -> int:
    """Rows the policy returns: enough for every robot under either :data:`~.workload.ROWS_FROM`."""
    return w.max_horizon + 1


def retimed(reply: Any, robot: Robot, request_id: int, received_at: float, rows_from: str = "next-tick") -> ActionChunk:
    """The reply as this robot runs it: its first :func:`~.workload.chunk_rows` rows, one per
    control period from the observation's tick."""
    period = robot.period
    t0 = float(reply.t0)
    n = chunk_rows(robot, rows_from)
    return ActionChunk(np.asarray(reply.actions)[:n], t0, period, t0 + n * period,
                       request_id=request_id, received_at=received_at, timing=dict(reply.timing or {}))


@dataclasses.dataclass(frozen=True, slots=True)
class Landed:
    """A reply received, due at the robot at ``at`` (the network's delay after it was received)."""

    at: float
    reply: Any
    request_id: int
    sent: float


class ReplyInbox:
    """A robot's replies on their way, in arrival order (one network delay for all of them). Each
    is taken at its arrival time, by its own timer or before the first tick after it, whichever
    runs first: a timer that wakes late does not hold a reply past a tick it arrived before."""

    def __init__(self) -> None:
        self._on_way: collections.deque[Landed] = collections.deque()

    def put(self, landed: Landed) -> None:
        self._on_way.append(landed)

    def due(self, now: float) -> list[Landed]:
        """The replies arrived by ``now``, each once, in arrival order."""
        out = []
        while self._on_way and self._on_way[0].at <= now:
            out.append(self._on_way.popleft())
        return out


async def _robot(uri: str, key: str | None, robot: Robot, config: BrokerConfig, t_start: float, duration: float,
                 rows_from: str) -> RobotRecord:
    rec = RobotRecord(robot.weight)
    period = robot.period
    broker = Broker(config, initial_position=np.zeros(ACTION_DIM), limits=None, verify_fallback=False)
    obs_times: dict[int, float] = {}
    first_sent: dict[int, float] = {}  # a refresh's chain's first send (its round trip starts there)
    tasks: set[asyncio.Task[None]] = set()
    clock = time.monotonic
    inbox = ReplyInbox()

    def deliver(now: float) -> None:
        for r in inbox.due(now):
            chunk = retimed(r.reply, robot, r.request_id, r.at, rows_from)
            broker.on_chunk(chunk, r.at)
            rec.replay.chunk(r.request_id, len(chunk.actions))
            rec.on_reply(chunk.timing, r.at - r.sent)

    async with AsyncClient(uri, api_key=key, robot_weight=robot.weight) as client:

        async def ask(req: Any) -> None:
            sent = first_sent.get(req.request_id, clock())
            try:
                reply = await client.infer(dict(req.observation), obs_time=req.obs_time, deadline_ms=req.deadline_ms,
                                           prefix=req.prefix, prefix_delay=req.prefix_delay, urgency=req.urgency,
                                           timeout=req.deadline_ms / 1000.0 + 0.5, request_id=req.request_id,
                                           replaces=req.replaces)
                at = clock() + robot.network_ms / 1000.0
                inbox.put(Landed(at, reply, req.request_id, sent))
                await asyncio.sleep(max(0.0, at - clock()))
                deliver(clock())
            except ServerError as exc:
                code = str(getattr(exc.code, "value", exc.code))
                rec.on_error(code)
                retry = None if exc.retry_after_ms is None else exc.retry_after_ms / 1000.0
                broker.on_error(clock(), request_id=req.request_id, code=code, retry_after_s=retry)
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
            deliver(now)
            cmd = broker.tick(now, {"state": state.astype(np.float32)}, state=state)
            if k > 0:  # FleetVLA's first control tick is one period after the start
                rec.ticks += 1
                rec.replay.tick(now)
                if cmd.chunk_id is not None:
                    rec.executed += 1
                    obs_time = obs_times.get(int(cmd.chunk_id))
                    if obs_time is not None:
                        rec.ages.append(now - obs_time)
            state = np.asarray(cmd.action, dtype=np.float64)
            if cmd.request is not None:
                broker.on_sent(cmd.request.request_id, clock())
                obs_times[cmd.request.request_id] = cmd.request.obs_time
                replaces = cmd.request.replaces
                first_sent[cmd.request.request_id] = first_sent.get(replaces, clock()) if replaces is not None else clock()
                if replaces is None:
                    rec.requests += 1
                else:
                    rec.refreshes += 1
                rec.replay.request(cmd.request.request_id, cmd.request.obs_time)
                task = asyncio.create_task(ask(cmd.request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            k += 1
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rec


async def _fleet(uri: str, key: str | None, w: Workload, config_for: Any, rows_from: str) -> list[RobotRecord]:
    t_start = time.monotonic() + 0.5
    return list(await asyncio.gather(*(_robot(uri, key, r, config_for(r), t_start, w.duration_s, rows_from)
                                       for r in w.robots)))


def run_wallclock(w: Workload, config_for: Any, uri: str | None = None, strategy: str = "admission",
                  rows_from: str = "next-tick") -> list[RobotRecord]:
    """One run of ``w``; ``config_for(robot)`` gives each robot's broker settings; ``rows_from``
    where a chunk's rows start (:data:`~.workload.ROWS_FROM`). Starts a server with
    ``batch_strategy = strategy`` unless ``uri`` names one (its key: ``$CHUNKLINE_API_KEY``)."""
    if uri is not None:
        return asyncio.run(_fleet(uri, None, w, config_for, rows_from))
    with tempfile.TemporaryDirectory() as folder:
        args, key = server_files(w, strategy, Path(folder))
        with ServerProcess(args) as server:
            return asyncio.run(_fleet(server.uri, key, w, config_for, rows_from))
