"""The run: start a server, drive the workload and the fault plan, sample the server, drain it,
reconcile its ledger."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from chunkline.bench.resources import ResourceSample, read_process

from .books import SessionBook, read_ledger, reconcile
from .config import SoakConfig
from .faults import FaultPlan, apply_fault
from .heap import heap_growth, rss_by_kind, server_env
from .policy import FAULT_POLICY_REF
from .report import SoakReport
from .workload import SoakRobot

__all__ = ["text_served", "run_soak"]


async def _drive(cfg: SoakConfig, host: str, port: int, pid: int, documented: frozenset[str],
                 report: SoakReport) -> list[SessionBook]:
    from chunkline.bench.faultproxy import FaultProxy

    loop = asyncio.get_running_loop()
    proxy = await loop.run_in_executor(None, FaultProxy(port, seed=cfg.seed, max_seconds=cfg.duration_s + 600).start) \
        if cfg.proxy else None
    plan = FaultPlan(cfg.duration_s, cfg.seed, mean_gap_s=cfg.fault_gap_s) if proxy is not None and cfg.faults else None
    stop = asyncio.Event()
    books: list[SessionBook] = []
    try:
        report.warm_up_session = await _warm_up(f"ws://{host}:{port}")
        texts = cfg.text_streams if text_served(cfg) else 0
        robots = [SoakRobot(i, proxy.uri if proxy is not None and i % 2 else f"ws://{host}:{port}", cfg, documented, stop,
                         books, via_proxy=proxy is not None and i % 2 == 1, text=i >= cfg.robots)
                  for i in range(cfg.robots + texts)]
        start = loop.time()
        samples: list[ResourceSample] = []
        first = read_process(pid, 0.0)
        if first is not None:
            samples.append(first)
        report.rss_mib_by_kind_start = rss_by_kind(pid)
        tasks = [loop.create_task(r.run()) for r in robots]
        last = 0.0
        while (t := loop.time() - start) < cfg.duration_s:
            if plan is not None and proxy is not None:
                for event in plan.starting(last, t):
                    await asyncio.to_thread(apply_fault, proxy, event, True)
                for event in plan.ending(last, t):
                    await asyncio.to_thread(apply_fault, proxy, event, False)
            last = t
            if not samples or t - samples[-1].t >= cfg.sample_period_s:
                s = read_process(pid, t)
                if s is not None:
                    samples.append(s)
            await asyncio.sleep(0.05)
        stop.set()
        if proxy is not None:
            await asyncio.to_thread(proxy.set, {}, {})
        await asyncio.gather(*tasks)
        if proxy is not None:
            report.proxy = {k: v for k, v in (await asyncio.to_thread(proxy.stats)).items() if k not in ("ok", "now")}
    finally:
        if proxy is not None:
            await asyncio.to_thread(proxy.__exit__, None, None, None)
    # Every session is closed: descriptors must be back where they started.
    settle = loop.time() + 5.0
    end = read_process(pid, loop.time() - start)
    while end is not None and samples and end.fds > samples[0].fds and loop.time() < settle:
        await asyncio.sleep(0.1)
        end = read_process(pid, loop.time() - start)
    report.rss_mib_by_kind_end = rss_by_kind(pid)
    report.connect_failures = sum(r.connect_failures for r in robots)
    if plan is not None:
        report.network_faults = plan.counts()
    if samples and end is not None:
        report.add_resources(samples, end, cfg)
    return books


def text_served(cfg: SoakConfig) -> bool:
    """Whether the run has text streams: asked for, and ``chunkline serve`` can serve text."""
    from chunkline.server.config import ServerConfig

    return cfg.text_streams > 0 and "text" in ServerConfig.model_fields


async def _warm_up(uri: str) -> str:
    """One request before the baseline is taken, so that what the server opens once (the
    ledger's WAL files, the lanes) is not mistaken for growth; then wait for the ledger flush.
    Returns the warm-up session's id."""
    from chunkline.client import AsyncClient

    async with AsyncClient(uri) as client:
        await client.infer({"state": np.zeros(14, np.float32), "prompt": "warm-up"}, deadline_ms=5000)
        session = client.hello.session if client.hello is not None else ""
    await asyncio.sleep(1.5)
    return session


def run_soak(cfg: SoakConfig, *, log_path: Path | None = None) -> SoakReport:
    """Start a server, run the soak, drain the server with SIGTERM, reconcile its ledger.

    Args:
        cfg: the run.
        log_path: keep the server's log here (default: a temp file, removed after).
    """
    from chunkline.bench.fuzz import documented_codes
    from chunkline.bench.serverproc import ServerProcess, http_get

    documented = documented_codes()
    report = SoakReport(duration_s=cfg.duration_s, robots=cfg.robots)
    args = ["--policy", FAULT_POLICY_REF, "--lanes", "2", "--hang-timeout", "1", "--metrics-port", "0",
            "--max-message-bytes", str(cfg.max_message_bytes), "--shutdown-grace", "5", "--send-timeout", "5",
            *cfg.server_args]
    if text_served(cfg):
        args += ["--text-model", cfg.text_model]
    else:
        report.notes.append("robots only: this server does not serve text (no `text` in ServerConfig)")
    env = dict(cfg.server_env)
    if cfg.heap_snapshots is not None:
        env.update(server_env(cfg.heap_snapshots, cfg.snapshot_period_s))
    server = ServerProcess(args, log_path=log_path, env=env)
    with server:
        assert server.proc is not None
        books = asyncio.run(_drive(cfg, server.host, server.port, server.proc.pid, documented.errors, report))
        status, body = http_get(server.host, server.metrics_port, "/metrics")
        report.check_idle_gauges(body.decode() if status == 200 else "")
        server.terminate()
        report.server_exit = server.proc.wait(30)
        log = server.log_path.read_text(errors="replace")
        rows = read_ledger(server.ledger_path)
    if cfg.heap_snapshots is not None:
        report.heap_growth = heap_growth(cfg.heap_snapshots, cfg.duration_s / 2)
    report.add_books(books)
    report.add_ledger(reconcile(rows, books, ignore=[report.warm_up_session]))
    report.judge(cfg, log)
    return report
