"""A small HTTP/1.1 server: h11 (sans-I/O) for the protocol, a thin asyncio shell for the sockets.

The robot port's ``websockets`` handshake hook answers one complete response per request and
cannot stream server-sent events, so the OpenAI-compatible API has its own listener. h11 does the
HTTP: framing, keep-alive, chunked transfer encoding for streams, protocol errors; this module
only moves bytes between it and the socket and calls the application.

The application is two calls, as with ``websockets``' ``process_request``:

* ``app.check(request)`` with the headers only, **before any body is read** (authentication
  refuses here, so an unauthenticated client never gets its payload parsed); a response returned
  here is sent and the connection closed;
* ``await app.handle(request, responder)`` once the body is read (bounded by ``max_body``).
  ``responder`` sends one complete response or a stream; while the application runs, the
  connection is watched and :attr:`Responder.disconnected` is set when the client goes away
  (that is how a closed stream cancels its generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import h11

from chunkline.server.text.errors import ClientGone

__all__ = ["HttpRequest", "HttpResponse", "Responder", "HttpApp", "HttpServer", "json_response"]

log = logging.getLogger("chunkline.server.text")

_READ = 65536
T = TypeVar("T")


@dataclasses.dataclass
class HttpRequest:
    """One request.

    Args:
        method: ``GET``, ``POST``, ...
        path: the path, without the query.
        query: the query string (without ``?``).
        headers: lower-cased names to the last value of each (``get_all`` for repeated ones).
        peer: the client's IP address.
        body: the body (empty until read).
        context: the application's own data, carried from ``check`` to ``handle``.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    peer: str
    raw_headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    body: bytes = b""
    context: dict[str, Any] = dataclasses.field(default_factory=dict)

    def get_all(self, name: str) -> list[str]:
        """Every value of header ``name`` (lower case)."""
        return [v for k, v in self.raw_headers if k == name]


