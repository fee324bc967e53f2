"""Open-loop load generator: many robot sessions on one event loop (or a few processes).

Requests are sent when the schedule says, whatever the replies do: a slow server does not
slow the offered load down (it shows up as latency, refusals or timeouts instead). Each robot
session is one native-protocol :class:`~chunkline.client.AsyncClient` connection with several
requests in flight. Every request's outcome becomes a
:class:`~chunkline.bench.records.RequestRecord`; :func:`chunkline.bench.records.summarize`
turns a step's records into the report row.

With ``workers > 1`` the robots are split over that many processes (each with its own event
loop), started together at one ``time.monotonic()`` instant, which the system shares across
processes; their records are merged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chunkline.client import AsyncClient, ChunklineError, ConnectionLost, RequestTimeout, ServerError
from chunkline.client.wire.codec import Encoded, Encoder

from .arrivals import Arrival
from .records import NOT_SENT, OK, RequestRecord
from .report import Progress
from .resources import ProcessMonitor, ResourceUsage
from .serverproc import CpuTimes, cpu_times

__all__ = ["LoadGenError", "LoadOptions", "LoadGenerator", "StepResult", "StepRunner", "observation_from_wire", "run_schedule"]


class LoadGenError(RuntimeError):
    """The generator cannot run a step (e.g. the server does not serve the model asked for)."""


@dataclasses.dataclass
class LoadOptions:
    """How the generator sends.

    Args:
        deadline_ms: deadline of requests whose arrival carries none (``None``: send none).
        timeout_margin_s: the client waits ``deadline + margin`` for a reply before it gives
            up (``timeout``); with no deadline, ``30 s``.
        api_key: default API key of every session.
        tenant_keys: API key per tenant (trace files name tenants).
        model: which served model (``None``: the server's default).
        handover: also time handing each chunk to a broker timeline (the breakdown suite).
        seed: seed of the observations' contents.
        connect_timeout: seconds to connect each session.
        start_delay_s: in-process runs: seconds between connecting and the first arrival.
        preencode: pack each robot's observation once and re-send the packed bytes (every
            request still carries the whole observation, and the server still decodes each
            one). For suites that measure the server, which shares the CPU with the generator;
            off where the client's own encoding is measured (the breakdown suite).
    """

    deadline_ms: float | None = 100.0
    timeout_margin_s: float = 2.0
    api_key: str | None = None
    tenant_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    model: str | None = None
    handover: bool = False
    seed: int = 0
    connect_timeout: float = 10.0
    start_delay_s: float = 0.2
    preencode: bool = False


@dataclasses.dataclass
class StepResult:
    """The records of one step and what the server's process used meanwhile.

    Args:
        records: one per request of the schedule.
        usage: the server's CPU percent and peak memory.
        wall_s: the step's wall time (connecting included).
        server_cpu: CPU seconds the server used while the schedule ran (``None``: not measured).
        generator_cpu_s: CPU seconds the generator's processes used sending it and reading the replies.
    """

    records: list[RequestRecord]
    usage: ResourceUsage
    wall_s: float
    server_cpu: CpuTimes | None = None
    generator_cpu_s: float = math.nan

    def cpu_per_request(self) -> dict[str, float]:
        """Milliseconds of CPU per request sent: ``server_ms`` (the whole server process),
        ``server_loop_ms`` (its event loop thread), ``generator_ms``; NaN where not measured."""
        sent = sum(1 for r in self.records if r.outcome not in NOT_SENT)
        if sent == 0:
            return {"server_ms": math.nan, "server_loop_ms": math.nan, "generator_ms": math.nan}
        cpu = self.server_cpu
        return {
            "server_ms": 1000.0 * cpu.total / sent if cpu is not None else math.nan,
            "server_loop_ms": 1000.0 * cpu.main / sent if cpu is not None else math.nan,
            "generator_ms": 1000.0 * self.generator_cpu_s / sent,
        }


def observation_from_wire(spec: Mapping[str, Any], rng: np.random.Generator,
                          image_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """An observation for a model's wire metadata (the ``hello`` message's ``models`` entry).

    Args:
        spec: the model's metadata (with ``observation``).
        rng: fills arrays with random values.
        image_shape: replace the shape of every 3-d ``uint8`` field (camera images) by this one
            (trace rows that record another camera size).
    """
    obs: dict[str, Any] = {}
    for name, field in spec["observation"].items():
        if field.get("kind") == "text":
            obs[name] = "pick up the cube"
            continue
        shape = tuple(1 if d is None else int(d) for d in field["shape"])
        dtype = np.dtype(field["dtype"])
        if image_shape is not None and dtype == np.uint8 and len(shape) == 3:
            shape = image_shape
        if dtype.kind == "f":
            obs[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            obs[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            obs[name] = rng.integers(0, 256, shape).astype(dtype)
    return obs


def _code(exc: ServerError) -> str:
    return exc.code.value if hasattr(exc.code, "value") else str(exc.code)


class _Session:
    """One robot session: its client, observations and (optionally) a broker timeline.

    Args:
        client: the session's connection.
        spec: the model's wire metadata.
        rng: fills this robot's observations (each robot sends its own pixels).
        encoder: packs each observation once (see :meth:`observation`).
    """

    def __init__(self, client: AsyncClient, spec: Mapping[str, Any], rng: np.random.Generator,
                 encoder: Encoder | None = None) -> None:
        self.client = client
        self.spec = spec
        self.rng = rng
        self.encoder = encoder
        self._obs: dict[tuple[int, ...] | None, dict[str, Any] | Encoded] = {}
        self.timeline: Any = None
        self.seq = 0

    def observation(self, shape: tuple[int, ...] | None) -> dict[str, Any] | Encoded:
        """This robot's observation for ``shape``: one per shape, re-sent with every request
        (generating fresh pixels would only load this process).

        Without an encoder the client encodes it anew for each request, the cost a robot pays.
        With one it is packed once here: the generator shares the CPU with the server it
        measures, and packing the same arrays again would only take CPU from it. Every request
        still carries the whole observation (the bytes a fresh encode gives), and the server
        still decodes and validates each one in full.
        """
        obs = self._obs.get(shape)
        if obs is None:
            fresh = observation_from_wire(self.spec, self.rng, shape)
            obs = self._obs[shape] = self.encoder.preencode(fresh) if self.encoder is not None else fresh
        return obs

    def handover(self, reply: Any, now: Callable[[], float]) -> float | None:
        """Hand the chunk to a broker timeline as a robot would; return the time it took (ms)."""
        try:
            from chunkline.broker import ActionChunk, BrokerError, Timeline
        except ImportError:  # the broker package is optional for the generator
            return None
        t = time.perf_counter()
        try:
            if self.timeline is None:
                self.timeline = Timeline(int(reply.actions.shape[1]))
            chunk = ActionChunk.from_reply(reply, received_at=reply.received_at)
            self.seq += 1
            self.timeline.add(chunk, self.seq, now())
        except BrokerError:
            return None
        return (time.perf_counter() - t) * 1000.0


class LoadGenerator:
    """Sends a schedule over a set of robot sessions on the running event loop.

    Args:
        uri: the server.
        options: how to send.
        clock: ``time.monotonic`` (the client stamps replies with it; keep them on one clock).
    """

    def __init__(self, uri: str, options: LoadOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.uri = uri
        self.options = options
        self.clock = clock
        self.sessions: dict[tuple[int, str | None], _Session] = {}
        # Packs each robot's observation once (options.preencode); one event loop uses it.
        self._encoder = Encoder() if options.preencode else None
        self.done = 0
        self.sent = 0

    async def connect(self, arrivals: Sequence[Arrival]) -> None:
        """Open one session per (robot, tenant) in ``arrivals``."""
        keys = sorted({(a.robot, a.tenant) for a in arrivals}, key=lambda k: (k[0], k[1] or ""))

        async def one(key: tuple[int, str | None]) -> None:
            robot, tenant = key
            api_key = self.options.tenant_keys.get(tenant, self.options.api_key) if tenant else self.options.api_key
            client = await AsyncClient.connect(self.uri, api_key=api_key, connect_timeout=self.options.connect_timeout)
            assert client.hello is not None
            model = self.options.model or client.hello.default_model
            if model not in client.hello.models:
                await client.close()
                raise LoadGenError(f"the server has no model {model!r} (has {sorted(client.hello.models)})")
            rng = np.random.default_rng([self.options.seed, robot])
            self.sessions[key] = _Session(client, client.hello.models[model], rng, self._encoder)

        await asyncio.gather(*(one(k) for k in keys))

    async def close(self) -> None:
        await asyncio.gather(*(s.client.close() for s in self.sessions.values()), return_exceptions=True)
        self.sessions.clear()

    async def _one(self, a: Arrival, start: float) -> RequestRecord:
        scheduled_at = start + a.t
        deadline_ms = a.deadline_ms if a.deadline_ms is not None else self.options.deadline_ms
        record = RequestRecord(scheduled=a.t, sent=math.nan, robot=a.robot, outcome="not_sent",
                               deadline_ms=deadline_ms, tenant=a.tenant, cls=a.cls)
        if a.cls != "policy":
            # The client has no text API yet: such rows are counted, not silently dropped.
            record.outcome = "unsupported"
            return record
        session = self.sessions[(a.robot, a.tenant)]
        obs = session.observation(a.shape)
        timeout = 30.0 if deadline_ms is None else deadline_ms / 1000.0 + self.options.timeout_margin_s
        sent_at = self.clock()
        record.sent = sent_at - start
        self.sent += 1
        try:
            # A pre-packed observation is embedded by the client's encoder as it is.
            reply = await session.client.infer(obs, obs_time=scheduled_at, deadline_ms=deadline_ms,  # type: ignore[arg-type]
                                               model=self.options.model, timeout=timeout)
        except ServerError as exc:
            record.outcome = _code(exc)
            record.latency_s = self.clock() - scheduled_at
        except RequestTimeout:
            record.outcome = "timeout"
        except ConnectionLost:
            record.outcome = "connection_lost"
        except ChunklineError as exc:
            record.outcome = type(exc).__name__
        else:
            record.outcome = OK
            record.latency_s = reply.received_at - scheduled_at
            record.late = bool(reply.late)
            record.server = {k: float(v) for k, v in reply.timing.items()}
            record.client = dict(reply.client_timing)
            if self.options.handover:
                record.handover_ms = session.handover(reply, self.clock)
        finally:
            self.done += 1
        return record

    async def run(self, arrivals: Sequence[Arrival], *, start_at: float | None = None,
                  on_tick: Callable[[], None] | None = None) -> list[RequestRecord]:
        """Send every arrival at ``start_at + arrival.t`` and wait for every outcome.

        Args:
            arrivals: the schedule, sorted by time, over sessions already connected.
            start_at: the step's start on the clock (default: now + ``start_delay_s``).
            on_tick: called about every 0.25 s while the step runs (progress, sampling).
        """
        start = self.clock() + self.options.start_delay_s if start_at is None else start_at
        tasks: list[asyncio.Task[RequestRecord]] = []
        ticker = asyncio.get_running_loop().create_task(self._tick(on_tick)) if on_tick else None
        try:
            for a in arrivals:
                delay = start + a.t - self.clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.get_running_loop().create_task(self._one(a, start)))
                if delay <= 0 and len(tasks) % 64 == 0:
                    await asyncio.sleep(0)  # far behind schedule: still let replies in
            return list(await asyncio.gather(*tasks))
        finally:
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)

    @staticmethod
    async def _tick(fn: Callable[[], None]) -> None:
        while True:
            fn()
            await asyncio.sleep(0.25)


async def run_schedule(uri: str, arrivals: Sequence[Arrival], options: LoadOptions, *, start_at: float | None = None,
                       on_tick: Callable[[LoadGenerator], None] | None = None) -> list[RequestRecord]:
    """Connect the schedule's sessions, run it, close them (one event loop).

    Args:
        uri: the server.
        arrivals: the schedule (times from the step's start).
        options: how to send.
        start_at: the step's start on ``time.monotonic()`` (default: soon after connecting).
        on_tick: called with the generator about every 0.25 s while the step runs.
    """
    gen = LoadGenerator(uri, options)
    try:
        await gen.connect(arrivals)
        return await gen.run(arrivals, start_at=start_at, on_tick=(lambda: on_tick(gen)) if on_tick else None)
    finally:
        await gen.close()


def _worker(uri: str, arrivals: list[Arrival], options: LoadOptions, start_at: float) -> tuple[list[dict[str, Any]], float]:
    """A worker process's share of a step: its records (as dicts: cheap to pickle) and the CPU
    seconds it spent running the schedule."""

    async def go() -> tuple[list[RequestRecord], float]:
        gen = LoadGenerator(uri, options)
        try:
            await gen.connect(arrivals)
            cpu = time.process_time()
            records = await gen.run(arrivals, start_at=start_at)
            return records, time.process_time() - cpu
        finally:
            await gen.close()

    records, cpu_s = asyncio.run(go())
    return [r.as_dict() for r in records], cpu_s


class _ServerCpu:
    """The server's CPU between :meth:`start` and :meth:`stop` (``used``: ``None`` if unknown)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._at_start: CpuTimes | None = None
        self.used: CpuTimes | None = None

    def start(self) -> None:
        self._at_start = cpu_times(self.pid) if self.pid is not None else None

    def stop(self) -> None:
        end = cpu_times(self.pid) if self.pid is not None and self._at_start is not None else None
        self.used = end - self._at_start if end is not None and self._at_start is not None else None


class StepRunner:
    """Runs load steps against a server, in this process or spread over worker processes.

    Args:
        options: how to send.
        workers: processes to spread the robot sessions over (1: this process).
    """

    def __init__(self, options: LoadOptions, *, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.options = options
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> StepRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def run(self, uri: str, arrivals: Sequence[Arrival], *, pid: int | None = None,
            progress: Progress | None = None) -> StepResult:
        """One step: the schedule sent to ``uri``; the server process ``pid`` is watched.

        Args:
            uri: the server.
            arrivals: the schedule (times from the step's start).
            pid: the server's process id for CPU and memory (``None``: not measured).
            progress: advanced as requests complete (in-process runs) or at the end.
        """
        monitor = ProcessMonitor(pid)
        server = _ServerCpu(pid)
        t0 = time.monotonic()
        if self.workers == 1:

            def tick(gen: LoadGenerator) -> None:
                monitor.sample()
                if progress is not None:
                    progress.update(gen.done, extra=f"sent {gen.sent}")

            async def go() -> tuple[list[RequestRecord], float]:
                gen = LoadGenerator(uri, self.options)
                try:
                    await gen.connect(arrivals)
                    start = time.monotonic() + self.options.start_delay_s
                    monitor.start()
                    server.start()
                    cpu = time.process_time()
                    records = await gen.run(arrivals, start_at=start, on_tick=lambda: tick(gen))
                    return records, time.process_time() - cpu
                finally:
                    server.stop()
                    await gen.close()

            records, generator_cpu_s = asyncio.run(go())
            usage = monitor.stop()
        else:
            records, usage, generator_cpu_s = self._run_workers(uri, arrivals, monitor, server)
        if progress is not None:
            progress.update(len(records), force=True)
        return StepResult(records=records, usage=usage, wall_s=time.monotonic() - t0, server_cpu=server.used,
                          generator_cpu_s=generator_cpu_s)

    def _run_workers(self, uri: str, arrivals: Sequence[Arrival], monitor: ProcessMonitor,
                     server: _ServerCpu) -> tuple[list[RequestRecord], ResourceUsage, float]:
        if self._pool is None:
            # spawn, not fork: the parent may hold threads (a server monitor, matplotlib).
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        shares: list[list[Arrival]] = [[] for _ in range(self.workers)]
        for a in arrivals:
            shares[a.robot % self.workers].append(a)
        robots = len({a.robot for a in arrivals})
        # Time to start the workers' event loops and connect every session before the first arrival.
        start_at = time.monotonic() + 1.5 + 0.02 * robots
        futures = [self._pool.submit(_worker, uri, share, self.options, start_at) for share in shares if share]
        while time.monotonic() < start_at:
            time.sleep(0.05)
        monitor.start()
        server.start()
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=0.25)
            monitor.sample()
        server.stop()
        usage = monitor.stop()
        shares_done = [f.result() for f in futures]
        records = [RequestRecord.from_dict(d) for rows, _ in shares_done for d in rows]
        records.sort(key=lambda r: r.scheduled)
        return records, usage, sum(cpu for _, cpu in shares_done)
