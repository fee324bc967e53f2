"""The HTTP listener: uvicorn (with h11) serving an ASGI application inside the server's own event
loop, with the limits, TLS and graceful shutdown of the server's configuration.

uvicorn runs as tasks on the running loop, not ``uvicorn.run``/``serve`` (those own the process's
signals and exit on a bind error). Added here: a deadline for each request's head that further
bytes do not restart (a trickling client cannot hold a connection); ambiguous body framing
(``Content-Length`` with ``Transfer-Encoding``, two lengths, a coding other than ``chunked``)
answered ``400`` with ``Connection: close`` before the body is read, so no smuggled request is
ever read; a connection handed over only once it sends (or after the head deadline); and at
most ``min(max_connections, open-files limit - fd_headroom)`` connections (the soft limit raised
at start), one beyond closed at accept and counted, so idle connections here never take the fds
the robot port needs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

if TYPE_CHECKING:
    from chunkline.server.config import ServerConfig

__all__ = ["HttpLimits", "HttpServer"]

log = logging.getLogger("chunkline.server.http")

#: the reason counted for a connection closed because the port's share of the fds is full
FD_RESERVE = "fd_reserve"
_LOG_EVERY_S = 10.0
#: the soft open-files limit is raised to the hard one, at most this (an "unlimited" hard limit)
_NOFILE_CEILING = 1 << 20
#: A request head's deadline is drawn between (1 - this) x ``head_timeout_s`` and ``head_timeout_s``:
#: connections opened together (a flood) are then not all closed in one turn of the loop, nor
#: reopened by their client and accepted again in one.
HEAD_DEADLINE_SPREAD = 0.25


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (at most ``_NOFILE_CEILING``); returns the
    soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, _NOFILE_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("open-files limit stays %d (raising it to %d failed: %s)", soft, target, exc)
            return soft
        log.info("open-files limit raised from %d to %d", soft, target)
        return target
    return _NOFILE_CEILING if soft == resource.RLIM_INFINITY else soft


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one HTTP listener allows.

    Args:
        max_connections: connections served at once; requests beyond get ``503`` and the
            connection closed (uvicorn's ``limit_concurrency``).
        fd_headroom: open files kept from this port: it holds at most the open-files limit
            minus this many connections (closed as soon as accepted beyond).
        head_timeout_s: most seconds from a connection's start (or its previous response) to a
            complete request head; an idle or trickling client is disconnected (each deadline
            drawn at least ``1 - HEAD_DEADLINE_SPREAD`` of this).
        max_head_bytes: largest request head (h11's ``max_incomplete_event_size``: 431/400 beyond).
        backlog: the listening socket's accept queue.
        graceful_timeout_s: at shutdown, how long responses in flight may take to finish.
        tls_cert, tls_key: PEM files: serve ``https://``.
    """

    max_connections: int = 1024
    fd_headroom: int = 512
    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 * 1024
    backlog: int = 1024
    graceful_timeout_s: float = 10.0
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def from_server_config(cls, config: ServerConfig) -> HttpLimits:
        """The robot port's limits applied to the HTTP port: the connection cap, the handshake
        timeout as the request-head deadline, the shutdown grace period and the TLS files."""
        return cls(max_connections=config.max_connections, fd_headroom=config.fd_headroom, head_timeout_s=config.open_timeout_s,
                   backlog=min(config.max_connections, 4096),
                   graceful_timeout_s=config.shutdown_grace_s, tls_cert=config.tls_cert, tls_key=config.tls_key)


