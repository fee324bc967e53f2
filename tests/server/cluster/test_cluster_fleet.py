"""The fleet's shells on loopback, with replicas as threads (no Ray): the directory redirects robots
to replicas, sessions spread by capacity, a lost replica's robots move, quotas and the ledger are
fleet-wide, rolling updates promote or roll back. The same manager runs on Ray in
``test_cluster_ray.py``."""

from __future__ import annotations

import asyncio
import http
import json
import math
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import aloha_obs
from tenants_files import POLICY_ONLY, write_tenants
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from chunkline.client import AsyncClient
from chunkline.server.cluster.autoscale import AutoscaleConfig
from chunkline.server.cluster.config import FleetConfig
from chunkline.server.cluster.launch import ThreadLauncher
from chunkline.server.cluster.manager import FleetManager
from chunkline.server.cluster.placement import capacity_rps
from chunkline.server.cluster.rollout import RolloutConfig
from chunkline.server.config import PolicyConfig, ServerConfig
from chunkline.server.core.loopthread import LoopThread

pytestmark = pytest.mark.timeout(180)

TENANTS = {"fleet": POLICY_ONLY, "small": {**POLICY_ONLY, "limits": {"max_sessions": 2, "rate_per_s": 20, "max_in_flight": 3}}}


class Fleet:
    def __init__(self, tmp: Path, replicas: int = 2, policy: str = "sleep:0.005", rollout: RolloutConfig | None = None) -> None:
        tenants, self.keys = write_tenants(tmp, TENANTS, keys=("fleet", "small"))
        self.ledger_path = tmp / "fleet-ledger.db"
        # Every batch size timed before a replica is ready: placement weighs replicas by their
        # service curves, and one replica still timing in the background (its unmeasured sizes
        # assumed no faster than batch 1) looks a quarter as roomy as its twin, which then takes
        # both robots (seen on CI).
        server = ServerConfig(tenants=tenants, policies=[PolicyConfig(ref=policy, name="arm", max_batch_size=4,
                                                                      warm_batch_sizes=[1, 2, 4], background_timing=False)],
                              port=0, shutdown_grace_s=2.0)
        self.config = FleetConfig(server=server, replicas=replicas, directory_port=0, ledger=self.ledger_path,
                                  poll_interval_s=0.1, replica_timeout_s=1.0, drain_grace_s=1.0,
                                  rollout=rollout or RolloutConfig())
        self.lt = LoopThread()
        # replicas write straight into the fleet ledger (the manager exists before any replica starts)
        self.manager = FleetManager(self.config, tenants.read_text(), ThreadLauncher(),
                                    lambda source, offset, rows: self.manager.write_ledger(source, offset, rows))
        self.uri = self.lt.run(self.manager.start())

    def status(self) -> dict[str, Any]:
        return self.lt.call(self.manager.status)

    def sessions(self) -> dict[str, int]:
        return {r["name"]: r["sessions"] for r in self.status()["replicas"] if not r["draining"]}

    def wait(self, predicate: Any, timeout: float = 30.0) -> None:
        give_up = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < give_up, f"timed out; fleet: {self.status()}"
            time.sleep(0.05)

    def close(self) -> None:
        self.lt.run(self.manager.stop())
        self.lt.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.close()


async def _client(fleet: Fleet, tenant: str = "fleet", rate_hz: float = 10.0) -> AsyncClient:
    return await AsyncClient.connect(f"{fleet.uri}/?rate_hz={rate_hz}", api_key=fleet.keys[tenant])


def test_directory_redirects_an_authenticated_robot_to_a_replica(fleet: Fleet) -> None:
    async def go() -> None:
        with pytest.raises(InvalidStatus) as info:
            async with connect(fleet.uri):
                pass
        assert info.value.response.status_code == http.HTTPStatus.UNAUTHORIZED
        client = await _client(fleet)
        reply = await client.infer(aloha_obs())
        assert reply.actions.shape[0] > 0
        # the session is on a replica, not on the directory
        assert client._ws is not None and str(client._ws.request.path).startswith("/?placement=")
        await client.close()

    asyncio.run(go())


