"""Every case of issue #15 ("the defects a hostile client found") replayed against a live
``chunkline serve`` process with tenants, the robot WebSocket port and the OpenAI-compatible HTTP
port, and the exhaustion acceptance: a robot's round trip under an HTTP connection flood at twice
the cap.

Covered elsewhere, and referenced rather than repeated:

* ids reused across classes, the one in-flight limit of every class, ledger ids unique across
  models and classes: ``test_serving_core.py`` (live, ``test_an_infer_may_not_reuse_the_id_of_a_
  generate_in_flight``, ``test_the_in_flight_limit_counts_every_class``, ``test_ledger_request_ids_
  are_unique_across_models_and_classes``); the ledger check is also made after the drain below;
* the HTTP listener's limits in-process (``test_text_http.py``), the auth rate limit's unit rules
  (``test_auth.py``), the receive budget's bookkeeping (``test_hostile_receive_budget.py``), the
  published schema (``test_hostile_openapi.py``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import repo_paths
from prometheus_client.parser import text_string_to_metric_families
from tenants_files import TenantsFile
from wire_helpers import closed_by_server, exchange, native_session, smuggle

from chunkline.bench.fuzz import RawWebSocket
from chunkline.bench.fuzz.rawws import RawFrame, frame_bytes
from chunkline.bench.serverproc import ServerProcess, http_get
from chunkline.client import AsyncClient
from chunkline.client.wire.codec import encode
from chunkline.client.wire.protocol import SUBPROTOCOL

CAP = 16  # max_connections, on both ports
HEAD_DEADLINE_S = 1.0  # open_timeout_s: the WebSocket handshake and the HTTP request head
IN_FLIGHT = 8
MIB = 1 << 20
BUDGET = 48 * MIB  # max_receive_buffer_bytes; one tenant may hold half of it
GIVE_UP_S = 20.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, tenants_file: TenantsFile) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    tenants, keys = tenants_file(keys=("acme", "fleet", "mallory"))
    config = tmp_path_factory.mktemp("hostile") / "server.toml"
    config.write_text(textwrap.dedent(f"""
        tenants = "{tenants}"
        metrics_port = 0
        http_port = 0
        max_connections = {CAP}
        open_timeout_s = {HEAD_DEADLINE_S}
        max_in_flight_per_session = {IN_FLIGHT}
        max_receive_buffer_bytes = {BUDGET}
        tenant_receive_buffer_share = 0.5

        [[policies]]
        ref = "noop"

        [[text]]
        name = "tiny"
    """))
    with ServerProcess(["--config", str(config)], env=repo_paths.env_with_tests_on_path()) as server:
        yield server, keys


# ---------------------------------------------------------------------------------- helpers


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    status, body = http_get(server.host, server.metrics_port, "/metrics")
    assert status == 200
    return sum(s.value for family in text_string_to_metric_families(body.decode()) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def rss_mib(server: ServerProcess) -> float:
    assert server.proc is not None
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def handshake(key: str | None, source: str | None = None, extra: str = "") -> bytes:
    auth = f"Authorization: Api-Key {key}\r\n" if key else ""
    return (f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\n{auth}{extra}\r\n").encode()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def generate(i: int, **fields: Any) -> bytes:
    return encode({"type": "generate", "id": i, "prompt": "hello", "max_tokens": 250, "ignore_eos": True, **fields})


def infer(i: int, **fields: Any) -> bytes:
    from helpers import aloha_obs

    return encode({"type": "infer", "id": i, "obs": aloha_obs(i), "obs_time": 0.0, **fields})


# ---------------------------------------------------------------------------------- HTTP port


def test_idle_http_connections_at_twice_the_cap_are_reaped_and_leave_both_ports_serving(deployment) -> None:
    server, keys = deployment
    models = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['acme']}\r\n\r\n".encode()
    idle = [socket.create_connection(("127.0.0.1", server.http_port), timeout=10) for _ in range(2 * CAP)]
    try:
        assert status_of(exchange(server.http_port, models)) in (0, 200, 503)  # answered or cleanly refused (503, or closed at accept: 0), never hung
        assert http_get(server.host, server.port, "/healthz")[0] == 200  # the robot port is untouched
        start = time.monotonic()
        assert all(closed_by_server(s, 10 * HEAD_DEADLINE_S) for s in idle)  # reaped at the head deadline
        assert time.monotonic() - start < 10 * HEAD_DEADLINE_S
    finally:
        for s in idle:
            s.close()
    assert status_of(exchange(server.http_port, models)) == 200


def test_a_head_sent_header_by_header_is_cut_at_the_head_deadline(deployment) -> None:
    server, keys = deployment
    lines = [b"GET /v1/models HTTP/1.1\r\n", b"Host: x\r\n", f"Authorization: Bearer {keys['acme']}\r\n".encode()]
    lines += [f"X-Slow-{i}: {'y' * 40}\r\n".encode() for i in range(40)]
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        start = time.monotonic()
        cut = False
        for line in lines:  # one header every 0.25 s, each well within any per-byte idle timer
            try:
                s.sendall(line)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            if closed_by_server(s, 0.25):
                cut = True
                break
        elapsed = time.monotonic() - start
    assert cut and elapsed < 4 * HEAD_DEADLINE_S, elapsed


@pytest.mark.slow
def test_a_pipelined_flood_is_not_buffered_without_bound(deployment) -> None:
    server, _ = deployment
    before = rss_mib(server)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.setblocking(False)
        block = request * 4096
        give_up = time.monotonic() + 5.0
        while sent < 256 * MIB and time.monotonic() < give_up:  # never reading the answers
            try:
                sent += s.send(block)
            except BlockingIOError:
                time.sleep(0.01)  # let the server drain what it will; it must stop reading
            except (BrokenPipeError, ConnectionResetError):
                break
        grown = rss_mib(server) - before
    assert sent < 64 * MIB and grown < 64, (sent, grown)


def test_content_length_with_transfer_encoding_is_a_400_and_closes(deployment) -> None:
    server, keys = deployment
    answer, closed = smuggle(server.http_port, keys["acme"])
    assert answer.startswith(b"HTTP/1.1 400 ") and closed


def test_deeply_nested_json_is_a_400(deployment) -> None:
    server, keys = deployment
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/completions", content=b"[" * 200_000 + b"]" * 200_000,
                   headers={"Authorization": f"Bearer {keys['acme']}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_an_hour_long_deadline_is_a_budget_not_a_hold_and_longer_ones_are_refused(deployment) -> None:
    server, keys = deployment
    url, auth = f"http://127.0.0.1:{server.http_port}/v1/completions", {"Authorization": f"Bearer {keys['acme']}"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    start = time.monotonic()
    r = httpx.post(url, json=body, headers={**auth, "X-Chunkline-Deadline-Ms": "3600000"}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - start < 10  # served at once: the deadline is only a bound
    for bad in ("3600001", "1e309", "nan", "-5", "soon"):
        r = httpx.post(url, json=body, headers={**auth, "X-Chunkline-Deadline-Ms": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "deadline_ms", bad


# ---------------------------------------------------------------------------------- authentication


def test_two_authorization_headers_are_a_counted_400_on_both_ports(deployment) -> None:
    server, keys = deployment
    before = metric(server, "chunkline_auth_failures_total", reason="malformed")
    two = f"Authorization: Api-Key {keys['acme']}\r\nAuthorization: Api-Key {keys['acme']}\r\n"
    http = exchange(server.http_port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{two}\r\n".encode(), source="127.0.0.31")
    assert status_of(http) == 400 and json.loads(http.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_request"
    ws = exchange(server.port, handshake(None, extra=two), source="127.0.0.32")
    assert status_of(ws) == 400
    assert ws.partition(b"\r\n\r\n")[2] == b"send one Authorization header, not several\n"  # one clear line
    assert metric(server, "chunkline_auth_failures_total", reason="malformed") - before == 2
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "MultipleValuesError" not in log


def test_a_stale_key_behind_a_shared_address_does_not_lock_out_the_fleet(deployment) -> None:
    server, keys = deployment
    nat = "127.0.0.41"  # one address for the whole fleet
    stale = "ck_revokedlongago0000000000000000000000000000"
    statuses = [status_of(exchange(server.port, handshake(stale), source=nat)) for _ in range(14)]
    assert statuses[:10] == [401] * 10 and set(statuses[10:]) == {429}  # the stale robot is throttled ...
    for _ in range(3):  # ... while every other robot behind the address gets in, on both ports
        assert status_of(exchange(server.port, handshake(keys["fleet"]), source=nat)) == 101
        models = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['acme']}\r\n\r\n".encode()
        assert status_of(exchange(server.http_port, models, source=nat)) == 200
        assert status_of(exchange(server.port, handshake(stale), source=nat)) == 429
    # A guesser (many distinct keys) is limited, and then even a valid key never used from there waits.
    guesser = "127.0.0.42"
    guesses = [status_of(exchange(server.port, handshake(f"ck_guess{i:040d}"), source=guesser)) for i in range(12)]
    assert guesses[:10] == [401] * 10 and set(guesses[10:]) == {429}
    assert status_of(exchange(server.port, handshake(keys["mallory"]), source=guesser)) == 429


# ---------------------------------------------------------------------------------- WebSocket port


def test_numbers_on_the_wire_are_numbers_on_both_protocols(deployment) -> None:
    server, keys = deployment
    finals = asyncio.run(native_session(server, [
        infer(1, deadline_ms="100"), generate(2, max_tokens="5"), generate(3, temperature=True), infer(4, deadline_ms=5000)], 4, key=keys["acme"]))
    by_id = {m["id"]: m for m in finals}
    for i, field in ((1, "deadline_ms"), (2, "max_tokens"), (3, "temperature")):
        assert by_id[i]["type"] == "error" and by_id[i]["code"] == "invalid_message" and field in by_id[i]["message"]
    assert by_id[4]["type"] == "chunk"  # the session goes on
    url, auth = f"http://127.0.0.1:{server.http_port}/v1/completions", {"Authorization": f"Bearer {keys['acme']}"}
    for field, value in (("deadline_ms", "100"), ("max_tokens", "5"), ("temperature", True), ("deadline_ms", False)):
        r = httpx.post(url, json={"model": "tiny", "prompt": "hi", field: value}, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value)


def test_an_id_in_flight_in_one_class_is_refused_in_the_other(deployment) -> None:
    """The live replay; ``test_serving_core.py`` has the same on a server without tenants."""
    server, keys = deployment
    finals = asyncio.run(native_session(server, [generate(1), infer(1, deadline_ms=5000)], 1, key=keys["acme"]))
    assert finals[0]["type"] == "error" and finals[0]["id"] == 1 and finals[0]["code"] == "duplicate_id"


def test_a_hundred_generates_on_one_session_meet_the_in_flight_limit(deployment) -> None:
    server, keys = deployment
    finals = asyncio.run(native_session(server, [generate(i) for i in range(100)], 100, key=keys["acme"]))
    assert sorted(m["id"] for m in finals) == list(range(100))  # every request answered exactly once
    done = [m for m in finals if m["type"] == "done"]
    refused = [m for m in finals if m["type"] == "error"]
    assert {m["code"] for m in refused} == {"overloaded"} and all(m.get("retry_after_ms") for m in refused)
    # The first IN_FLIGHT run; a slot freed while the burst still arrives may take one more.
    assert IN_FLIGHT <= len(done) <= 2 * IN_FLIGHT and {m["id"] for m in done} >= set(range(IN_FLIGHT))


@pytest.mark.slow
def test_unfinished_frames_are_bounded_by_the_receive_budget(deployment) -> None:
    server, keys = deployment
    before_rss = rss_mib(server)
    before = metric(server, "chunkline_refusals_total", reason="receive_budget")
    # 12 MiB of a frame that claims 16 MiB (the largest message allowed), never finished.
    half_frame = frame_bytes(RawFrame(2, b"\0" * (12 * MIB), claimed_length=16 * MIB))[: 12 * MIB]
    held: list[RawWebSocket] = []
    try:
        for _ in range(6):
            ws = RawWebSocket(server.host, server.port, headers={"Authorization": f"Api-Key {keys['mallory']}"}, timeout=10)
            assert ws.status == 101
            ws.read_frame()  # hello
            ws.send(half_frame)
            held.append(ws)

        async def robot() -> float:
            async with AsyncClient(server.uri, api_key=keys["acme"]) as client:
                from helpers import aloha_obs

                chunk = await client.infer(aloha_obs(0), deadline_ms=5000)
                return float(chunk.actions.shape[0])

        assert asyncio.run(robot()) > 0  # a normal robot of another tenant is served meanwhile
        closed = []
        for ws in held:
            ws.sock.settimeout(2.0)
            try:
                _, code = ws.read_messages(4)
                closed.append(code)
            except TimeoutError:
                pass  # still held: within the tenant's share
        # mallory may hold half of the budget (24 MiB): two 12 MiB frames; the rest were closed with 1013.
        assert closed == [1013] * 4, closed
        assert metric(server, "chunkline_refusals_total", reason="receive_budget") - before == 4
        assert rss_mib(server) - before_rss < BUDGET / MIB + 32  # 72 MiB were sent; at most the budget stays
    finally:
        for ws in held:
            ws.close()


# ---------------------------------------------------------------------------------- the exhaustion acceptance

FLOODER = textwrap.dedent("""
    import socket, sys, threading, time
    port, n = int(sys.argv[1]), int(sys.argv[2])
    def hold():
        while True:  # a slow head on every connection, reconnecting as soon as the server cuts it
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /v1/models HTTP/1.1\\r\\n")
                while True:
                    time.sleep(0.2)
                    s.sendall(b"X-Slow: y\\r\\n")
            except OSError:
                time.sleep(0.01)
    for _ in range(n):
        threading.Thread(target=hold, daemon=True).start()
    time.sleep(3600)