def _framing_error(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's body framing is ambiguous (``None``: it is not)."""
    lengths = [v for k, v in headers if k == b"content-length"]
    codings = [v for k, v in headers if k == b"transfer-encoding"]
    if lengths and codings:
        return "Content-Length and Transfer-Encoding together"
    if len(lengths) > 1:
        return "more than one Content-Length"
    if len(codings) > 1 or (codings and codings[0].strip().lower() != b"chunked"):
        return "a Transfer-Encoding other than one chunked"
    return None


class _FramingGuard:
    """Pure ASGI: a request with ambiguous body framing gets ``400`` and its connection closed
    (the response says ``Connection: close``; h11 then reads nothing more from it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = _framing_error(scope["headers"]) if scope["type"] == "http" else None
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = f'{{"error":{{"message":"{problem}","type":"invalid_request_error","param":null,"code":"invalid_request"}}}}'.encode()
        start = {"type": "http.response.start", "status": 400,
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                             (b"connection", b"close")]}
        try:
            await send(start)
            await send({"type": "http.response.body", "body": body})
        except h11.LocalProtocolError:
            pass  # the server already answered a malformed body of it (400) and is closing


class _AcceptCap:
    """How many connections a listener holds, and the count and rate-limited log of refusals."""

    def __init__(self, max_open: int, on_refused: Callable[[str], None] | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_open = max_open
        self.on_refused = on_refused
        self.refused = 0
        self._clock = clock
        self._logged_at = -_LOG_EVERY_S
        self._unlogged = 0

    def refuse(self, open_now: int) -> None:
        self.refused += 1
        self._unlogged += 1
        if self.on_refused is not None:
            self.on_refused(FD_RESERVE)
        now = self._clock()
        if now - self._logged_at >= _LOG_EVERY_S:
            log.warning("HTTP port full: %d connections open (at most %d, the rest of the open files kept for the robot port); "
                        "%d connections closed at accept since the last such line", open_now, self.max_open, self._unlogged)
            self._logged_at, self._unlogged = now, 0


class _HeadDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a per-request deadline for the request head (see the module docstring)."""

    head_timeout_s = 10.0
    #: draws each deadline within HEAD_DEADLINE_SPREAD (set per listener, see HttpServer.start)
    deadline_draw: random.Random = random.Random()
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Small writes (headers, then a token's event) must not wait for the client's delayed
        # ACK: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and a socket
        # made by socket.create_server (proto 0) passes that on to every accepted one.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        deadline_s = self.head_timeout_s * (1.0 - HEAD_DEADLINE_SPREAD * self.deadline_draw.random())
        self._head_timer = self.loop.call_later(deadline_s, self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        # Still waiting for a request's head (idle, or bytes trickling in): close. A request
        # being read or answered is not this timer's business.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _AcceptGate(asyncio.Protocol):
    """The protocol uvicorn makes for each accepted connection: at ``connection_made``, one beyond
    the cap is aborted (its fd released at once) and nothing else is built for it, since an
    attacker reconnecting as fast as it is closed makes this the path every refused connection
    takes; any other is handed to uvicorn's protocol (``transport.set_protocol``), which from then
    on gets every callback."""

    #: set per listener (see HttpServer.start)
    cap: _AcceptCap
    protocol: type[_HeadDeadlineH11]

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._config, self._server_state, self._app_state, self._loop = config, server_state, app_state, _loop

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        open_now = len(self._server_state.connections)
        if open_now >= self.cap.max_open:
            self.cap.refuse(open_now)
            transport.abort()  # connection_lost follows
            return
        protocol = self.protocol(self._config, self._server_state, self._app_state, self._loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        return None  # refused: nothing was built for it


def _defer_accept(sock: socket.socket, seconds: float) -> None:
    """Leave each connection in the kernel until its first bytes arrive, for up to ``seconds``
    (Linux ``TCP_DEFER_ACCEPT``; elsewhere nothing). HTTP clients speak first, so this costs a
    client nothing, and a connection that sends nothing holds no fd of the server (an idle flood
    is not refused at accept and reopened in a loop); one past the wait is accepted and held to
    the request-head deadline like any other."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, round(seconds)))


class HttpServer:
    """An ASGI application on uvicorn, on the running event loop.

    Args:
        app: the ASGI application.
        limits: connection cap, timeouts, TLS.
        on_refused: called with the reason for each connection closed at accept (a metric).
        deadline_draw: draws each request head's deadline within ``HEAD_DEADLINE_SPREAD``.
    """

    def __init__(self, app: ASGIApp, limits: HttpLimits | None = None, on_refused: Callable[[str], None] | None = None,
                 deadline_draw: random.Random | None = None) -> None:
        self.app: ASGIApp = _FramingGuard(app)
        self.limits = limits or HttpLimits()
        self.on_refused = on_refused
        self.deadline_draw = deadline_draw or random.Random()
        #: the accept-time cap in force once started
        self.cap: _AcceptCap | None = None
        self._server: uvicorn.Server | None = None
        self._sockets: list[socket.socket] = []
        self._main: asyncio.Task[None] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.limits.tls_cert is not None else "http"

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (``0``: a free port) and serve; returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        limits = self.limits
        nofile = raise_open_files_limit()
        max_open = min(limits.max_connections, nofile - limits.fd_headroom)
        if max_open < 1:
            log.warning("the open-files limit (%d) leaves the HTTP port no connections beyond fd_headroom (%d); it holds one",
                        nofile, limits.fd_headroom)
        self.cap = _AcceptCap(max(1, max_open), self.on_refused)
        protocol: type[_HeadDeadlineH11] = type("HeadDeadlineH11", (_HeadDeadlineH11,),
                                                {"head_timeout_s": limits.head_timeout_s, "deadline_draw": self.deadline_draw})
        gate: type[_AcceptGate] = type("AcceptGate", (_AcceptGate,), {"cap": self.cap, "protocol": protocol})
        config = uvicorn.Config(
            self.app,
            http=gate,
            lifespan="off",
            log_config=None,  # the server's logging stays as the server set it up
            access_log=False,
            proxy_headers=False,  # the peer address is what rate-limits failed authentication
            server_header=False,
            headers=[("server", "chunkline")],
            limit_concurrency=limits.max_connections,
            timeout_keep_alive=max(1, round(limits.head_timeout_s)),
            h11_max_incomplete_event_size=limits.max_head_bytes,
            backlog=limits.backlog,
            timeout_graceful_shutdown=max(1, round(limits.graceful_timeout_s)),
            ssl_certfile=limits.tls_cert,
            ssl_keyfile=limits.tls_key,
        )
        config.load()
        # Our own socket: a bind error is an OSError here, not uvicorn's sys.exit.
        sock = socket.create_server((host, port), backlog=limits.backlog)
        _defer_accept(sock, limits.head_timeout_s)
        sock.setblocking(False)
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._server, self._sockets = server, [sock]
        self._main = asyncio.get_running_loop().create_task(server.main_loop(), name="chunkline-http")
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Graceful stop: no new connections, idle ones closed, responses in flight finish
        (within ``graceful_timeout_s``; then they are cancelled)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        if self._main is not None:
            await self._main
            self._main = None
        await server.shutdown(sockets=self._sockets)
        self._sockets = []

    @property
    def port(self) -> int | None:
        """The bound port while listening."""
        return int(self._sockets[0].getsockname()[1]) if self._sockets else None

    @property
    def connections(self) -> int:
        """Open connections (for tests and metrics)."""
        return len(self._server.server_state.connections) if self._server is not None else 0


