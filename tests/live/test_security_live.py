"""Security against a real server with tenants: keys at rest, failure rate limits, secrets
kept out of logs, metrics and the ledger, tenant isolation, and no admin surface on the request
port.

The unit-level guarantees (constant-time comparison, IPv6 grouping, table bounds) are in
``test_auth.py``; ``test_security_auth.py`` adds properties over them.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import repo_paths
from prometheus_client.parser import text_string_to_metric_families
from tenants_files import POLICY_ONLY, TenantsFile
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from chunkline.bench.fuzz import RawWebSocket
from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.bench.soak import FAULT_POLICY_REF, MARK_RAISE
from chunkline.client import AsyncClient, ErrorCode, ServerError
from chunkline.client.wire.codec import decode, encode
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.server.core.tenants import add_key, revoke_key

GIVE_UP_S = 20.0  # hang guard
CANARY_PROMPT = "CANARY-prompt-5e1d0c"
CANARY_BYTES = b"CANARY-pixels-77a2b9"  # spelled out in an image's raw bytes

TENANTS = {"acme": POLICY_ONLY, "beta": POLICY_ONLY, "reserved": {**POLICY_ONLY, "models": ["faults"], "reserved_share": 0.5}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, tenants_file: TenantsFile) -> Iterator[tuple[ServerProcess, dict[str, str], Path]]:
    """A server with three tenants and two models: ``faults`` (two lanes, one request per batch:
    one lane is reserved for ``reserved``) and ``counter`` (stateful: counts a session's requests)."""
    tenants, keys = tenants_file(TENANTS, keys=("acme", "beta", "reserved"))
    config = tmp_path_factory.mktemp("security") / "server.toml"
    config.write_text(textwrap.dedent(f"""
        tenants = "{tenants}"
        metrics_port = 0

        [[policies]]
        ref = "{FAULT_POLICY_REF}"
        name = "faults"
        lanes = 2
        max_batch_size = 1
        default_deadline_ms = 10000

        [[policies]]
        ref = "policies_for_tests:counter"
        name = "counter"
        max_batch_size = 4
    """))
    with ServerProcess(["--config", str(config)], env=repo_paths.env_with_tests_on_path()) as server:
        yield server, keys, tenants


def obs(tag: float = 0.0, sleep_ms: float = 0.0, first: float = 0.0, prompt: str = "pick") -> dict[str, Any]:
    state = np.zeros(14, np.float32)
    state[0], state[1], state[2] = first, tag, sleep_ms
    return {"state": state, "prompt": prompt}


def aloha(prompt: str = "pick") -> dict[str, Any]:
    from helpers import aloha_obs

    o = aloha_obs()
    o["prompt"] = prompt
    return o


def metrics_text(server: ServerProcess) -> str:
    status, body = http_get(server.host, server.metrics_port, "/metrics")
    assert status == 200
    return body.decode()


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(metrics_text(server)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def handshake_status(server: ServerProcess, key: str | None, source: str = "127.0.0.1") -> int:
    headers = {"Authorization": f"Api-Key {key}"} if key is not None else None
    ws = RawWebSocket(server.host, server.port, headers=headers, source=source)
    try:
        return ws.status
    finally:
        ws.close()


# ---------------------------------------------------------------------------------- keys


def test_keys_are_stored_only_as_digests(deployment) -> None:
    _, keys, tenants = deployment
    text = tenants.read_text()
    for key in keys.values():
        assert key not in text and key[3:] not in text
        assert f"sha256:{hashlib.sha256(key.encode()).hexdigest()}" in text


def test_auth_failures_are_rate_limited_per_address(deployment) -> None:
    server, keys, _ = deployment
    before = metric(server, "chunkline_auth_failures_total", reason="rate_limited")
    # 127.0.0.3 makes failures until it is limited (burst 10); nobody else shares its bucket.
    statuses = [handshake_status(server, "ck_wrong" + str(i), source="127.0.0.3") for i in range(12)]
    assert statuses[:10] == [401] * 10 and statuses[10:] == [429, 429]
    assert handshake_status(server, keys["acme"], source="127.0.0.3") == 429  # even a good key waits
    ws = RawWebSocket(server.host, server.port, headers={"Authorization": "Api-Key nope"}, source="127.0.0.3")
    assert ws.status == 429 and "Retry-After:" in ws.response_head
    ws.close()
    assert handshake_status(server, keys["acme"], source="127.0.0.4") == 101  # another address is not
    assert handshake_status(server, None, source="127.0.0.4") == 401
    assert metric(server, "chunkline_auth_failures_total", reason="rate_limited") - before >= 4


def test_no_secret_or_observation_reaches_logs_metrics_or_ledger(deployment) -> None:
    server, keys, _ = deployment
    wrong_key = "ck_CANARYwrongkey0123456789"
    image_obs = aloha(CANARY_PROMPT)
    image = np.zeros((224, 224, 3), np.uint8)
    image.reshape(-1)[: len(CANARY_BYTES)] = np.frombuffer(CANARY_BYTES, np.uint8)
    image_obs["images/cam_high"] = image

    async def traffic() -> None:
        async with AsyncClient(server.uri, api_key=keys["acme"]) as client:
            await client.infer(obs(prompt=CANARY_PROMPT), model="faults", deadline_ms=5000)
            await client.infer({**obs(), "extra": CANARY_PROMPT}, model="faults", deadline_ms=5000)
            for bad in ({"state": np.zeros(3, np.float32), "prompt": CANARY_PROMPT},  # wrong shape
                        {**obs(), "prompt": CANARY_PROMPT * 40},  # too long
                        obs(first=MARK_RAISE, prompt=CANARY_PROMPT)):  # the policy raises
                with pytest.raises(ServerError):
                    await client.infer(bad, model="faults", deadline_ms=5000)
            with pytest.raises(ServerError):
                await client.infer(image_obs, model="no-such-model", deadline_ms=5000)
        with pytest.raises(ServerError):
            await AsyncClient.connect(server.uri, api_key=wrong_key, connect_timeout=1)
        # openpi-compatible mode: the observation travels bare, and an error is a text frame
        async with connect(server.uri, additional_headers={"Authorization": f"Bearer {keys['acme']}"}) as ws:
            await ws.recv()
            await ws.send(encode({**obs(prompt=CANARY_PROMPT), "state": np.zeros(2, np.float32)}))
            text = await ws.recv()
            assert isinstance(text, str) and CANARY_PROMPT not in text

    asyncio.run(traffic())
    time.sleep(1.3)  # the ledger writes within a second
    secrets = [CANARY_PROMPT, CANARY_BYTES.decode(), wrong_key, *keys.values(), *(k[3:] for k in keys.values())]
    places = {
        "log": server.log_path.read_bytes(),
        "metrics": metrics_text(server).encode(),
        "ledger": b"".join(p.read_bytes() for p in server.ledger_path.parent.glob(server.ledger_path.name + "*")),
    }
    # The scan is not vacuous: the traffic left its marks (a logged policy failure, ledger rows).
    assert b"InjectedPolicyFailure" in places["log"] and b"faults" in places["ledger"]
    for where, data in places.items():
        for secret in secrets:
            assert secret.encode() not in data, f"{secret[:14]}... found in the {where}"


# ---------------------------------------------------------------------------------- isolation


def test_a_tenant_sees_only_its_own_models_and_session(deployment) -> None:
    server, keys, _ = deployment

    async def go() -> tuple[Any, Any, Any]:
        async with AsyncClient(server.uri, api_key=keys["reserved"]) as r, AsyncClient(server.uri, api_key=keys["acme"]) as a:
            with pytest.raises(ServerError) as info:
                await r.infer(aloha(), model="counter")
            return r.hello, a.hello, info.value

    r, a, refused = asyncio.run(go())
    assert set(r.models) == {"faults"} and set(a.models) == {"faults", "counter"}
    assert refused.code == ErrorCode.UNKNOWN_MODEL  # an ungranted model is not even named as existing
    assert r.session != a.session and len(r.session) >= 16  # unguessable, per session


def test_tenants_never_see_or_touch_each_others_requests(deployment) -> None:
    server, keys, _ = deployment

    async def go() -> tuple[list[dict], list[dict]]:
        a = await connect(server.uri, subprotocols=[SUBPROTOCOL], additional_headers={"Authorization": f"Api-Key {keys['acme']}"})
        b = await connect(server.uri, subprotocols=[SUBPROTOCOL], additional_headers={"Authorization": f"Api-Key {keys['beta']}"})
        try:
            decode(await a.recv()), decode(await b.recv())
            # Both use request id 7; beta's is slow. acme cancels "7" and sends garbage.
            await b.send(encode({"type": "infer", "id": 7, "model": "faults", "obs": obs(sleep_ms=300), "deadline_ms": 5000}))
            await a.send(encode({"type": "infer", "id": 7, "model": "faults", "obs": obs(sleep_ms=300), "deadline_ms": 5000}))
            await asyncio.sleep(0.05)
            await a.send(encode({"type": "cancel", "id": 7}))
            await a.send(b"\xc1 not msgpack")
            got_a = [decode(await asyncio.wait_for(a.recv(), GIVE_UP_S)) for _ in range(2)]
            got_b = [decode(await asyncio.wait_for(b.recv(), GIVE_UP_S))]
            # Nothing else arrives for beta: acme's cancel, error and garbage stayed with acme.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(b.recv(), 0.5)
            return got_a, got_b
        finally:
            await a.close()
            await b.close()

    got_a, got_b = asyncio.run(go())
    assert sorted((m["type"], m.get("code")) for m in got_a) == [("error", "cancelled"), ("error", "invalid_message")]
    assert got_b[0]["type"] == "chunk" and got_b[0]["id"] == 7


def test_policy_state_is_per_session(deployment) -> None:
    server, keys, _ = deployment

    async def counts(key: str, n: int) -> list[float]:
        async with AsyncClient(server.uri, api_key=key) as client:
            return [float((await client.infer(aloha(), model="counter", deadline_ms=5000)).actions[0, 0]) for _ in range(n)]

    async def go() -> tuple[list[float], list[float], list[float]]:
        return await asyncio.gather(counts(keys["acme"], 3), counts(keys["beta"], 3), counts(keys["acme"], 2))

    acme, beta, acme_again = asyncio.run(go())
    assert acme == [1.0, 2.0, 3.0] and beta == [1.0, 2.0, 3.0] and acme_again == [1.0, 2.0]


def test_reserved_capacity_is_held_for_its_tenant(deployment) -> None:
    server, keys, _ = deployment

    async def go() -> tuple[list[np.ndarray], np.ndarray]:
        async with AsyncClient(server.uri, api_key=keys["acme"]) as a, AsyncClient(server.uri, api_key=keys["reserved"]) as r:
            # Long batches: the instant between two of acme's batches is a sliver of the time.
            flood = [asyncio.create_task(a.infer(obs(tag=1, sleep_ms=600), model="faults", deadline_ms=10_000)) for _ in range(4)]
            give_up = time.monotonic() + GIVE_UP_S
            while await asyncio.to_thread(metric, server, "chunkline_queue_depth", model="faults") < 2:
                assert time.monotonic() < give_up
                await asyncio.sleep(0.01)
            mine = await r.infer(obs(tag=2, sleep_ms=100), model="faults", deadline_ms=10_000)
            return [f.actions for f in await asyncio.gather(*flood)], mine.actions

    flood, mine = asyncio.run(go())
    # acme never ran two batches at once although two lanes exist: one is held for `reserved`...
    assert max(float(x[0, 0]) for x in flood) == 1.0
    # ... which used it while acme's queue was still long: it ran beside one of acme's batches.
    assert float(mine[0, 1]) == 2.0


# ---------------------------------------------------------------------------------- admin surface


def _raw_http(server: ServerProcess, request: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(request)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def test_no_admin_operation_is_reachable_from_the_request_port(deployment) -> None:
    server, keys, tenants = deployment
    before = tenants.read_bytes()
    reloads = server.log().count("reloaded")
    auth = {"Authorization": f"Api-Key {keys['acme']}"}
    for path in ("/metrics", "/admin", "/keys", "/reload", "/tenants", "/sessions", "/usage", "/ledger", "/debug",
                 "/v1/keys", "/admin/reload", "/../tenants.toml", "/healthz/../metrics"):
        status, _ = http_get(server.host, server.port, path, headers=auth)
        assert status in (404, 400), (path, status)
    for method in ("POST", "PUT", "DELETE"):
        reply = _raw_http(server, f"{method} /reload HTTP/1.1\r\nHost: x\r\nAuthorization: Api-Key {keys['acme']}\r\n"
                                  "Content-Length: 0\r\n\r\n".encode())
        assert not reply.startswith(b"HTTP/1.1 2"), reply[:80]
    assert tenants.read_bytes() == before
    assert server.log().count("reloaded") == reloads
    # The metrics port serves /metrics only, and no sessions.
    assert http_get(server.host, server.metrics_port, "/admin")[0] == 404

    async def session_on_metrics_port() -> int | None:
        try:
            async with connect(f"ws://{server.host}:{server.metrics_port}", subprotocols=[SUBPROTOCOL]) as ws:
                await asyncio.wait_for(ws.recv(), GIVE_UP_S)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None
        except Exception:  # refused at the handshake is fine too
            return 0
        return None

    assert asyncio.run(session_on_metrics_port()) in (0, 1008)


def reload(server: ServerProcess) -> None:
    """SIGHUP, then wait for the server to say it reloaded the tenants file."""
    done = server.log().count("tenants file reloaded")
    assert server.proc is not None
    server.proc.send_signal(signal.SIGHUP)
    give_up = time.monotonic() + GIVE_UP_S
    while server.log().count("tenants file reloaded") == done:
        assert time.monotonic() < give_up
        time.sleep(0.02)


def test_keys_change_only_through_the_file_and_a_signal(deployment) -> None:
    server, keys, tenants = deployment
    new_key, _ = add_key(tenants, "beta")
    assert handshake_status(server, new_key, source="127.0.0.5") == 401  # not before a reload
    reload(server)
    assert handshake_status(server, new_key, source="127.0.0.5") == 101


def test_a_revoked_key_loses_its_open_session(deployment) -> None:
    server, _, tenants = deployment
    key, entry = add_key(tenants, "acme")
    reload(server)

    async def go() -> int | None:
        async with connect(server.uri, subprotocols=[SUBPROTOCOL], additional_headers={"Authorization": f"Api-Key {key}"}) as ws:
            await ws.recv()
            revoke_key(tenants, entry.id)
            await asyncio.to_thread(reload, server)
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 3.0)
            except ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else None
            except asyncio.TimeoutError:
                return None  # still open

    assert asyncio.run(go()) == 1008
    assert handshake_status(server, key, source="127.0.0.6") == 401
