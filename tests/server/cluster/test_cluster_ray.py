"""The fleet on a real local Ray (started here, 2 CPUs): replicas are actors, the manager is the
named fleet actor, a replica's actor is killed abruptly. Bounded in time; skipped where the
``cluster`` extra (ray) is not installed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from helpers import aloha_obs  # noqa: E402

from chunkline.client import AsyncClient  # noqa: E402
from chunkline.server.cluster.config import FleetConfig  # noqa: E402
from chunkline.server.cluster.ray_fleet import fleet_up  # noqa: E402
from chunkline.server.cluster.rollout import RolloutConfig  # noqa: E402
from chunkline.server.config import PolicyConfig, ServerConfig  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.live]  # starts Ray and servers


@pytest.fixture(scope="module")
def ray_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path]]:
    ledger = tmp_path_factory.mktemp("fleet") / "ledger.db"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False, namespace="chunkline")
    # Identical replicas must look identical to placement: a policy with a steady service time
    # (a no-op's microseconds vary 2x between processes) and every batch size timed before ready
    # (see test_cluster_fleet's Fleet).
    server = ServerConfig(no_auth=True, port=0, shutdown_grace_s=1.0,
                          policies=[PolicyConfig(ref="sleep:0.005", name="arm", max_batch_size=4,
                                                 warm_batch_sizes=[1, 2, 4], background_timing=False)])
    config = FleetConfig(server=server, replicas=2, directory_port=0, ledger=ledger, replica_cpus=0.5,
                         poll_interval_s=0.1, replica_timeout_s=1.0, drain_grace_s=1.0,
                         rollout=RolloutConfig(canary_replicas=1, canary_share=0.5, observe_s=1.0, min_requests=10,
                                               batch=1))
    actor, uri = fleet_up(config, None)
    try:
        yield actor, uri, ledger
    finally:
        try:
            ray.get(actor.stop.remote(), timeout=60)
        finally:
            ray.shutdown()


def _status(actor: Any) -> dict[str, Any]:
    return ray.get(actor.status.remote(), timeout=30)


def _wait(pred: Any, timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.1)


def test_robots_spread_over_ray_replicas_and_move_when_one_is_killed(ray_fleet: tuple[Any, str, Path]) -> None:
    actor, uri, _ = ray_fleet

    async def go() -> str:
        clients = [await AsyncClient.connect(uri) for _ in range(2)]
        for c in clients:
            await c.infer(aloha_obs())
        _wait(lambda: sorted(r["sessions"] for r in _status(actor)["replicas"]) == [1, 1])
        victim = _status(actor)["replicas"][0]["name"]
        killed = time.monotonic()
        await asyncio.to_thread(lambda: ray.get(actor.kill_replica.remote(victim), timeout=30))
        gaps = []
        for c in clients:
            while True:  # the broker keeps asking while it holds the safe fallback
                try:
                    await c.infer(aloha_obs(), deadline_ms=1000)
                    break
                except Exception:
                    assert time.monotonic() - killed < 60
                    await asyncio.sleep(0.05)
            gaps.append(time.monotonic() - killed)
        assert max(gaps) < 20.0
        for c in clients:
            await c.close()

        return victim

    victim = asyncio.run(go())

    def replaced() -> bool:
        reps = _status(actor)["replicas"]
        return victim not in {r["name"] for r in reps} and len([r for r in reps if r["ready"] and not r["draining"]]) == 2

    _wait(replaced)
    events = [e["event"] for e in _status(actor)["events"]]
    assert "replica_lost" in events


def test_a_failing_new_version_is_rolled_back(ray_fleet: tuple[Any, str, Path]) -> None:
    actor, uri, _ = ray_fleet
    before = {r["name"] for r in _status(actor)["replicas"]}
    label = ray.get(actor.start_rollout.remote({"policies": [{"ref": "fail"}]}), timeout=30)

    async def traffic() -> None:
        give_up = time.monotonic() + 120
        while _status(actor)["rollout"] is not None:
            assert time.monotonic() < give_up, _status(actor)
            c = await AsyncClient.connect(uri)  # new sessions: some land on the canary
            for _ in range(5):
                try:
                    await c.infer(aloha_obs(), deadline_ms=1000)
                except Exception:
                    pass
            await c.close()

    asyncio.run(traffic())
    status = _status(actor)
    assert status["rollout_result"].startswith("rolled back")
    assert {r["version"] for r in status["replicas"] if not r["draining"]} == {"v1"}
    assert label not in {r["version"] for r in status["replicas"]}
    assert before & {r["name"] for r in status["replicas"]}


@pytest.mark.slow
def test_text_behind_ray_serve_ingress_streams_the_same_completion(ray_fleet: tuple[Any, str, Path]) -> None:
    pytest.importorskip("ray.serve")
    import httpx
    from ray import serve

    from chunkline.bench.text_bench import TextServer
    from chunkline.server.cluster.text_ingress import serve_text_ingress

    server = TextServer([{"name": "lm"}], "text").start()
    try:
        via = serve_text_ingress([f"http://127.0.0.1:{server.port}"], port=None)
        body = {"model": "lm", "prompt": "hello", "max_tokens": 8, "seed": 3, "temperature": 0.8}
        direct = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()
        through = httpx.post(f"{via}/completions", json=body, timeout=60).json()
        assert through["choices"][0]["text"] == direct["choices"][0]["text"]
        assert through["usage"] == direct["usage"]
        with httpx.stream("POST", f"{via}/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        missing = httpx.post(f"{via}/completions", json={**body, "model": "nope"}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_model"
    finally:
        serve.shutdown()
        server.stop()