def test_a_robot_asking_for_the_policys_own_name_is_placed_and_served(fleet: Fleet) -> None:
    """The replicas serve ``sleep:0.005`` as ``arm``; its own name is an alias the replicas
    report once loaded, which the directory resolves."""
    async def go() -> None:
        own = urllib.parse.quote("sleep:0.005", safe="")
        client = await AsyncClient.connect(f"{fleet.uri}/?rate_hz=10&model={own}", api_key=fleet.keys["fleet"])
        assert client.hello.default_model == "arm" and client.hello.models["sleep:0.005"]["name"] == "sleep:0.005"
        reply = await client.infer(aloha_obs(), model="sleep:0.005")
        assert reply.actions.shape[0] > 0
        await client.close()

    asyncio.run(go())
    assert _placement(fleet, query="?model=sleep").status_code == http.HTTPStatus.SERVICE_UNAVAILABLE


def _placement(fleet: Fleet, tenant: str = "fleet", query: str = "") -> httpx.Response:
    """The directory's answer to a WebSocket handshake, without following it."""
    headers = {"Authorization": f"Api-Key {fleet.keys[tenant]}", "Upgrade": "websocket", "Connection": "Upgrade",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"}
    return httpx.get(fleet.uri.replace("ws://", "http://") + "/" + query, headers=headers, follow_redirects=False, timeout=10)


def test_a_placement_token_is_single_use_and_bound_to_its_replica(fleet: Fleet) -> None:
    async def go() -> None:
        answer = await asyncio.to_thread(_placement, fleet)
        assert answer.status_code == http.HTTPStatus.TEMPORARY_REDIRECT
        location = answer.headers["Location"]
        async with connect(location):
            pass  # first use: accepted
        with pytest.raises(InvalidStatus) as again:
            async with connect(location):
                pass
        assert again.value.response.status_code == http.HTTPStatus.UNAUTHORIZED
        fresh = (await asyncio.to_thread(_placement, fleet)).headers["Location"]
        other = [r["uri"] for r in fleet.status()["replicas"] if r["uri"] not in fresh][0]
        token = fresh.split("?", 1)[1]
        with pytest.raises(InvalidStatus) as foreign:
            async with connect(f"{other}/?{token}"):
                pass
        assert foreign.value.response.status_code == http.HTTPStatus.UNAUTHORIZED

    asyncio.run(go())


def _spread_by_capacity(fleet: Fleet, sessions: int, rate_hz: float, deadline_s: float = 0.1) -> dict[str, int]:
    """Where ``sessions`` robots of ``rate_hz`` belong when spread in proportion to capacity, from
    the replicas' own reports: each in turn to the replica least utilised after taking it (ties
    to the smallest name).

    Identical replicas report equal curves only on a quiet machine: a warm-up timed while the
    CPU is busy elsewhere can make one replica's batch of 4 look 3x slower than its twin's,
    and it is then rightly planned for fewer robots.
    """
    def capacities() -> dict[str, float]:
        placement = fleet.manager.placement
        return {name: capacity_rps(st, deadline_s, placement.headroom) for name, st in placement.replicas.items()}

    caps = fleet.lt.call(capacities)
    counts = dict.fromkeys(sorted(caps), 0)
    for _ in range(sessions):
        best = min(counts, key=lambda n: (counts[n] + 1) * rate_hz / caps[n] if caps[n] > 0 else math.inf)
        counts[best] += 1
    return counts


def test_sessions_spread_by_capacity_and_fleet_quota_holds(fleet: Fleet) -> None:
    async def go() -> None:
        # No robot asks anything here, so the reported curves stay as the warm-ups timed them.
        expected = _spread_by_capacity(fleet, 4, rate_hz=10.0)
        clients = [await _client(fleet) for _ in range(4)]
        fleet.wait(lambda: sum(fleet.sessions().values()) == 4)
        assert fleet.sessions() == expected
        assert _spread_by_capacity(fleet, 4, rate_hz=10.0) == expected  # the curves did not move meanwhile
        small = [await _client(fleet, "small") for _ in range(2)]
        with pytest.raises(Exception) as info:  # the third session of a 2-session tenant, on any replica
            await _client(fleet, "small")
        assert "quota" in str(info.value).lower() or "429" in str(info.value)

        def leased() -> dict[str, Any]:
            return {name: rec.handle.host._server.core.quotas.limits_for("small") for name, rec in fleet.manager.replicas.items()}

        def small_sessions() -> dict[str, int]:
            return {name: (rec.last_stats or {}).get("sessions", {}).get("small", 0) for name, rec in fleet.manager.replicas.items()}

        fleet.wait(lambda: sum(fleet.lt.call(small_sessions).values()) == 2)
        where = fleet.lt.call(small_sessions)

        def share(n: int) -> float:
            # Replicas with sessions of "small" split its rate by sessions; one without keeps the
            # floor (5%) for a robot that lands there before the next lease.
            return n / 2 if all(where.values()) else (0.95 * n / 2 if n else 0.05)

        # each replica enforces its share of the fleet rate (half each when each holds one session)
        fleet.wait(lambda: all(leased()[r].rate_per_s == pytest.approx(20.0 * share(n)) for r, n in where.items()))
        assert sum(lim.max_in_flight for lim in leased().values()) == 3
        assert all(leased()[r].max_sessions == n for r, n in where.items())  # 2 fleet-wide minus those elsewhere
        for c in clients + small:
            await c.close()

    asyncio.run(go())


def test_a_lost_replicas_robots_move_and_nothing_is_answered_twice(fleet: Fleet) -> None:
    async def go() -> None:
        clients = [await _client(fleet) for _ in range(2)]
        fleet.wait(lambda: sum(fleet.sessions().values()) == 2)
        for c in clients:
            await c.infer(aloha_obs())
        # Placement spreads the two by the replicas' measured capacity (one apiece on a quiet
        # machine, possibly both on one when a warm-up was timed under load): lose a busy one.
        victim = max(sorted(fleet.sessions().items()), key=lambda kv: kv[1])[0]
        lost_at = time.monotonic()
        await asyncio.to_thread(fleet.lt.run, fleet.manager.replicas[victim].handle.kill())
        served = 0
        moved_after: list[float] = []
        for c in clients:
            give_up = time.monotonic() + 30
            while True:  # what a broker does: keep asking while it holds the safe fallback
                try:
                    await c.infer(aloha_obs(), deadline_ms=1000)
                    served += 1
                    moved_after.append(time.monotonic() - lost_at)
                    break
                except Exception:
                    assert time.monotonic() < give_up
                    await asyncio.sleep(0.05)
        assert served == 2
        assert max(moved_after) < 15.0
        fleet.wait(lambda: victim not in fleet.sessions())  # declared lost after replica_timeout_s
        for c in clients:
            await c.close()

    asyncio.run(go())
    # a replacement keeps the replica count
    fleet.wait(lambda: len([r for r in fleet.status()["replicas"] if r["ready"]]) == 2)
    con = sqlite3.connect(fleet.ledger_path)
    dup = con.execute("SELECT request_id, COUNT(*) FROM requests GROUP BY request_id HAVING COUNT(*) > 1").fetchall()
    assert dup == []


def test_one_ledger_for_the_fleet_holds_every_admitted_request(tmp_path: Path) -> None:
    f = Fleet(tmp_path)
    sent = 0

    async def go() -> None:
        nonlocal sent
        clients = [await _client(f) for _ in range(4)]
        for _ in range(5):
            for c in clients:
                await c.infer(aloha_obs())
                sent += 1
        for c in clients:
            await c.close()

    asyncio.run(go())
    f.close()  # drains replicas: their ledgers flush into the fleet's
    con = sqlite3.connect(f.ledger_path)
    rows = con.execute("SELECT COUNT(*), COUNT(DISTINCT request_id) FROM requests WHERE outcome = 'ok'").fetchone()
    sources = con.execute("SELECT COUNT(*) FROM sources").fetchone()[0]
    assert rows == (sent, sent)
    assert sources == 2


def _rollout(tmp: Path, new_policy: str) -> dict[str, Any]:
    """Roll the fleet (two replicas of sleep:0.005) to ``new_policy`` under traffic: new robot
    sessions keep arriving (a share lands on the canary), each asking 5 times with 100 ms budgets."""
    f = Fleet(tmp, rollout=RolloutConfig(canary_replicas=1, canary_share=0.5, observe_s=0.5, min_requests=10, batch=1))
    try:
        label = f.lt.run(f.manager.start_rollout({"policies": [{"ref": new_policy}]}))

        async def traffic() -> None:
            give_up = time.monotonic() + 90
            while f.status()["rollout"] is not None:
                assert time.monotonic() < give_up, f.status()
                try:
                    c = await _client(f)
                except Exception:
                    await asyncio.sleep(0.05)
                    continue
                for _ in range(5):
                    try:
                        await c.infer(aloha_obs(), deadline_ms=100)
                    except Exception:
                        pass
                await c.close()

        asyncio.run(traffic())
        status = f.status()
        status["label"] = label
        return status
    finally:
        f.close()


def test_a_rollout_starts_with_a_canary_and_replaces_every_replica(tmp_path: Path) -> None:
    status = _rollout(tmp_path, "sleep:0.006")
    assert status["rollout_result"] == "done"
    live = [r for r in status["replicas"] if not r["draining"]]
    assert len(live) == 2 and {r["version"] for r in live} == {status["label"]}
    events = [e["event"] for e in status["events"]]
    # start before drain: the canary comes up before any old replica is drained
    assert events.index("replica_draining") > [i for i, e in enumerate(events) if e == "replica_ready"][2]


def test_a_rollout_whose_canary_fails_requests_is_rolled_back(tmp_path: Path) -> None:
    status = _rollout(tmp_path, "policies_for_tests:fails_after_warmup")
    assert status["rollout_result"].startswith("rolled back: error rate")
    live = [r for r in status["replicas"] if not r["draining"]]
    assert len(live) == 2 and {r["version"] for r in live} == {"v1"}


def test_a_rollout_whose_canary_cannot_meet_the_deadline_is_rolled_back(tmp_path: Path) -> None:
    status = _rollout(tmp_path, "sleep:0.3")  # 300 ms per batch: placement never sends it a robot
    assert "cannot meet a 100 ms deadline" in status["rollout_result"]
    assert {r["version"] for r in status["replicas"] if not r["draining"]} == {"v1"}


def test_openpi_client_follows_the_directory_unchanged(tmp_path: Path) -> None:
    """openpi-client (from PyPI, its own venv) dials the directory with its API key and is
    redirected to a replica: no change on the robot."""
    from openpi_helpers import openpi_python, run_openpi

    try:
        python = openpi_python()
    except Exception as exc:  # pragma: no cover - a machine without the package registry
        pytest.fail(f"could not install openpi-client: {exc}")
    f = Fleet(tmp_path, policy="noop")
    try:
        port = f.uri.rsplit(":", 1)[1]
        refused = run_openpi(python, port, "ck_wrong")
        assert refused.returncode != 0 and "401" in refused.stderr
        result = run_openpi(python, port, f.keys["fleet"])
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1])["actions_shape"] == [50, 14]
        assert f.status()["placements"] >= 1
    finally:
        f.close()


