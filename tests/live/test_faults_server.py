"""Faults inside the server: clients that vanish mid-inference, policies that raise, batches that
cannot be stacked. Against a real server on :class:`chunkline.bench.soak.FaultPolicy`, whose
behaviour each observation chooses (``state[0]``: raise; ``state[2]``: milliseconds to take).

The hung-policy watchdog is covered by ``test_server_faults.py``; restarts (SIGTERM, SIGKILL)
by ``test_faults_restart.py``; network faults by ``test_faults_network.py``.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from chunkline.bench.fuzz import RawWebSocket
from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.bench.soak import FAULT_POLICY_REF, MARK_RAISE, read_ledger, read_process
from chunkline.client import AsyncClient, ErrorCode, ServerError
from chunkline.client.wire.codec import decode, encode
from chunkline.client.wire.protocol import SUBPROTOCOL

GIVE_UP_S = 20.0  # hang guards only


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One lane, batches up to 16: work queues behind a running batch and may batch together.
    Requests without a deadline (openpi-compatible mode) get 10 s, so none is dropped for it."""
    config = tmp_path_factory.mktemp("faults") / "server.toml"
    config.write_text(textwrap.dedent(f"""
        no_auth = true
        metrics_port = 0

        [[policies]]
        ref = "{FAULT_POLICY_REF}"
        lanes = 1
        max_batch_size = 16
        default_deadline_ms = 10000
    """))
    with ServerProcess(["--config", str(config)]) as proc:
        # What the server opens once, on first use (the ledger's WAL), is opened now: later
        # descriptor counts compare with a warm baseline.
        async def warm_up() -> None:
            async with AsyncClient(proc.uri) as client:
                await client.infer(obs(), deadline_ms=5000)

        asyncio.run(warm_up())
        time.sleep(1.2)  # the ledger writes within a second
        yield proc


def obs(first: float = 0.0, tag: float = 0.0, sleep_ms: float = 0.0, **extra: Any) -> dict[str, Any]:
    state = np.zeros(14, np.float32)
    state[0], state[1], state[2] = first, tag, sleep_ms
    return {"state": state, "prompt": "fault test", **extra}


