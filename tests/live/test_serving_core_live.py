"""The serving core against a real server on loopback: auth, grants, quotas, metrics, ledger."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import time
from pathlib import Path

import pytest
from helpers import aloha_obs
from prometheus_client.parser import text_string_to_metric_families
from tenants_files import POLICY_ONLY, TenantsFile
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import AsyncClient, Client, ErrorCode, ServerError
from chunkline.client.wire.protocol import SUBPROTOCOL

TENANTS = {
    "acme": {**POLICY_ONLY, "models": ["noop"]},
    "tiny": {**POLICY_ONLY, "limits": {"max_sessions": 1, "rate_per_s": 0.5, "burst": 2}},
    "other": {**POLICY_ONLY, "models": ["sleep:0.2"]},
}


@pytest.fixture(scope="module")
def keyed(tenants_file: TenantsFile):
    path, keys = tenants_file(TENANTS, keys=("acme", "tiny", "other"))
    with ServerProcess(["--tenants", str(path), "--policy", "noop", "--policy", "sleep:0.2", "--metrics-port", "0",
                        "--max-batch-size", "1"]) as server:
        yield server, keys, path


def test_handshake_without_or_with_a_wrong_key_is_401(keyed) -> None:
    server, keys, _ = keyed

    async def status(headers):
        try:
            async with connect(server.uri, subprotocols=[SUBPROTOCOL], additional_headers=headers):
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    assert asyncio.run(status(None)) == 401
    assert asyncio.run(status({"Authorization": "Api-Key ck_not_a_key"})) == 401
    assert asyncio.run(status({"Authorization": f"Api-Key {keys['acme']}"})) == 101
    assert asyncio.run(status({"Authorization": f"Bearer {keys['acme']}"})) == 101
    # Plain HTTP is authenticated too; probes are open.
    assert http_get("127.0.0.1", server.port, "/anything")[0] == 401
    assert http_get("127.0.0.1", server.port, "/healthz")[0] == 200


def test_401_is_answered_before_any_payload_is_read(keyed) -> None:
    server, _, _ = keyed
    request = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(request)  # headers only: the refusal must not wait for any payload
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 401")
        assert sock.recv(4096) == b""  # and the connection is closed, nothing more is read


def test_grants_are_enforced(keyed) -> None:
    server, keys, _ = keyed
    with Client.connect(server.uri, api_key=keys["acme"]) as client:
        assert client.hello is not None and set(client.hello.models) == {"noop"}  # only what it may use
        assert client.infer(aloha_obs()).actions.shape == (50, 14)
        with pytest.raises(ServerError) as info:
            client.infer(aloha_obs(), model="sleep:0.2")
        assert info.value.code == ErrorCode.UNKNOWN_MODEL


def test_compat_mode_refuses_an_ungranted_default_model(keyed) -> None:
    server, keys, _ = keyed

    async def go():
        async with connect(server.uri, additional_headers={"Authorization": f"Api-Key {keys['other']}"}) as ws:
            return await ws.recv()

    text = asyncio.run(go())
    assert isinstance(text, str) and text.startswith("forbidden")


def test_session_and_rate_quotas(keyed) -> None:
    server, keys, _ = keyed
    with Client.connect(server.uri, api_key=keys["tiny"]) as client:
        with pytest.raises(ServerError) as second:
            Client.connect(server.uri, api_key=keys["tiny"], connect_timeout=1)
        assert "429" in str(second.value) or second.value.code == ErrorCode.QUOTA_EXCEEDED
        codes = []
        for _ in range(4):
            try:
                client.infer(aloha_obs())
                codes.append("ok")
            except ServerError as exc:
                codes.append(exc.code)
                assert "rate" in exc.message
        assert codes[:2] == ["ok", "ok"] and ErrorCode.QUOTA_EXCEEDED in codes[2:]


def _metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    status, body = http_get("127.0.0.1", server.metrics_port, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_count_the_requests_sent(keyed) -> None:
    server, keys, _ = keyed
    key = ("chunkline_requests_total", (("class", "policy"), ("model", "noop"), ("outcome", "ok"), ("tenant", "acme")))
    before = _metrics(server).get(key, 0.0)
    with Client.connect(server.uri, api_key=keys["acme"]) as client:
        for _ in range(5):
            client.infer(aloha_obs())
    after = _metrics(server)
    assert after[key] - before == 5
    assert any(name == "chunkline_server_latency_seconds_count" for name, _ in after)
    assert after[("chunkline_ledger_healthy", ())] == 1.0
    # Tenants cannot read metrics on the request port.
    assert http_get("127.0.0.1", server.port, "/metrics", headers={"Authorization": f"Api-Key {keys['acme']}"})[0] == 404


def test_ledger_rows_equal_admitted_requests(tmp_path: Path) -> None:
    admitted = refused = 0
    with ServerProcess(["--policy", "sleep:0.2", "--max-batch-size", "1", "--ledger", str(tmp_path / "l.db")]) as server:
        async def go():
            nonlocal admitted, refused
            async with AsyncClient(server.uri) as client:
                running = [asyncio.create_task(client.infer(aloha_obs(i), deadline_ms=5000)) for i in range(3)]
                await asyncio.sleep(0.05)
                victim = asyncio.create_task(client.infer(aloha_obs(9), deadline_ms=5000))
                await asyncio.sleep(0.05)
                victim.cancel()  # admitted, then cancelled while queued
                with pytest.raises(ServerError) as door:
                    await client.infer(aloha_obs(), deadline_ms=20)  # cannot finish: refused at the door
                assert door.value.code in (ErrorCode.DEADLINE_UNMEETABLE, ErrorCode.DEADLINE_EXCEEDED)
                refused += 1
                await asyncio.gather(*running)
                admitted += 4
            # A session that disconnects with a request queued behind a running one.
            other = await AsyncClient.connect(server.uri)
            first = asyncio.create_task(other.infer(aloha_obs(), deadline_ms=5000))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(other.infer(aloha_obs(), deadline_ms=5000))
            await asyncio.sleep(0.05)
            await other.close()
            await asyncio.gather(first, second, return_exceptions=True)
            admitted += 2

        asyncio.run(go())
        time.sleep(0.3)
    rows = sqlite3.connect(tmp_path / "l.db").execute("SELECT outcome, COUNT(*) FROM requests GROUP BY outcome").fetchall()
    outcomes = dict(rows)
    assert sum(outcomes.values()) == admitted, outcomes
    assert outcomes.get("ok", 0) >= 3 and outcomes.get("cancelled", 0) >= 2
