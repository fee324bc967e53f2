"""A lean HTTP/1.1 transport for httpx: h11 over asyncio streams, with a keep-alive pool.

The upstream adapter sits on every request's time-to-first-token path, so what the gateway
spends per request counts. httpx's default transport (httpcore over anyio) costs several hundred
microseconds of Python per streamed request on this project's CPU; this transport does the same
job for the one thing the adapter needs (requests to a fixed set of hosts, streamed responses,
keep-alive) with h11, as the server side does, at a fraction of that. It plugs in as an httpx
transport (``httpx.AsyncClient(transport=H11Transport())``), so the adapter keeps httpx's API and
tests keep using ``httpx.MockTransport``.

Not supported (not needed by the adapter): proxies, HTTP/2, ``Expect: 100-continue``, upgrades.
Timeouts are the caller's (the adapter bounds every wait by the request's deadline); retries
are the caller's too (none here: one retry owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

import h11
import httpx

__all__ = ["H11Transport"]

_READ = 65536

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection]


class _Body(httpx.AsyncByteStream):
    """A response body read from the connection; the connection returns to the pool at its end."""

    def __init__(self, transport: H11Transport, key: tuple[str, str, int], conn: _Conn) -> None:
        self._transport = transport
        self._key = key
        self._conn: _Conn | None = conn

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._conn is None:
            return
        reader, _writer, h = self._conn
        try:
            while True:
                ev = h.next_event()
                if ev is h11.NEED_DATA:
                    h.receive_data(await reader.read(_READ))
                    continue
                if isinstance(ev, h11.Data):
                    yield bytes(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    conn, self._conn = self._conn, None
                    self._transport._release(self._key, conn)
                    return
                else:  # ConnectionClosed mid-body, or a protocol surprise
                    raise httpx.RemoteProtocolError("the connection closed before the response ended")
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc)) from None
        except (ConnectionError, OSError) as exc:
            raise httpx.ReadError(str(exc)) from None

    async def aclose(self) -> None:
        # Closed before its end (cancelled, or the caller stopped reading): the connection is in
        # an unknown state and cannot be reused.
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class H11Transport(httpx.AsyncBaseTransport):
    """An httpx transport on h11 with a keep-alive pool per host.

    Args:
        max_idle_per_host: idle connections kept per host.
        ssl_context: for ``https://`` upstreams (default: the system's trust store).
    """

    def __init__(self, max_idle_per_host: int = 64, ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_idle_per_host = max_idle_per_host
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self.opened = 0  # connections opened (tests check reuse)

    def _release(self, key: tuple[str, str, int], conn: _Conn) -> None:
        _reader, writer, h = conn
        if h.our_state is h11.DONE and h.their_state is h11.DONE and not writer.is_closing():
            h.start_next_cycle()
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.max_idle_per_host:
                idle.append(conn)
                return
        writer.close()

    async def _connect(self, key: tuple[str, str, int]) -> tuple[_Conn, bool]:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn[1].is_closing() and not conn[0].at_eof():
                return conn, True
            conn[1].close()
        scheme, host, port = key
        ctx = None
        if scheme == "https":
            ctx = self._ssl or ssl.create_default_context()
        reader, writer = await asyncio.open_connection(host, port, ssl=ctx, limit=_READ)
        self.opened += 1
        return (reader, writer, h11.Connection(h11.CLIENT)), False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        body = await request.aread()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"content-length", b"transfer-encoding")]
        if not any(k.lower() == b"host" for k, _ in headers):
            headers.insert(0, (b"Host", url.netloc))
        headers.append((b"Content-Length", str(len(body)).encode()))
        while True:
            try:
                conn, reused = await self._connect(key)
            except (OSError, ssl.SSLError) as exc:
                raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
            reader, writer, h = conn
            try:
                writer.write(h.send(h11.Request(method=request.method, target=url.raw_path, headers=headers))
                             + (h.send(h11.Data(data=body)) if body else b"") + h.send(h11.EndOfMessage()))
                await writer.drain()
                while True:
                    ev = h.next_event()
                    if ev is h11.NEED_DATA:
                        h.receive_data(await reader.read(_READ))
                        continue
                    if isinstance(ev, h11.Response):
                        break
                    if isinstance(ev, h11.InformationalResponse):
                        continue
                    raise httpx.RemoteProtocolError("the connection closed without a response")
            except (ConnectionError, OSError, httpx.RemoteProtocolError, h11.ProtocolError) as exc:
                writer.close()
                if reused:
                    # A kept-alive connection the server had closed while it sat idle: send on a
                    # fresh one (the request never reached an open connection; not a retry).
                    continue
                raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
            except BaseException:
                writer.close()
                raise
            return httpx.Response(
                ev.status_code,
                headers=[(bytes(k), bytes(v)) for k, v in ev.headers],
                stream=_Body(self, key, conn),
                extensions={"http_version": b"HTTP/1.1", "reason_phrase": bytes(ev.reason)},
                request=request,
            )

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for _, writer, _ in idle:
                with contextlib.suppress(Exception):
                    writer.close()
        self._idle.clear()
