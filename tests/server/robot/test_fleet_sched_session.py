"""The fleet strategy's inputs through a real server: a session's robot weight (asked at the
handshake, bounded by the tenant's ``robots`` policy, reported in ``hello``) and an ``infer``'s
urgency reaching the runner's work item, clamped to the tenant's bounds (issue 32, items 3-4)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import aloha_obs
from tenants_files import POLICY_ONLY, TenantsFile, write_tenants

from chunkline.bench.serverproc import ServerProcess
from chunkline.client import AsyncClient, ErrorCode, ServerError
from chunkline.client.wire.protocol import Urgency as WireUrgency
from chunkline.server.core.serving import ServingCore
from chunkline.server.core.tenants import TenantRegistry, load_registry
from chunkline.server.errors import Refusal
from chunkline.server.robot.config import PolicyConfig
from chunkline.server.robot.service import RobotActions


def _tenants(max_weight: float = 5.0, max_dry_in_ms: float = 2000) -> dict[str, Any]:
    return {"acme": {**POLICY_ONLY, "robots": {"weight": 1.0, "max_weight": max_weight, "max_dry_in_ms": max_dry_in_ms}}}


@pytest.fixture(scope="module")
def keyed(tenants_file: TenantsFile):
    path, keys = tenants_file(_tenants(), keys=("acme",))
    with ServerProcess(["--tenants", str(path), "--policy", "noop", "--max-batch-size", "1"]) as server:
        yield server, keys["acme"]


def _granted(uri: str, key: str, weight: float | None) -> float | None:
    async def go() -> float | None:
        async with AsyncClient(uri, api_key=key, robot_weight=weight) as client:
            assert client.hello is not None
            return client.hello.robot_weight

    return asyncio.run(go())


def test_a_session_gets_the_weight_it_asks_for_within_its_tenants_bound(keyed) -> None:
    server, key = keyed
    assert _granted(server.uri, key, None) == 1.0  # the tenant's default
    assert _granted(server.uri, key, 2.5) == 2.5
    assert _granted(server.uri, key, 50.0) == 5.0  # clamped to max_weight, not refused


def test_a_weight_that_is_not_one_refuses_each_infer_with_its_id(keyed) -> None:
    server, key = keyed

    async def go() -> tuple[float | None, ServerError]:
        async with AsyncClient(server.uri, api_key=key, robot_weight=math.nan) as client:
            assert client.hello is not None
            with pytest.raises(ServerError) as info:
                # The error reaches this call only if it carries the request's id.
                await client.infer(aloha_obs(), deadline_ms=2000, timeout=5.0)
            return client.hello.robot_weight, info.value

    granted, error = asyncio.run(go())
    assert granted is None
    assert error.code == ErrorCode.INVALID_MESSAGE and "robot weight" in str(error)


def test_an_infer_with_urgency_is_served(keyed) -> None:
    server, key = keyed

    async def go() -> Any:
        async with AsyncClient(server.uri, api_key=key, robot_weight=3.0) as client:
            return await client.infer(aloha_obs(), deadline_ms=2000, timeout=5.0,
                                      urgency=WireUrgency(dry_in_ms=3_000_000.0, rows=10, period_ms=50.0))

    assert asyncio.run(go()).actions.shape[0] > 0


def _robot(registry: TenantRegistry) -> RobotActions:
    return RobotActions(ServingCore(registry), [PolicyConfig(ref="noop")])


def test_weights_and_urgency_bounds_follow_the_tenants_file_in_force(tmp_path: Path) -> None:
    path, _ = write_tenants(tmp_path, _tenants())
    robot = _robot(load_registry(path))
    acme = robot.core.quotas.registry.get("acme")
    assert acme is not None
    assert robot.session_weight(acme, None, "9") == 5.0
    assert robot.robot_policies.urgency_for("acme", {"dry_in_ms": 3e6, "rows": 10, "period_ms": 50.0}).dry_in_s == 2.0
    # A reload (SIGHUP) swaps the registry: the new bounds apply to the next session and request.
    write_tenants(tmp_path, _tenants(max_weight=2.0, max_dry_in_ms=500))
    robot.core.reload(load_registry(path))
    assert robot.session_weight(acme, None, "9") == 2.0
    assert robot.robot_policies.urgency_for("acme", {"dry_in_ms": 3e6, "rows": 10, "period_ms": 50.0}).dry_in_s == 0.5


@pytest.mark.parametrize("bad", ["abc", "nan", "inf", "-1", "0", ""])
def test_a_requested_weight_that_is_not_one_is_a_typed_refusal(bad: str) -> None:
    robot = _robot(TenantRegistry.anonymous())
    outcome = robot.session_weight(robot.core.quotas.registry.get("anonymous"), None, bad)  # type: ignore[arg-type]
    assert isinstance(outcome, Refusal) and outcome.code == ErrorCode.INVALID_MESSAGE


def test_without_a_tenants_file_robots_weigh_at_most_one() -> None:
    robot = _robot(TenantRegistry.anonymous())
    anonymous = robot.core.quotas.registry.get("anonymous")
    assert anonymous is not None
    assert robot.session_weight(anonymous, None, None) == 1.0
    assert robot.session_weight(anonymous, None, "5") == 1.0
