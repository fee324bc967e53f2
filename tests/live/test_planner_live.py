"""The planner class on a real server: the native ``plan`` exchange on the robot port, grants,
typed refusals, the shared id space, metrics ``class="plan"`` and ledger rows of class ``plan``."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import numpy as np
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from tenants_files import POLICY_ONLY, TenantsFile

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client.wire.codec import Encoder, decode
from chunkline.client.wire.protocol import SUBPROTOCOL, parse_server_message

TENANTS = {"alice": {"class_priority": {"policy": 20, "plan": 10, "text": 0}}, "robots": POLICY_ONLY}


@pytest.fixture(scope="module")
def served(tenants_file: TenantsFile):
    path, keys = tenants_file(TENANTS, keys=("alice", "robots"))
    with ServerProcess(["--tenants", str(path), "--policy", "noop", "--planner", "tour", "--metrics-port", "0"]) as server:
        yield server, keys


def exchange(server: ServerProcess, key: str, messages: list[dict[str, Any]], replies: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        enc = Encoder()
        async with websockets.connect(server.uri, subprotocols=[SUBPROTOCOL], additional_headers={"Authorization": f"Api-Key {key}"}) as ws:
            hello = decode(await ws.recv())
            for m in messages:
                await ws.send(enc.encode(m))
            out = [decode(await asyncio.wait_for(ws.recv(), 10)) for _ in range(replies)]
            return hello, out

    return asyncio.run(main())


def observation(position: tuple[float, float], targets: list[tuple[int, float, float]]) -> dict[str, Any]:
    return {"position": np.array(position, dtype=np.float32), "targets": np.array(targets, dtype=np.float32).reshape(-1, 3)}


def test_plan_reply_carries_a_valid_plan_with_its_validity(served) -> None:
    server, keys = served
    msg = {"type": "plan", "id": "p1", "obs": observation((0.0, 0.0), [(3, 0.1, 0.0), (7, 0.02, 0.0), (9, 0.15, 0.05)]),
           "obs_time": 100.0, "instruction": "visit every target", "context": {"plan_id": "old-plan", "subtask": "t99"}}
    hello, [reply] = exchange(server, keys["alice"], [msg], 1)
    schema = hello["planners"]["tour"]["schema"]
    assert schema["required"] == ["steps", "note"] and hello["planners"]["tour"]["valid_for_s"] == 10.0
    parsed = parse_server_message(reply)
    assert parsed.type == "plan_reply" and parsed.id == "p1" and parsed.planner == "tour"
    assert [s["target"] for s in reply["plan"]["steps"]] == ["t7", "t3", "t9"]  # nearest first, a greedy tour
    assert reply["supersedes"] == "old-plan" and reply["expires"] == pytest.approx(110.0)
    assert reply["plan_id"] and reply["fingerprint"].startswith("sha256:") and reply["timing"]["server_ms"] >= 0


def test_refusals_are_typed_errors_and_infer_and_plan_share_one_id_space(served) -> None:
    server, keys = served
    good = observation((0.0, 0.0), [(1, 0.1, 0.0)])
    msgs = [
        {"type": "plan", "id": 1, "obs": {"position": np.zeros(3, np.float32), "targets": np.zeros((0, 3), np.float32)}},
        {"type": "plan", "id": 2, "obs": good, "planner": "nope"},
        {"type": "plan", "id": 3, "obs": {"position": np.array([np.nan, 0.0], np.float32), "targets": np.zeros((1, 3), np.float32)}},
        {"type": "plan", "id": 4, "obs": good, "deadline_ms": 2000.0},
    ]
    _, replies = exchange(server, keys["alice"], msgs, 4)
    by_id = {r["id"]: r for r in replies}
    assert by_id[1]["code"] == "invalid_observation" and by_id[2]["code"] == "unknown_model"
    assert by_id[3]["code"] == "invalid_observation" and by_id[4]["type"] == "plan_reply"
    hello, [forbidden] = exchange(server, keys["robots"], [{"type": "plan", "id": 1, "obs": good}], 1)
    assert hello["planners"] == {} and forbidden["code"] == "forbidden"


def test_metrics_and_ledger_count_plans_as_their_own_class(served) -> None:
    server, keys = served
    exchange(server, keys["alice"], [{"type": "plan", "id": i, "obs": observation((0, 0), [(1, 0.1, 0.1)])} for i in range(3)], 3)
    status, body = http_get("127.0.0.1", server.metrics_port, "/metrics")
    assert status == 200
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples if s.name == "chunkline_requests_total"]
    plans = sum(s.value for s in samples if s.labels.get("class") == "plan" and s.labels.get("outcome") == "ok")
    assert plans >= 3
    give_up = time.monotonic() + 10
    rows: list[tuple[str, str, int]] = []
    while time.monotonic() < give_up:  # the ledger writes in batches
        with sqlite3.connect(server.ledger_path) as db:
            rows = db.execute("SELECT class, model, COUNT(*) FROM requests WHERE class = 'plan' GROUP BY class, model").fetchall()
        if rows and rows[0][2] >= 3:
            break
        time.sleep(0.1)
    assert rows and rows[0][:2] == ("plan", "tour") and rows[0][2] >= 3


def test_both_client_libraries_plan_and_infer_on_one_connection(served) -> None:
    from chunkline.client import AsyncClient, Client, ServerError

    server, keys = served
    obs = observation((0.0, 0.0), [(3, 0.1, 0.0), (7, 0.02, 0.0)])
    with Client(server.uri, api_key=keys["alice"]) as client:
        reply = client.plan(obs, instruction="visit every target", obs_time=5.0, context={"plan_id": "old"}, planner="tour")
        assert [s["target"] for s in reply.plan["steps"]] == ["t7", "t3"]
        assert reply.supersedes == "old" and reply.expires == pytest.approx(15.0) and reply.timing["round_trip_ms"] > 0
        with pytest.raises(ServerError) as bad_obs:  # the same connection carries infer: its answer is its own
            client.infer({"state": np.zeros(8, np.float32)}, model="noop")
        assert bad_obs.value.code == "invalid_observation"
        with pytest.raises(ServerError) as refused:
            client.plan(obs, planner="nope")
        assert refused.value.code == "unknown_model"

    async def main() -> tuple[list[str], str]:
        async with AsyncClient(server.uri, api_key=keys["alice"]) as client:
            replies = await asyncio.gather(*(client.plan(obs, planner="tour", deadline_ms=5000) for _ in range(3)))
            return [r.plan_id for r in replies], replies[0].planner

    ids, planner = asyncio.run(main())
    assert len(set(ids)) == 3 and planner == "tour"


def test_the_plan_broker_runs_on_the_async_client_as_docs_planner_shows(served) -> None:
    from chunkline.broker.plan_broker import AsyncPlanBroker, PlanRequest
    from chunkline.client import AsyncClient

    server, keys = served
    obs = observation((0.0, 0.0), [(3, 0.1, 0.0), (7, 0.02, 0.0)])

    async def main() -> tuple[str, str | None, list[dict[str, Any]]]:
        sent: list[dict[str, Any]] = []
        answered = asyncio.Event()
        async with AsyncClient(server.uri, api_key=keys["alice"]) as client:
            async def request(req: PlanRequest) -> Any:
                sent.append(req.context())
                reply = await client.plan(obs, instruction="visit every target", obs_time=req.obs_time,
                                          context=req.context(), deadline_ms=req.deadline_ms, planner="tour")
                answered.set()
                return reply

            broker = AsyncPlanBroker(request, clock=time.monotonic)
            first = broker.tick()
            await asyncio.wait_for(answered.wait(), 10.0)
            await asyncio.sleep(0)  # let the request's task finish after its reply
            now = broker.tick()
            await broker.close()
            return first.skill, now.target, sent

    first_skill, target, sent = asyncio.run(main())
    assert first_skill == "hold" and target == "t7" and sent == [{}]
