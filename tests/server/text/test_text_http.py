"""The HTTP listener (uvicorn in the server's loop) against live servers on 127.0.0.1: the defects of
issue #15 (connection cap and head deadline, bounded pipelining, Content-Length with
Transfer-Encoding, deeply nested JSON, two Authorization headers), open probes, reason phrases,
``max_model_len``, the drain, client-disconnect detection, and the lean client transport's reuse."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from text_helpers import ServiceHandle, StepGate, registry_with_keys, small_model
from wire_helpers import closed_by_server as _closed_by_server
from wire_helpers import exchange as _exchange
from wire_helpers import smuggle

from chunkline.server.config import PolicyConfig, ServerConfig
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.core.tenants import TenantInfo
from chunkline.server.entrypoints.app import ChunklineServer
from chunkline.server.entrypoints.http import HttpLimits
from chunkline.server.text.transport import H11Transport

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback

HEAD_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[ServiceHandle, str, StepGate]]:
    loop = LoopThread()
    gate = StepGate()
    reg, keys = registry_with_keys({"alice": TenantInfo("alice")})
    limits = HttpLimits(max_connections=8, head_timeout_s=HEAD_TIMEOUT_S, graceful_timeout_s=5.0)
    handle = ServiceHandle([small_model("tiny")], loop, reg, yield_to=gate, limits=limits).start()
    try:
        yield handle, keys["alice"], gate
    finally:
        gate.open()
        handle.close()
        loop.close()


def test_probes_are_open_and_say_only_ready_or_not(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, _, _ = env
    assert _exchange(handle.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200 OK\r\n")
    ready = _exchange(handle.port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ready.startswith(b"HTTP/1.1 200 OK\r\n") and ready.endswith(b"\r\n\r\nready")
    # every status line has its reason phrase
    assert _exchange(handle.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 401 Unauthorized\r\n")


def test_models_report_max_model_len(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, key, _ = env
    r = httpx.get(f"{handle.base_url}/models", headers={"Authorization": f"Bearer {key}"})
    assert r.json()["data"] == [{"id": "tiny", "object": "model", "created": handle.service.created, "owned_by": "chunkline",
                                 "max_model_len": 256}]


def test_two_authorization_headers_are_a_400(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, key, _ = env
    reply = _exchange(handle.port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                                   f"Authorization: Bearer {key}\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n")


def test_content_length_with_transfer_encoding_is_a_400_and_closes(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, key, _ = env
    answer, closed = smuggle(handle.port, key)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and closed


def test_deeply_nested_json_is_a_400(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, key, _ = env
    body = b"[" * 200_000 + b"]" * 200_000
    r = httpx.post(f"{handle.base_url}/completions", content=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_pipelined_bytes_are_not_buffered_without_bound(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, _, _ = env
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    budget = 256 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", handle.port), timeout=10) as s:
        s.setblocking(False)
        sent = 0
        block = request * 4096
        while sent < budget:  # never reading the answers: the server must stop reading too
            try:
                sent += s.send(block)
            except BlockingIOError:
                break
    # What was taken is what the kernel's buffers and one read chunk hold, far below the budget.
    assert sent < 64 * 1024 * 1024


def test_a_head_trickled_byte_by_byte_does_not_hold_the_connection(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, _, _ = env
    with socket.create_connection(("127.0.0.1", handle.port), timeout=10) as s:
        start = time.monotonic()
        closed = False
        for byte in b"GET /healthz HTTP/1.1\r\nHost: " + b"x" * 200:  # each byte before the previous deadline
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_by_server(s, 0.05):
                closed = True
                break
        assert closed and time.monotonic() - start < 10 * HEAD_TIMEOUT_S


def test_a_streaming_client_that_goes_away_frees_its_slot(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, key, gate = env
    gate.allow(1)  # its first token, then the engine holds
    try:
        with socket.create_connection(("127.0.0.1", handle.port), timeout=10) as s:
            body = json.dumps({"model": "tiny", "prompt": "hold", "max_tokens": 60, "ignore_eos": True, "stream": True}).encode()
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while b"data: " not in got:  # headers and the first event may come in separate packets
                chunk = s.recv(65536)
                assert chunk
                got += chunk
            assert handle.service.in_flight == 1
        give_up = time.monotonic() + 10
        while handle.service.in_flight and time.monotonic() < give_up:
            time.sleep(0.005)
        assert handle.service.in_flight == 0
    finally:
        gate.open()


def test_lean_transport_reuses_connections_and_survives_a_closed_one(env: tuple[ServiceHandle, str, StepGate]) -> None:
    handle, key, _ = env

    async def main() -> None:
        transport = H11Transport()
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{handle.port}",
                                     headers={"Authorization": f"Bearer {key}"}) as c:
            for _ in range(4):
                assert (await c.get("/v1/models")).status_code == 200
            assert transport.opened == 1
            for _ in range(200):  # the server closes the idle connection at its head deadline
                if handle.http.connections == 0:
                    break
                await asyncio.sleep(HEAD_TIMEOUT_S / 10)
            assert (await c.get("/v1/models")).status_code == 200 and transport.opened == 2
        try:
            await H11Transport().handle_async_request(httpx.Request("GET", f"http://127.0.0.1:{_free_port()}/"))
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("expected a ConnectError")

    asyncio.run(main())


def test_the_drain_refuses_new_requests_and_lets_streams_finish(tmp_path_factory: pytest.TempPathFactory) -> None:
    loop = LoopThread()
    gate = StepGate()
    handle = ServiceHandle([small_model("tiny")], loop, yield_to=gate).start()
    client = openai.OpenAI(base_url=handle.base_url, api_key="none", max_retries=0, timeout=30.0)
    try:
        gate.allow(1)
        stream = client.completions.create(model="tiny", prompt="go", max_tokens=5, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        handle.core.draining = True  # what SIGTERM does first
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="new", max_tokens=2)
        assert info.value.status_code == 503 and info.value.code == "shutting_down"
        gate.open()
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason == "length"
    finally:
        gate.open()
        handle.close()
        loop.close()


def test_held_connections_do_not_exhaust_the_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A server with a cap of 4 connections: 8 idle ones leave requests answered or cleanly
    refused, the robot port answering, and are closed at the head deadline."""
    config = ServerConfig(policies=[PolicyConfig(ref="noop")], port=0, http_port=0, no_auth=True, ledger=None,
                          max_connections=4, open_timeout_s=1.0, text=[small_model("tiny")])
    loop = LoopThread()
    server = ChunklineServer(config)
    loop.run(server.start())
    try:
        assert server._text_http is not None
        http_port = server._text_http.port
        assert http_port is not None
        idle = [socket.create_connection(("127.0.0.1", http_port), timeout=10) for _ in range(8)]
        try:
            reply = _exchange(http_port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            # Answered, or refused: a 503, or closed at accept once the port holds its cap.
            assert reply == b"" or reply.startswith((b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 503 Service Unavailable\r\n"))
            robot = _exchange(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert robot.startswith(b"HTTP/1.1 200 OK\r\n")
            assert all(_closed_by_server(s, 10) for s in idle)  # reaped at the head deadline
        finally:
            for s in idle:
                s.close()
        assert _exchange(http_port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        loop.run(server.shutdown())
        loop.close()


def test_the_http_api_serves_tls_with_the_servers_certificate(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    config = ServerConfig(policies=[PolicyConfig(ref="noop")], port=0, http_port=0, no_auth=True, ledger=None,
                          tls_cert=cert, tls_key=key, text=[small_model("tiny")])
    loop = LoopThread()
    server = ChunklineServer(config)
    loop.run(server.start())
    try:
        assert server._text_http is not None and server._text_http.scheme == "https"
        port = server._text_http.port
        assert port is not None
        r = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=ssl.create_default_context(cafile=str(cert)), timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    finally:
        loop.run(server.shutdown())
        loop.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_accepted_connections_do_not_wait_for_delayed_acks(env: tuple[ServiceHandle, str, StepGate]) -> None:
    """TCP_NODELAY on every accepted socket: without it, the headers and the first event of a
    stream (two small writes) wait ~40 ms for the client's delayed ACK."""
    handle, _, _ = env

    async def nodelay() -> list[int]:
        server = handle.http._server
        assert server is not None
        return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for c in server.server_state.connections]

    with socket.create_connection(("127.0.0.1", handle.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 OK")
        flags = handle.loop.run(nodelay())
    assert flags and all(flags)
