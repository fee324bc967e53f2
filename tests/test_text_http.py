"""The HTTP shell (h11 server and the lean h11 transport): keep-alive, pipelining, limits,
malformed requests, disconnect detection, connection reuse."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx

from chunkline.server.text.http import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    Responder,
    json_response,
)
from chunkline.server.text.transport import H11Transport


class EchoApp:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        self.disconnects = 0
        self.hold = asyncio.Event()

    def check(self, request: HttpRequest) -> HttpResponse | None:
        if request.headers.get("authorization") != "Bearer ok":
            return json_response(401, {"error": "no"})
        return None

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        self.seen.append((request.method, request.path, request.body))
        if request.path == "/hold":
            # Stream until the client goes away.
            await responder.start_stream(200, [("Content-Type", "text/event-stream")])
            await responder.write(b"data: 1\n\n")
            await responder.disconnected.wait()
            self.disconnects += 1
            self.hold.set()
            return
        await responder.send(json_response(200, {"path": request.path, "len": len(request.body)}))


async def _raw(port: int, payload: bytes, read_until: int = 1) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    data = b""
    while data.count(b"HTTP/1.1 ") < read_until:
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        if not chunk:
            break
        data += chunk
    writer.close()
    return data


def test_keep_alive_pipelining_and_limits() -> None:
    async def main() -> None:
        app = EchoApp()
        server = HttpServer(app, max_body=100)
        port = await server.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer ok"}) as c:
                for i in range(3):  # one connection, kept alive
                    r = await c.post("/x", content=b"a" * i)
                    assert r.status_code == 200 and r.json() == {"path": "/x", "len": i}
                assert (await c.post("/big", content=b"b" * 101)).status_code == 413
            # two pipelined requests on one connection are answered in order
            req = b"GET /one HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ok\r\n\r\nGET /two HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ok\r\n\r\n"
            data = await _raw(port, req, read_until=2)
            assert data.index(b'"/one"') < data.index(b'"/two"')
            # garbage is a 400 and a closed connection
            assert (await _raw(port, b"NOT HTTP AT ALL\r\n\r\n")).startswith(b"HTTP/1.1 400")
            # refused in check(): 401, and the body never read
            assert (await _raw(port, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n")).startswith(b"HTTP/1.1 401")
            assert [p for _, p, _ in app.seen] == ["/x", "/x", "/x", "/one", "/two"]
        finally:
            await server.close()

    asyncio.run(main())


def test_a_client_going_away_sets_disconnected() -> None:
    async def main() -> None:
        app = EchoApp()
        server = HttpServer(app)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ok\r\n\r\n")
            await writer.drain()
            assert b"data: 1" in await asyncio.wait_for(reader.read(65536), 10)
            writer.transport.abort()
            await asyncio.wait_for(app.hold.wait(), 10)
            assert app.disconnects == 1
        finally:
            await server.close()

    asyncio.run(main())


def test_lean_transport_reuses_connections_and_survives_a_closed_one() -> None:
    async def main() -> None:
        app = EchoApp()
        server = HttpServer(app, idle_timeout_s=0.2)
        port = await server.start("127.0.0.1", 0)
        transport = H11Transport()
        try:
            async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer ok"}) as c:
                for i in range(4):
                    r = await c.post("/t", content=json.dumps({"i": i}).encode())
                    assert r.status_code == 200 and r.json()["len"] == len(json.dumps({"i": i}))
                assert transport.opened == 1
                await asyncio.sleep(0.5)  # the server closes the idle connection
                r = await c.post("/t", content=b"again")
                assert r.status_code == 200 and transport.opened == 2
                async with c.stream("GET", "/hold") as s:  # streamed, closed early: not reused
                    async for chunk in s.aiter_raw():
                        assert chunk.startswith(b"data: 1")
                        break
                await asyncio.wait_for(app.hold.wait(), 10)
            try:
                await H11Transport().handle_async_request(httpx.Request("GET", f"http://127.0.0.1:{_free_port()}/"))
            except httpx.ConnectError:
                pass
            else:
                raise AssertionError("expected a ConnectError")
        finally:
            await server.close()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