def test_the_fleet_scales_up_under_load_and_drains_a_replica_when_idle(tmp_path: Path) -> None:
    tenants, keys = write_tenants(tmp_path, TENANTS, keys=("fleet",))
    key = keys["fleet"]
    # 20 ms a forward pass, one at a time: a replica plans 0.8 * 50 = 40 requests/s at most
    server = ServerConfig(tenants=tenants, policies=[PolicyConfig(ref="sleep:0.02", name="arm", max_batch_size=1)], port=0)
    config = FleetConfig(server=server, replicas=1, directory_port=0, ledger=None, poll_interval_s=0.1,
                         replica_timeout_s=1.0, drain_grace_s=0.5,
                         autoscale=AutoscaleConfig(min_replicas=1, max_replicas=2, upscale_delay_s=0.5,
                                                   downscale_delay_s=1.0, stale_after_s=5.0))
    lt = LoopThread()
    manager = FleetManager(config, tenants.read_text(), ThreadLauncher(), None)
    uri = lt.run(manager.start())

    def live() -> list[dict[str, Any]]:
        return [r for r in lt.call(manager.status)["replicas"] if r["ready"] and not r["draining"]]

    async def load(stop: asyncio.Event) -> None:
        client = await AsyncClient.connect(f"{uri}/?rate_hz=10", api_key=key)
        while not stop.is_set():
            try:
                await client.infer(aloha_obs(), deadline_ms=200)
            except Exception:
                await asyncio.sleep(0.01)
        await client.close()

    async def go() -> None:
        stop = asyncio.Event()
        robots = [asyncio.create_task(load(stop)) for _ in range(3)]  # ~3 x 45/s, back to back
        give_up = time.monotonic() + 60
        while len(await asyncio.to_thread(live)) < 2:
            assert time.monotonic() < give_up, lt.call(manager.status)
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*robots)

    try:
        asyncio.run(go())
        events = lt.call(manager.status)["events"]
        assert any(e["event"] == "scale" and e["desired"] == 2 for e in events)
        give_up = time.monotonic() + 60
        while len(live()) > 1:  # idle now: back to the minimum, by draining one
            assert time.monotonic() < give_up, lt.call(manager.status)
            time.sleep(0.1)
        events = [e["event"] for e in lt.call(manager.status)["events"]]
        assert "replica_draining" in events
    finally:
        lt.run(manager.stop())
        lt.close()