""")


@pytest.mark.slow
def test_a_robot_keeps_its_round_trip_under_an_http_connection_flood(deployment) -> None:
    """Idle, flood, idle, flood (``2 * CAP`` connections held on the HTTP port, each sending a
    header every 0.2 s and reconnecting when cut): the robot's round trip on the WebSocket port
    in each condition. Bounds are tolerant of a loaded 2-core machine; the figures are printed."""
    server, keys = deployment
    from helpers import aloha_obs

    obs = aloha_obs(0)
    per_block = 1000

    async def block(client: AsyncClient) -> list[float]:
        out = []
        for _ in range(per_block):
            start = time.perf_counter()
            await client.infer(obs, deadline_ms=5000)
            out.append((time.perf_counter() - start) * 1000)
        return out

    def flood() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", FLOODER, str(server.http_port), str(2 * CAP)])
        give_up = time.monotonic() + GIVE_UP_S
        while exchange_status(server.http_port) != 503:  # the cap is full
            assert time.monotonic() < give_up
            time.sleep(0.05)
        return proc

    def exchange_status(port: int) -> int:
        return status_of(exchange(port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys['acme']}\r\n\r\n".encode(),
                                  timeout=5))

    samples: dict[str, list[float]] = {"idle": [], "flood": []}

    async def run() -> None:
        async with AsyncClient(server.uri, api_key=keys["fleet"]) as client:
            await block(client)  # warm-up
            for condition in ("idle", "flood", "idle", "flood"):
                proc = await asyncio.to_thread(flood) if condition == "flood" else None
                try:
                    samples[condition] += await block(client)
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()

    asyncio.run(run())
    figures = {c: (statistics.median(v), float(np.percentile(v, 99))) for c, v in samples.items()}
    ratio_median = figures["flood"][0] / figures["idle"][0]
    ratio_p99 = figures["flood"][1] / figures["idle"][1]
    print(f"\nrobot round trip (ms), {2 * per_block} per condition, HTTP flood of {2 * CAP} held connections (cap {CAP}): "
          f"idle median {figures['idle'][0]:.2f} p99 {figures['idle'][1]:.2f}; flood median {figures['flood'][0]:.2f} "
          f"p99 {figures['flood'][1]:.2f}; ratio median {ratio_median:.2f} p99 {ratio_p99:.2f}")
    assert ratio_median < 1.5 and ratio_p99 < 3.0, figures


# ---------------------------------------------------------------------------------- the drain


def test_sigterm_while_text_requests_keep_arriving(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Requests keep coming while the server drains: each is answered 200, or refused 503
    ``shutting_down``, or finds the port closed; a stream started before finishes; exit 0; the
    ledger's request ids are unique across classes."""
    folder = tmp_path_factory.mktemp("drain")
    ledger = folder / "ledger.db"
    with ServerProcess(["--policy", "noop", "--no-auth", "--text-model", "tiny", "--http-port", "0", "--ledger", str(ledger)]) as server:
        base = f"http://127.0.0.1:{server.http_port}/v1"
        outcomes: list[str] = []
        stop = threading.Event()

        def keep_asking() -> None:
            with httpx.Client(timeout=30) as http:
                while not stop.is_set() and len(outcomes) < 10_000:
                    try:
                        r = http.post(f"{base}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
                    except httpx.TransportError:
                        outcomes.append("closed")
                        continue
                    outcomes.append(str(r.status_code) if r.status_code != 503 else f"503:{r.json()['error']['code']}")

        askers = [threading.Thread(target=keep_asking) for _ in range(3)]
        for t in askers:
            t.start()
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{base}/completions", json={"model": "tiny", "prompt": "go", "max_tokens": 60, "stream": True,
                                                     "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            give_up = time.monotonic() + GIVE_UP_S
            while "200" not in outcomes:
                assert time.monotonic() < give_up
                time.sleep(0.01)
            server.terminate()
            rest = [line for line in lines if line.startswith("data: ")]
        assert first and rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert server.proc is not None and server.proc.wait(30) == 0
        stop.set()
        for t in askers:
            t.join(30)
    assert set(outcomes) <= {"200", "503:shutting_down", "closed"} and "200" in outcomes, set(outcomes)
    with sqlite3.connect(ledger) as db:
        ids = [r[0] for r in db.execute("SELECT request_id FROM requests")]
    assert ids and len(set(ids)) == len(ids)
