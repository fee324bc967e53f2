"""``infer``'s ``replaces`` through a real server and the real client: a queued request refreshed
with a newer observation keeps its place and one chunk answers the pair, the newest observation;
a request that runs, was answered, is another session's, or is not one is never replaced."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from chunkline.bench.fleet_contention.policy import STEP
from chunkline.bench.serverproc import ServerProcess
from chunkline.client import AsyncClient, ErrorCode, ReplaceMissed, ServerError, Superseded

# One lane, one robot per batch, each batch 1.5 s: the first request runs while the others queue
# (the sends below take a few ms; the margin is the rest of that batch).
_SERVER = ["--policy", "chunkline.bench.fleet_contention.policy:latency_curve", "--policy-arg", "curve_ms=1500",
           "--max-batch-size", "1"]


def _obs(state: float) -> dict[str, Any]:
    return {"state": np.full(2, state, np.float32)}


async def _exchanges(uri: str) -> tuple[dict[int, Any], Any]:
    async with AsyncClient(uri) as a, AsyncClient(uri) as b:
        calls: dict[int, asyncio.Task[Any]] = {}

        def send(client: AsyncClient, rid: int, state: float, replaces: Any = None) -> asyncio.Task[Any]:
            return asyncio.create_task(client.infer(_obs(state), obs_time=100.0 + state, deadline_ms=30_000, timeout=20.0,
                                                    request_id=rid, replaces=replaces))

        # Each send is on the wire before the next starts (one connection: the server reads them in order).
        for rid, state, replaces in ((1, 1, None), (2, 2, None), (3, 3, 2), (4, 4, 2), (5, 5, 1), (6, 6, 99), (7, 7, 7),
                                     (8, 8, 1.5), (9, 9, 3)):
            calls[rid] = send(a, rid, state, replaces)
            await asyncio.sleep(0.02)
        other = send(b, 1, 10, 9)  # another session's id 9: never looked up
        results = dict(zip(calls, await asyncio.gather(*calls.values(), return_exceptions=True), strict=True))
        return results, (await asyncio.gather(other, return_exceptions=True))[0]


def test_a_queued_request_is_refreshed_in_its_place_and_one_chunk_answers_the_newest(
        server_process: Callable[..., ServerProcess]) -> None:
    server = server_process(_SERVER)
    results, other = asyncio.run(_exchanges(server.uri))
    assert float(results[1].actions[0, 0]) == pytest.approx(1 + STEP)  # ran before any replacement
    # 2 was replaced by 3, then 3 by 9: superseded both; one chunk for the chain, from 9's observation.
    assert isinstance(results[2], Superseded) and results[2].code is ErrorCode.SUPERSEDED
    assert isinstance(results[3], Superseded)
    assert float(results[9].actions[0, 0]) == pytest.approx(9 + STEP) and results[9].t0 == pytest.approx(109.0)
    # Replacing a superseded request, a running one, an unknown id or another session's: missed.
    for rid in (4, 5, 6):
        assert isinstance(results[rid], ReplaceMissed) and results[rid].code is ErrorCode.REPLACE_MISSED
    assert isinstance(other, ReplaceMissed)
    # Replacing itself, or an id of the wrong type: the message is invalid.
    for rid in (7, 8):
        assert isinstance(results[rid], ServerError) and results[rid].code is ErrorCode.INVALID_MESSAGE


def test_a_superseded_request_is_counted_but_not_billed() -> None:
    import dataclasses as dc
    from types import SimpleNamespace

    from chunkline.server.core.serving import ServingCore
    from chunkline.server.core.tenants import TenantRegistry
    from chunkline.server.robot.config import PolicyConfig
    from chunkline.server.robot.service import RobotActions

    robot = RobotActions(ServingCore(TenantRegistry.anonymous()), [PolicyConfig(ref="noop")])
    rows: list[Any] = []
    robot.core.accounting.ledger = SimpleNamespace(record=rows.append)  # type: ignore[assignment]
    tenant = robot.core.quotas.registry.get("anonymous")
    runner = SimpleNamespace(name="noop", policy=SimpleNamespace(fingerprint="f"))
    item = SimpleNamespace(id=1)
    robot.record(runner, tenant, "s", ErrorCode.SUPERSEDED.value, {"decode_ms": 1.0}, item)  # type: ignore[arg-type]
    robot.record(runner, tenant, "s", "ok", {"decode_ms": 1.0}, item)  # type: ignore[arg-type]
    assert [dc.asdict(r)["outcome"] for r in rows] == ["ok"]
    assert robot.core.accounting.outcomes[ErrorCode.SUPERSEDED.value] == 1