@dataclasses.dataclass
class HttpResponse:
    """A complete response.

    Args:
        status: the HTTP status.
        headers: extra headers (``Content-Length`` is added).
        body: the body.
    """

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def json_response(status: int, obj: Any, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    """A JSON response.

    Args:
        status: the HTTP status.
        obj: anything :func:`json.dumps` takes.
        headers: extra headers.
    """
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return HttpResponse(status, [("Content-Type", "application/json"), *(headers or [])], body)


class HttpApp(Protocol):
    """What the server calls (see the module docstring)."""

    def check(self, request: HttpRequest) -> HttpResponse | None: ...

    async def handle(self, request: HttpRequest, responder: Responder) -> None: ...


class Responder:
    """Sends the answer to one request: :meth:`send` once, or :meth:`start_stream`, :meth:`write`..., :meth:`end`.

    Args:
        conn: the h11 connection.
        writer: the socket's writer.
        disconnected: set when the client goes away.
    """

    def __init__(self, conn: h11.Connection, writer: asyncio.StreamWriter, disconnected: asyncio.Event) -> None:
        self._conn = conn
        self._writer = writer
        self.disconnected = disconnected
        self.started = False
        self.status: int | None = None
        self._pending = b""  # bytes framed by h11 and not yet written (headers wait for the first data)

    async def _put(self, *events: Any, flush: bool = True) -> None:
        if self.disconnected.is_set():
            raise ClientGone()
        data = b"".join(self._conn.send(e) or b"" for e in events)
        self._pending += data
        if not flush or not self._pending:
            return
        out, self._pending = self._pending, b""
        try:
            self._writer.write(out)
            await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            self.disconnected.set()
            raise ClientGone() from None

    async def send(self, response: HttpResponse) -> None:
        """Send a complete response.

        Raises:
            ClientGone: the client disconnected.
        """
        headers = [*response.headers, ("Content-Length", str(len(response.body)))]
        await self.start_stream(response.status, headers)
        await self.end(response.body)

    async def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Send the status and headers; without ``Content-Length`` the body is chunked.

        Raises:
            ClientGone: the client disconnected.
        """
        self.started = True
        self.status = status
        # Held until the first body bytes, so that headers and the first event go in one packet.
        await self._put(h11.Response(status_code=status, headers=[("Server", "chunkline"), *headers]), flush=False)

    def write_nowait(self, data: bytes) -> None:
        """Send part of the body without waiting for the socket (for per-token streaming from a
        callback; what a slow client has not read yet stays buffered, bounded by the answer's size).

        Raises:
            ClientGone: the client disconnected.
        """
        if self.disconnected.is_set() or self._writer.is_closing():
            self.disconnected.set()
            raise ClientGone()
        out = self._pending + self._conn.send(h11.Data(data=data))
        self._pending = b""
        self._writer.write(out)

    def end_nowait(self, data: bytes = b"") -> None:
        """Finish the body (with its last bytes) without waiting for the socket.

        Raises:
            ClientGone: the client disconnected.
        """
        if self.disconnected.is_set() or self._writer.is_closing():
            self.disconnected.set()
            raise ClientGone()
        out = self._pending + (self._conn.send(h11.Data(data=data)) if data else b"") + self._conn.send(h11.EndOfMessage())
        self._pending = b""
        self._writer.write(out)

    async def drain(self) -> None:
        """Wait until the socket has taken what was written.

        Raises:
            ClientGone: the client disconnected.
        """
        try:
            await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            self.disconnected.set()
            raise ClientGone() from None

    async def write(self, data: bytes) -> None:
        """Send part of the body.

        Raises:
            ClientGone: the client disconnected.
        """
        if data:
            await self._put(h11.Data(data=data))

    async def end(self, data: bytes = b"") -> None:
        """Finish the body, with its last bytes if given (one write for both).

        Raises:
            ClientGone: the client disconnected.
        """
        if data:
            await self._put(h11.Data(data=data), h11.EndOfMessage())
        else:
            await self._put(h11.EndOfMessage())


class HttpServer:
    """The asyncio shell around h11.

    Args:
        app: the application.
        max_body: largest request body accepted (413 beyond).
        idle_timeout_s: how long a kept-alive connection may sit idle, and how long a client may
            take to send a request's headers and body.
    """

    def __init__(self, app: HttpApp, *, max_body: int = 8 * 1024 * 1024, idle_timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port=0`` picks a free one)."""
        self._server = await asyncio.start_server(self._connection, host, port, limit=_READ)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and close open connections."""
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            await self._serve(conn, reader, writer, str(peer[0]) if peer else "?")
        except (ConnectionError, OSError, asyncio.TimeoutError, ClientGone):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug in one connection must not take the listener down
            log.exception("HTTP connection failed")
        finally:
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await _within(writer.wait_closed(), 1.0)

    async def _next_event(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await _within(reader.read(_READ), self.idle_timeout_s)
            conn.receive_data(data)

    async def _refuse(self, conn: h11.Connection, writer: asyncio.StreamWriter, response: HttpResponse) -> None:
        responder = Responder(conn, writer, asyncio.Event())
        response.headers.append(("Connection", "close"))
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            await responder.send(response)

    async def _serve(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        while True:
            try:
                event = await self._next_event(conn, reader)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await self._refuse(conn, writer, json_response(exc.error_status_hint, _http_error(exc.error_status_hint, "malformed HTTP request")))
                return
            if isinstance(event, (h11.ConnectionClosed, h11.EndOfMessage)) or event is h11.PAUSED:
                return
            if not isinstance(event, h11.Request):
                return
            target = event.target.decode("latin-1")
            path, _, query = target.partition("?")
            raw = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in event.headers]
            request = HttpRequest(event.method.decode("ascii", "replace"), path, query, dict(raw), peer, raw)
            early = self.app.check(request)
            if early is not None:
                await self._refuse(conn, writer, early)
                return
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                await self._refuse(conn, writer, json_response(413, _http_error(413, f"body larger than {self.max_body} bytes")))
                return
            body = bytearray()
            while True:
                try:
                    ev = await self._next_event(conn, reader)
                except h11.RemoteProtocolError as exc:
                    await self._refuse(conn, writer, json_response(exc.error_status_hint, _http_error(exc.error_status_hint, "malformed HTTP body")))
                    return
                if isinstance(ev, h11.Data):
                    body += ev.data
                    if len(body) > self.max_body:
                        await self._refuse(conn, writer, json_response(413, _http_error(413, f"body larger than {self.max_body} bytes")))
                        return
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    return  # the client went away mid-body
            request.body = bytes(body)
            disconnected = asyncio.Event()
            responder = Responder(conn, writer, disconnected)
            watcher = asyncio.get_running_loop().create_task(self._watch(conn, reader, disconnected))
            try:
                await self.app.handle(request, responder)
            finally:
                watcher.cancel()
                # asyncio.wait, not `await watcher`: the watcher's own CancelledError must not be
                # mistaken for (and swallow) a cancellation of this connection.
                await asyncio.wait([watcher])
            if disconnected.is_set() or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    @staticmethod
    async def _watch(conn: h11.Connection, reader: asyncio.StreamReader, disconnected: asyncio.Event) -> None:
        """While the application answers: notice the client going away (EOF or reset)."""
        try:
            while True:
                data = await reader.read(_READ)
                if not data:
                    disconnected.set()
                    return
                conn.receive_data(data)  # a pipelined next request: h11 keeps it for later
        except (ConnectionError, OSError):
            disconnected.set()
        except h11.RemoteProtocolError:
            disconnected.set()


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    # asyncio.timeout where available: asyncio.wait_for on 3.11 can lose a cancellation that
    # arrives as the awaited read completes, leaving a connection task alive after close().
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # pragma: no cover - Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


def _http_error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error", "param": None, "code": None}}