def metrics(server: ServerProcess) -> dict[str, float]:
    """Samples summed over labels, by name."""
    status, body = http_get(server.host, server.metrics_port, "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def wait_idle(server: ServerProcess) -> dict[str, float]:
    """Wait until nothing is queued, running or connected; returns the metrics then."""
    give_up = time.monotonic() + GIVE_UP_S
    while True:
        m = metrics(server)
        if m.get("chunkline_queue_depth", 0) == 0 and m.get("chunkline_in_flight", 0) == 0 and m.get("chunkline_sessions", 0) == 0:
            return m
        assert time.monotonic() < give_up, m
        time.sleep(0.05)


async def queued(server: ServerProcess, n: int) -> None:
    """Wait until ``n`` requests wait in the queue (the server has read and admitted them)."""
    give_up = time.monotonic() + GIVE_UP_S
    while (await asyncio.to_thread(metrics, server)).get("chunkline_queue_depth", 0) < n:
        assert time.monotonic() < give_up
        await asyncio.sleep(0.01)


def fds_settle(server: ServerProcess, baseline: int) -> int:
    """The server's descriptor count once it stops falling to ``baseline`` (closing a socket
    the peer reset takes the server a moment)."""
    give_up = time.monotonic() + 5.0
    while True:
        now = read_process(server.proc.pid, 0.0) if server.proc else None
        if now is None or now.fds <= baseline or time.monotonic() > give_up:
            return -1 if now is None else now.fds
        time.sleep(0.05)


async def native(server: ServerProcess) -> Any:
    ws = await connect(server.uri, subprotocols=[SUBPROTOCOL], compression=None)
    decode(await ws.recv())  # hello
    return ws


def test_a_native_client_that_vanishes_mid_inference_leaks_nothing(server: ServerProcess) -> None:
    before = wait_idle(server)
    fds = read_process(server.proc.pid, 0.0) if server.proc else None

    async def go() -> None:
        ws = await native(server)
        await ws.send(encode({"type": "infer", "id": 1, "obs": obs(sleep_ms=400), "deadline_ms": 10_000}))
        await asyncio.sleep(0.1)  # running now
        for i in range(2, 6):  # queued behind it
            await ws.send(encode({"type": "infer", "id": i, "obs": obs(sleep_ms=400), "deadline_ms": 10_000}))
        await queued(server, 4)
        ws.transport.abort()  # gone without a close frame

    asyncio.run(go())
    after = wait_idle(server)
    # Only the running batch ran: the queued requests were withdrawn, never computed.
    assert after.get("chunkline_batch_size_count", 0) - before.get("chunkline_batch_size_count", 0) == 1
    assert after.get("chunkline_requests_total", 0) - before.get("chunkline_requests_total", 0) == 5
    if fds is not None:
        assert fds_settle(server, fds.fds) <= fds.fds


def test_a_compat_client_that_vanishes_mid_queue_has_its_work_withdrawn(server: ServerProcess) -> None:
    before = wait_idle(server)

    async def go() -> None:
        async with AsyncClient(server.uri) as blocker:
            running = asyncio.create_task(blocker.infer(obs(sleep_ms=300), deadline_ms=10_000))
            await asyncio.sleep(0.1)
            compat = await connect(server.uri, compression=None)  # openpi-compatible: no subprotocol
            decode(await compat.recv())  # metadata
            # Queued behind the blocker, well within the default deadline (1 s): it would run.
            await compat.send(encode(obs(sleep_ms=20)))
            await queued(server, 1)
            compat.transport.abort()
            await running

    asyncio.run(go())
    after = wait_idle(server)
    assert after.get("chunkline_batch_size_count", 0) - before.get("chunkline_batch_size_count", 0) == 1


def _queued_together(server: ServerProcess, observations: list[dict[str, Any]], deadlines: list[float]) -> list[Any]:
    """Send each observation on its own session while a blocker runs, so that they queue and are
    batched together when the lane frees up; returns each one's reply or error."""

    async def go() -> list[Any]:
        clients = [await AsyncClient.connect(server.uri) for _ in range(len(observations) + 1)]
        try:
            blocker = asyncio.create_task(clients[0].infer(obs(sleep_ms=500), deadline_ms=10_000))
            await asyncio.sleep(0.15)
            tasks = []
            for client, o, d in zip(clients[1:], observations, deadlines, strict=False):
                tasks.append(asyncio.create_task(client.infer(o, deadline_ms=d)))
                await asyncio.sleep(0.02)  # in this order
            await queued(server, len(observations))
            assert not blocker.done(), "the machine is too slow for this test's 500 ms blocker"
            await blocker
            return list(await asyncio.gather(*tasks, return_exceptions=True))
        finally:
            for c in clients:
                await c.close()

    return asyncio.run(go())


def test_a_policy_exception_fails_its_batch_and_the_lane_survives(server: ServerProcess) -> None:
    poisoned, = _queued_together(server, [obs(MARK_RAISE)], [10_000])
    assert isinstance(poisoned, ServerError) and poisoned.code == ErrorCode.POLICY_FAILED
    assert "InjectedPolicyFailure" in poisoned.message  # the exception type, never its content
    healthy, = _queued_together(server, [obs()], [10_000])
    assert healthy.actions.shape == (50, 14)
    assert http_get(server.host, server.port, "/readyz")[0] == 200


def test_a_poisoned_observation_fails_only_its_own_request(server: ServerProcess) -> None:
    poisoned, innocent = _queued_together(server, [obs(MARK_RAISE), obs()], [10_000, 10_000])
    assert isinstance(poisoned, ServerError) and poisoned.code == ErrorCode.POLICY_FAILED
    assert not isinstance(innocent, BaseException), innocent
    assert innocent.actions.shape == (50, 14)


def test_optional_fields_of_different_lengths_never_share_a_batch(server: ServerProcess) -> None:
    tokens = lambda n: np.arange(n, dtype=np.int32)  # noqa: E731
    replies = _queued_together(server, [obs(), obs(tokens=tokens(3)), obs(tokens=tokens(5))], [5_000, 5_100, 5_200])
    failures = [r for r in replies if isinstance(r, BaseException)]
    assert not failures, failures


def test_the_ledger_records_the_disconnected_sessions_work_as_cancelled(tmp_path) -> None:
    ledger = tmp_path / "ledger.db"
    with ServerProcess(["--policy", FAULT_POLICY_REF, "--lanes", "1", "--max-batch-size", "1",
                        "--ledger", str(ledger)]) as proc:
        async def go() -> str:
            ws = await connect(proc.uri, subprotocols=[SUBPROTOCOL], compression=None)
            session = decode(await ws.recv())["session"]
            await ws.send(encode({"type": "infer", "id": 1, "obs": obs(sleep_ms=300), "deadline_ms": 10_000}))
            await asyncio.sleep(0.1)
            await ws.send(encode({"type": "infer", "id": 2, "obs": obs(sleep_ms=300), "deadline_ms": 10_000}))
            await asyncio.sleep(0.05)
            ws.transport.abort()
            return session

        session = asyncio.run(go())
        time.sleep(0.6)  # the running request finishes; its reply has nowhere to go
    rows = sorted(o for s, o in read_ledger(ledger) if s == session)
    assert rows == ["cancelled", "cancelled"]  # both admitted, neither delivered


def test_a_connection_flood_is_capped_total_and_per_address(tmp_path) -> None:
    config = tmp_path / "server.toml"
    config.write_text(textwrap.dedent("""
        no_auth = true
        max_connections = 3
        max_connections_per_address = 2
    """))
    with ServerProcess(["--config", str(config), "--policy", "noop"]) as proc:
        def open_from(source: str) -> RawWebSocket:
            return RawWebSocket(proc.host, proc.port, source=source)

        held = [open_from("127.0.0.1"), open_from("127.0.0.1")]
        try:
            assert [ws.status for ws in held] == [101, 101]
            extra = open_from("127.0.0.1")
            assert extra.status == 503 and "Retry-After: 1" in extra.response_head  # per address
            extra.close()
            held.append(open_from("127.0.0.2"))
            assert held[-1].status == 101
            full = open_from("127.0.0.3")
            assert full.status == 503  # total
            full.close()
            held.pop(0).close()
            give_up = time.monotonic() + GIVE_UP_S
            while (again := open_from("127.0.0.3")).status != 101:  # a slot freed up
                again.close()
                assert time.monotonic() < give_up
                time.sleep(0.05)
            held.append(again)
            assert http_get(proc.host, proc.port, "/healthz")[0] == 200  # probes are never capped
        finally:
            for ws in held:
                ws.close()
